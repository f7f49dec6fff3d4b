"""KLA+ (Kalman paper App. A, Eq. 24–25): ``KalmixConfig(mc_samples=S)`` reads out posterior samples of the Kalman
layers and returns the Monte-Carlo marginal log-probs, whose cross-entropy is the negative log marginal likelihood."""
import math

import pytest
import torch
import torch.nn.functional as F

from kalmix.layers import MIXERS
from kalmix.layers.documents import Documents
from kalmix.models import KalmixCache, KalmixConfig, KalmixForCausalLM, KalmixModel
from kalmix.models.decoding import Decoder
from kalmix.ops import kalman_attention
from tests.models.test_models import config

MIXED = ["kalman", "attention", "kalman"]


def twins(mixers=MIXED, S=3, seed=0, **kw):
    """(KLA+ model with mc_samples = S, the same weights with mc_samples = 0), fp64, eval."""
    torch.manual_seed(seed)
    plus = KalmixForCausalLM(config(mixers, mc_samples=S, **kw)).double().eval()
    mean = KalmixForCausalLM(config(mixers, **kw)).double().eval()
    mean.load_state_dict(plus.state_dict())
    return plus, mean


def kalman_layers(m):
    return [b.mixer for b in m.model.layers if b.mixer_type == "kalman"]


def record_noise(monkeypatch, m):
    """Each Kalman layer's draws of ε, in call order: {layer: [ε, ...]}."""
    draws = {}
    for layer in kalman_layers(m):
        def noise(var, layer=layer, draw=layer.readout_noise):
            draws.setdefault(layer, []).append(draw(var))
            return draws[layer][-1]
        monkeypatch.setattr(layer, "readout_noise", noise)
    return draws


