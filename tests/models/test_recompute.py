"""``KalmixConfig(recompute_mixers=True)``: every recurrent mixer gives the loss and every gradient of the model
that keeps its activations, bit for bit, on plain rows, packed documents and padded rows; it runs the mixer's
projections again in the backward, and saves less."""
import copy

import pytest
import torch

from kalmix.bench.memory import saved_tensors
from kalmix.layers.base import MixerLayer
from kalmix.models import KalmixConfig, KalmixForCausalLM

MIXERS = ["gdn", "kaczmarz", "gka", "vla", "kalman"]


def _pair(mixer: str, **over):
    torch.manual_seed(0)
    kwargs = {} if mixer == "kalman" else {mixer: {"num_heads": 2}}
    cfg = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, mixer=mixer, mixer_kwargs=kwargs, **over)
    keep = KalmixForCausalLM(KalmixConfig(**cfg)).double().train()
    again = KalmixForCausalLM(KalmixConfig(**cfg, recompute_mixers=True)).double().train()
    again.load_state_dict(keep.state_dict())
    return keep, again


def _loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize("rows", ["plain", "packed", "padded"])
def test_recomputed_mixers_give_the_same_loss_and_gradients(mixer, rows):
    keep, again = _pair(mixer)
    ids = torch.randint(0, 61, (2, 23))
    inputs = {"input_ids": ids, "labels": ids}
    if rows == "packed":
        inputs["cu_seqlens"] = torch.tensor([0, 5, 23, 31, 46])
    elif rows == "padded":
        mask = torch.ones_like(ids)
        mask[0, :6] = 0
        inputs.update(attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    calls = []
    for layer in again.modules():
        if isinstance(layer, MixerLayer):
            assert layer.recompute
            layer.register_forward_pre_hook(lambda *a: None)        # hooks do not change what is recomputed
            project = layer.project
            layer.project = lambda *a, _p=project, **k: (calls.append(1), _p(*a, **k))[1]
    loss, grads = _loss_and_grads(keep, **inputs)
    loss2, grads2 = _loss_and_grads(again, **inputs)
    assert torch.equal(loss, loss2)
    assert grads.keys() == grads2.keys() and len(grads) == len(list(keep.parameters()))
    for name in grads:
        assert torch.equal(grads[name], grads2[name]), name
    assert len(calls) == 4                  # 2 layers, each projected in the forward and again in the backward


@pytest.mark.parametrize("mixer", MIXERS)
def test_recomputed_mixers_save_less_and_decoding_is_unchanged(mixer):
    keep, again = _pair(mixer)
    ids = torch.randint(0, 61, (2, 64))

    def mixer_bytes(model):
        rows = saved_tensors(model, lambda: model(input_ids=ids, labels=ids).loss)
        return sum(r["bytes"] for r in rows if ".mixer" in r["module"])
    kept, recomputed = mixer_bytes(keep), mixer_bytes(again)
    h = 2 * 64 * again.model.layers[0].mixer.project_in(torch.zeros(1, 1, 32, dtype=torch.float64)).shape[-1] * 8
    assert h <= recomputed < 0.8 * kept, (recomputed, kept)      # the input projection's output stays
    keep.eval(), again.eval()
    with torch.no_grad():
        a = keep.generate(ids[:, :5], max_new_tokens=4, do_sample=False)
        b = again.generate(ids[:, :5], max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b)


def test_recompute_mixers_must_be_a_bool():
    with pytest.raises(ValueError, match=r"`recompute_mixers` must be True or False, got 'yes'"):
        KalmixConfig(recompute_mixers="yes")