# (inputs of the forward, labels' scored mask [B, T - 1] besides the labels' own -100s); B = 2, T = 10
CU = torch.tensor([0, 4, 10, 13, 20])
INPUTS = {
    "plain": {},
    "padding": {"attention_mask": torch.tensor([[0] * 3 + [1] * 7, [1] * 10])},
    "cu_seqlens": {"cu_seqlens": CU},
    "position_ids": {"position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]])},
}


@pytest.mark.parametrize("inputs", list(INPUTS))
def test_loss_is_eq25_over_single_sample_forwards_with_the_same_noise(monkeypatch, inputs):
    S, B = 4, 2
    kw = INPUTS[inputs]
    plus, mean = twins(S=S)
    x = torch.randint(0, 37, (B, 10))
    labels = x.masked_fill(kw["attention_mask"] == 0, -100) if "attention_mask" in kw else x
    draws = record_noise(monkeypatch, plus)
    out = plus(x, labels=labels, **kw)
    assert out.logits.shape == (B, 10, 37) and all(len(d) == 1 for d in draws.values())
    logp = []                                   # [S, B, T, V]: log p(· | y^(s)) of sample s alone
    for s in range(S):
        for layer, plus_layer in zip(kalman_layers(mean), kalman_layers(plus)):
            monkeypatch.setattr(layer, "readout_noise", lambda var, e=draws[plus_layer][0][s * B:(s + 1) * B]: e)
        logp.append(F.log_softmax(mean(x, sample_readout=True, **kw).logits, -1))
    logp = torch.stack(logp)
    torch.testing.assert_close(out.logits, torch.logsumexp(logp, 0) - math.log(S))
    # Eq. 25 by hand: −logsumexp_s log p_s(o_t) + log S over the scored positions
    targets = labels[:, 1:]
    if inputs in ("cu_seqlens", "position_ids"):          # each document's first token is not predicted
        targets = targets.masked_fill(Documents("test", CU, B, 10).doc_pos[:, 1:] == 0, -100)
    scored = targets != -100
    picked = logp[:, :, :-1].gather(-1, targets.clamp_min(0)[None, ..., None].expand(S, -1, -1, 1))[..., 0]
    nll = -torch.logsumexp(picked, 0) + math.log(S)
    torch.testing.assert_close(out.loss, nll[scored].mean())


def test_one_sample_with_zero_noise_is_the_posterior_mean_model(monkeypatch):
    plus, mean = twins(S=1)
    for layer in kalman_layers(plus):
        monkeypatch.setattr(layer, "readout_noise", lambda var: torch.zeros_like(var))
    x = torch.randint(0, 37, (2, 11))
    out, ref = plus(x, labels=x), mean(x, labels=x)
    torch.testing.assert_close(out.logits, F.log_softmax(ref.logits, -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-12)


def test_sampled_readout_is_the_mean_plus_scaled_noise():
    """The layer's sample is o + √var · ε for its ε (checked through the readout by hand), and its draws have the
    mean and the variance ``output_variance`` propagates (4000 draws, 5-sigma bounds on every element)."""
    torch.manual_seed(0)
    layer = MIXERS["kalman"](24, d_state=4, num_heads=2).double()
    x = torch.randn(1, 6, 24, dtype=torch.float64)
    eps = torch.randn(1, 6, 2, 24, dtype=torch.float64)
    layer.readout_noise = lambda var: eps
    (q, k, v, w), ctx, _ = layer.project(layer.project_in(x), None)
    o, var, _ = kalman_attention(q, k, v, w, *layer.dynamics(), output_variance=True)
    torch.testing.assert_close(layer(x, sample_readout=True)[0], layer.readout(o + var.sqrt() * eps, None, ctx)[0])
    del layer.readout_noise

    S = 4000
    mu, sigma2, _ = layer(x, output_variance=True)
    with torch.no_grad():
        draws = layer(x.expand(S, -1, -1), sample_readout=True)[0]
    bound = 5 * (sigma2 / S).sqrt()
    assert ((draws.mean(0) - mu[0]).abs() <= bound[0]).all()
    assert ((draws.var(0) - sigma2[0]).abs() <= 5 * sigma2[0] * math.sqrt(2 / (S - 1))).all()


def test_gradients_reach_the_dynamics_through_the_variance():
    torch.manual_seed(0)
    layer = MIXERS["kalman"](24, d_state=4, num_heads=2).double()
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    eps = torch.randn(2, 9, 2, 24, dtype=torch.float64)
    layer.readout_noise = lambda var: eps
    # the sample minus the mean is √var · ε alone: its gradient is the variance path's
    (layer(x, sample_readout=True)[0] - layer(x)[0]).square().sum().backward()
    for name in ("p", "A_log", "dt_raw"):
        g = getattr(layer, name).grad
        assert torch.isfinite(g).all() and g.abs().sum() > 0, name

    plus, mean = twins(S=2)
    x = torch.randint(0, 37, (2, 10))
    mask = torch.tensor([[0] * 3 + [1] * 7, [1] * 10])              # padding: zero variance where padded
    labels = x.masked_fill(mask == 0, -100)
    grads = []
    for m in (mean, plus):
        m.train()(x, attention_mask=mask, labels=labels).loss.backward()
        for n, p in m.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
        grads.append(kalman_layers(m)[0].p.grad)
    assert not torch.allclose(grads[0], grads[1])


def test_gradient_checkpointing_replays_the_same_noise():
    x = torch.randint(0, 37, (2, 10))
    grads = []
    for ckpt in (False, True):
        plus, _ = twins(S=2)
        plus.train()
        if ckpt:
            plus.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(1)
        plus(x, labels=x).loss.backward()
        grads.append({n: p.grad for n, p in plus.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-10, atol=1e-12, msg=n)


def test_documents_repeat_copies_the_batch():
    docs = Documents("test", CU, 2, 10)
    rep = docs.repeat(3)
    assert (rep.B, rep.T) == (6, 10)
    assert torch.equal(rep.doc_pos, docs.doc_pos.repeat(3, 1))
    assert torch.equal(rep.doc_id, torch.cat([docs.doc_id + 4 * i for i in range(3)]))


def test_mc_samples_is_saved_and_loaded(tmp_path):
    config(MIXED, mc_samples=5).save_pretrained(tmp_path)
    assert KalmixConfig.from_pretrained(tmp_path).mc_samples == 5


@pytest.mark.parametrize("kw, match", [
    (dict(mc_samples=-1), "must be an int >= 0"),
    (dict(mc_samples=1.5), "must be an int >= 0"),
    (dict(mc_samples=True), "must be an int >= 0"),
    (dict(mixers=["attention", "gka"], mc_samples=2), "`mixers` has none; set mc_samples = 0"),
])
def test_config_refuses_bad_mc_samples(kw, match):
    with pytest.raises(ValueError, match=match):
        config(kw.pop("mixers", MIXED), **kw)


def test_cached_decoding_and_generate_are_refused():
    plus, _ = twins(S=2)
    x = torch.randint(0, 37, (1, 5))
    for kw in (dict(use_cache=True), dict(cache=KalmixCache()), dict(past_key_values=KalmixCache())):
        with pytest.raises(ValueError, match="no cached decoding.*set config.mc_samples = 0"):
            plus(x, **kw)
    with pytest.raises(ValueError, match="`generate` with mc_samples = 2.*set config.mc_samples = 0"):
        plus.generate(x, max_new_tokens=2)
    with pytest.raises(ValueError, match="no cached decoding"):
        Decoder(plus, 1, 8, graph=False).generate(x, 2)
    out = plus(x)                                       # eval with use_cache unset: scored without a cache
    assert getattr(out, "cache", getattr(out, "past_key_values", None)) is None
    with pytest.raises(ValueError, match="`sample_readout`.*has none"):
        KalmixModel(config(["attention"]))(x, sample_readout=True)
