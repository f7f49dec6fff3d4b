"""Bad inputs at the model boundary: KalmixConfig values, forward inputs, generate() arguments, each a ValueError
naming the argument; value checks read on CPU and asserted on the device elsewhere, with no host read."""
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import GenerationConfig

import kalmix.layers.common as common
from kalmix.models import KalmixCache, KalmixConfig
from kalmix.models.decoding import Decoder, generate_text
from tests.models.test_models import HYBRID, config, model

V = 37              # the vocabulary of tests.models.test_models.model


@pytest.mark.parametrize("kw, match", [
    (dict(num_hidden_layers=0, mixers=[]), "`num_hidden_layers` must be an int >= 1, got 0"),
    (dict(vocab_size=0), "`vocab_size` must be an int >= 1, got 0"),
    (dict(vocab_size=True), "`vocab_size` must be an int >= 1, got True"),
    (dict(hidden_size=0), "`hidden_size` must be an int >= 1, got 0"),
    (dict(hidden_size=16.0), "`hidden_size` must be an int >= 1, got 16.0"),
    (dict(intermediate_size=0), "`intermediate_size` must be an int >= 1, got 0"),
    (dict(norm_eps=0.0), "`norm_eps` must be a finite number > 0"),
    (dict(initializer_range=-0.02), "`initializer_range` must be a finite number > 0"),
    (dict(embedding_init_std=0), "`embedding_init_std` must be a finite number > 0"),
    (dict(mlp="no"), "`mlp` must be True or False"),
    (dict(tie_word_embeddings=1), "`tie_word_embeddings` must be True or False"),
    (dict(mixer_kwargs="gka"), "`mixer_kwargs` must map mixer names to dicts"),
    (dict(mixers="gka"), "`mixers` must be a list of mixer names"),
    (dict(mixer_kwargs={"gka": {"num_heads": 3}}), r"'gka' layers .*GatedKalmaNet: `num_heads` = 3 must divide "
                                                   r"d_model = 16 into equal heads; allowed: \[1, 2, 4, 8, 16\]"),
    (dict(mixer_kwargs={"gka": {"num_heads": 0}}), "GatedKalmaNet: `num_heads` must be an int >= 1, got 0"),
    (dict(mixer_kwargs={"gka": {"head_dim": -4}}), "GatedKalmaNet: `head_dim` must be an int >= 1, got -4"),
    (dict(mixers=["kalman", "attention"], mixer_kwargs={"kalman": {"d_state": 0}}),
     "KalmanAttention: `d_state` must be an int >= 1, got 0"),
    (dict(mixers=["attention", "attention"], mixer_kwargs={"attention": {"num_heads": 16}}),
     "SoftmaxAttention: the head size d_model / num_heads = 16 / 16 = 1 must be even"),
    (dict(mixer_kwargs={"attention": {"num_heads": 3}}), "SoftmaxAttention: `num_heads` = 3 must divide"),
    (dict(mixers=["mamba2", "mamba2"], mixer_kwargs={"mamba2": {"num_heads": 2}}, impl="triton"),
     "Mamba2 runs kalmix's pure-PyTorch"),
])
def test_config_refuses_bad_values_at_construction(kw, match):
    base = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, mixers=["gka", "gka"], intermediate_size=32)
    with pytest.raises(ValueError, match=match):
        KalmixConfig(**{**base, **kw})


@pytest.mark.parametrize("kw, match", [
    (dict(attention_every=1.5), "`attention_every` must be an int >= 1, got 1.5"),
    (dict(attention_layers=[2]), r"attention layer 2 is out of range for 2 layers \(allowed: ints in \[-2, 2\)\)"),
    (dict(attention_layers=[0.0]), "attention layer 0.0 is out of range"),
    (dict(attention_layers=1), "`attention_layers` must be a list of layer indices"),
    (dict(attention_layers=[0, 0]), r"attention layer 0 is given twice; give each layer once"),
    (dict(attention_layers=[1, -1]), r"attention layer -1 is given twice \(as 1: negative indices count from the end\)"),
])
def test_layer_pattern_refuses_bad_positions(kw, match):
    with pytest.raises(ValueError, match=match):
        KalmixConfig(num_hidden_layers=2, mixer="gka", **kw)


def test_config_checks_draw_no_random_numbers_and_round_trip():
    """Checking the layers' arguments leaves the CPU generator as it was (a model seeded before its config gets the
    same weights); to_dict / from_dict round-trips."""
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    cfg = config(HYBRID)
    assert torch.equal(torch.rand(3), want)
    again = KalmixConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()
    assert KalmixConfig().mixers == ["gka"] * 8                 # transformers builds the defaults


def test_config_checks_build_the_layers_on_the_meta_device(monkeypatch):
    """A width whose layer would take terabytes on the CPU is checked in no memory. The conftest's NaN-filling
    torch.empty is put back to torch's own for this: the meta device context recognises torch.empty by identity
    (in a set it caches at first use)."""
    from torch.utils import _device
    monkeypatch.setattr(torch, "empty", torch._C._VariableFunctions.empty)
    _device._device_constructors.cache_clear()
    try:
        cfg = KalmixConfig(vocab_size=V, hidden_size=2 ** 20, num_hidden_layers=1, mixers=["gka"])
    finally:
        _device._device_constructors.cache_clear()
    assert cfg.hidden_size == 2 ** 20


def test_config_checks_a_layer_whose_package_is_missing_up_to_its_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.layers", None)       # `from fla.layers import ...` raises ImportError
    kw = dict(vocab_size=V, hidden_size=16, num_hidden_layers=1, mixers=["deltanet"])
    with pytest.raises(ValueError, match="FlaDeltaNet: `num_heads` = 3 must divide d_model = 16"):
        KalmixConfig(**kw, mixer_kwargs={"deltanet": {"num_heads": 3}})
    assert KalmixConfig(**kw, mixer_kwargs={"deltanet": {"num_heads": 2}}).mixers == ["deltanet"]


@pytest.fixture(scope="module")
def lm():
    return model(["gka", "attention", "kalman"], dtype=torch.float32)


IDS = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0))
META = "meta"           # a device no tensor of the test model is on


@pytest.mark.parametrize("kw, match", [
    (dict(input_ids=torch.full((2, 5), V)), rf"`input_ids` must be token ids in \[0, vocab_size = {V}\), got ids "
                                            rf"from {V} to {V}"),
    (dict(input_ids=torch.tensor([[0, -1, 3]])), r"token ids in \[0, vocab_size = 37\), got ids from -1 to 3"),
    (dict(input_ids=IDS[0]), r"`input_ids` must be an int64 or int32 tensor \[B, T\] of token ids \(one sequence: "
                             r"input_ids\[None\]\), got a torch.int64 tensor of shape \[5\]"),
    (dict(input_ids=IDS[None]), r"`input_ids` must be an int64 or int32 tensor \[B, T\]"),
    (dict(input_ids=IDS.float()), r"`input_ids` must be an int64 or int32 tensor \[B, T\] of token ids, got a "
                                  r"torch.float32"),
    (dict(input_ids=IDS.bool()), r"`input_ids` must be an int64 or int32 tensor"),
    (dict(input_ids=IDS.to(torch.uint8)), r"`input_ids` must be an int64 or int32 tensor .*, got a torch.uint8"),
    (dict(input_ids=IDS.tolist()), r"`input_ids` must be an int64 or int32 tensor \[B, T\] of token ids, got list"),
    (dict(input_ids=IDS[:0]), r"`input_ids` must hold at least one sequence \(B >= 1\)"),
    (dict(input_ids=IDS.to(META)), "`input_ids` is on meta but the model is on cpu"),
    (dict(), "pass exactly one of `input_ids` .* and `inputs_embeds`"),
    (dict(input_ids=IDS, inputs_embeds=torch.zeros(2, 5, 16)), "pass exactly one of `input_ids`"),
    (dict(inputs_embeds=torch.full((2, 5, 16), float("nan"))), r"`inputs_embeds` must be finite \(no NaN or Inf\)"),
    (dict(inputs_embeds=torch.full((2, 5, 16), float("inf"))), "`inputs_embeds` must be finite"),
    (dict(inputs_embeds=torch.zeros(2, 5, 15)), r"`inputs_embeds` must be a floating-point tensor \[B, T, "
                                                r"hidden_size\] = \[B, T, 16\], got a torch.float32 tensor of shape"),
    (dict(inputs_embeds=torch.zeros(5, 16)), r"`inputs_embeds` must be a floating-point tensor \[B, T, hidden_size\]"),
    (dict(inputs_embeds=torch.zeros(2, 5, 16, dtype=torch.long)), r"`inputs_embeds` must be a floating-point"),
    (dict(inputs_embeds=torch.zeros(2, 5, 16, dtype=torch.float64)),
     "`inputs_embeds` are torch.float64 but the model's weights are torch.float32"),
    (dict(input_ids=IDS, attention_mask=torch.ones(2, 4)), r"`attention_mask` must be a padding mask \[B, T\] = "
                                                          r"\[2, 5\] \(1 = token, 0 = padding\), got a torch.float32 "
                                                          r"tensor of shape \[2, 4\]"),
    (dict(input_ids=IDS, attention_mask=torch.ones(2, 7)), r"`attention_mask` must be a padding mask \[B, T\] = "
                                                          r"\[2, 5\]"),
    (dict(input_ids=IDS, attention_mask=torch.ones(5)), r"`attention_mask` must be a padding mask \[B, T\]"),
    (dict(input_ids=IDS, attention_mask=torch.ones(1, 5)), r"`attention_mask` must be a padding mask \[B, T\]"),
    (dict(input_ids=IDS, attention_mask=torch.full((2, 5), 2)), r"`attention_mask` must hold only 0 \(padding\) "
                                                               r"and 1 \(token\), got values \[2\]"),
    (dict(input_ids=IDS, attention_mask=torch.tensor([[0.5] * 5] * 2)), "`attention_mask` must hold only 0"),
    (dict(input_ids=IDS, attention_mask=torch.ones(2, 5, device=META)),
     "`attention_mask` is on meta but the input is on cpu"),
    (dict(input_ids=IDS, labels=IDS[:, :4]), r"`labels` must be an int64 tensor of the input's \[B, T\] = \[2, 5\] "
                                             r"\(token ids, -100 = not scored\), got a torch.int64 tensor of shape"),
    (dict(input_ids=IDS, labels=IDS.float()), r"`labels` must be an int64 tensor"),
    (dict(input_ids=IDS, labels=IDS.int()), r"`labels` must be an int64 tensor .*, got a torch.int32"),
    (dict(input_ids=IDS, labels=torch.full((2, 5), V + 3)),
     rf"`labels` must be token ids in \[0, vocab_size = {V}\) or -100 \(not scored\), got \[{V + 3}\]"),
    (dict(input_ids=IDS, labels=torch.full((2, 5), -5)), r"`labels` must be token ids .*, got \[-5\]"),
    (dict(input_ids=IDS, labels=IDS.to(META)), "`labels` are on meta but the input is on cpu"),
    (dict(input_ids=IDS[:, :1], labels=IDS[:, :1]), r"which needs T >= 2 tokens, got T = 1"),
    (dict(input_ids=IDS, targets=IDS[:, 1:]), r"`targets` must be an int64 tensor of the input's \[B, T\] = \[2, 5\] "
                                              r"\(token ids, -100 = not scored\), got a torch.int64 tensor of shape"),
    (dict(input_ids=IDS, targets=torch.full((2, 5), V)),
     rf"`targets` must be token ids in \[0, vocab_size = {V}\) or -100 \(not scored\), got \[{V}\]"),
    (dict(input_ids=IDS, targets=IDS.to(META)), "`targets` are on meta but the input is on cpu"),
    (dict(input_ids=IDS, targets=IDS, logits_to_keep=2), r"`targets` need the logits of every position"),
    (dict(input_ids=IDS, labels=IDS, targets=IDS), r"pass `labels` \(unshifted: the mean loss\) or `targets` "
                                                   r"\(shifted: the summed loss\), not both"),
    (dict(input_ids=IDS, position_ids=torch.arange(5.0).expand(2, 5)), r"`position_ids` must be an integer tensor"),
    (dict(input_ids=IDS, position_ids=torch.arange(4).expand(2, 4)), r"`position_ids` must be \[B, T\] = \[2, 5\]"),
    (dict(input_ids=IDS, position_ids=torch.arange(5, device=META).expand(2, 5)),
     "`position_ids` is on meta but the input is on cpu"),
    (dict(input_ids=IDS, cu_seqlens=torch.tensor([0, 5, 10], device=META)), "`cu_seqlens` is on meta"),
    (dict(input_ids=IDS, cu_seqlens=torch.tensor([0.0, 5, 10])), "`cu_seqlens` must be a 1-D integer tensor"),
    (dict(input_ids=IDS, logits_to_keep=-1), r"`logits_to_keep` must be an int n >= 0 .*, got int -1"),
    (dict(input_ids=IDS, logits_to_keep=True), r"`logits_to_keep` must be an int n >= 0"),
    (dict(input_ids=IDS, logits_to_keep=torch.tensor([1, 5])), r"`logits_to_keep` positions must lie in \[-T, T\) = "
                                                               r"\[-5, 5\), got \[1, 5\]"),
])
def test_forward_refuses_bad_inputs_naming_them(lm, kw, match):
    with pytest.raises(ValueError, match=match):
        lm(**kw)


def test_model_without_head_checks_the_same_inputs(lm):
    with pytest.raises(ValueError, match=r"KalmixModel: `attention_mask` must be a padding mask \[B, T\]"):
        lm.model(IDS, attention_mask=torch.ones(2, 7))
    with pytest.raises(ValueError, match=r"KalmixModel: `input_ids` must be token ids in \[0, vocab_size = 37\)"):
        lm.model(IDS + V)


def test_edge_inputs_that_are_fine(lm):
    """T = 0 gives empty logits; ids may be int32; a 0/1 mask may be bool, int or float; -100 labels are not scored; a mask with a
    cache covers the cached tokens and the new ones."""
    assert lm(IDS[:, :0]).logits.shape == (2, 0, V)
    torch.testing.assert_close(lm(IDS.int()).logits, lm(IDS).logits)
    for mask in (torch.ones(2, 5, dtype=torch.bool), torch.ones(2, 5, dtype=torch.int32), torch.ones(2, 5)):
        torch.testing.assert_close(lm(IDS, attention_mask=mask).logits, lm(IDS).logits)
    labels = IDS.clone()
    labels[:, 3:] = -100
    assert torch.isfinite(lm(IDS, labels=labels).loss)
    one = lm(IDS[:, :1], targets=IDS[:, 1:2])        # targets are shifted already: one token scores one target
    torch.testing.assert_close(one.loss, F.cross_entropy(one.logits[:, 0], IDS[:, 1], reduction="sum"))
    cache = KalmixCache()
    lm(IDS[:, :3], cache=cache, use_cache=True)
    full = lm(IDS[:, 3:], attention_mask=torch.ones(2, 5), cache=cache, use_cache=True).logits
    assert full.shape == (2, 2, V)


def test_a_cached_call_takes_the_mask_of_the_whole_context(lm):
    """HF's convention: with a cache holding P tokens the mask is [B, P + T]; only this call's [B, T] is refused
    (the recurrent layers used to take it while attention refused it)."""
    cache = KalmixCache()
    lm(IDS[:, :3], cache=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"`attention_mask` must be a padding mask \[B, P \+ T\] = \[2, 5\] \(P = 3 "
                                         r"cached tokens, T = 2 new ones\)"):
        lm(IDS[:, 3:], attention_mask=torch.ones(2, 2), cache=cache, use_cache=True)


def test_gradient_checkpointing_refuses_a_cache_it_would_ignore():
    m = model(["gka", "attention"]).train()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cache = KalmixCache()
    with torch.no_grad():
        m(IDS[:, :3], cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="gradient checkpointing .* without a cache"):
        m(IDS[:, 3:], cache=cache)


def forbid_host_reads(monkeypatch):
    """Make every way of reading a tensor's value on the host raise."""
    def read(*args, **kwargs):
        raise AssertionError("a host read of a tensor value")
    for name in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, read)


def test_value_checks_off_the_cpu_assert_on_the_device_with_no_host_read(lm, monkeypatch):
    """The CUDA path of every value check at the boundary (ids in range, 0/1 mask, finite embeddings, labels,
    logits_to_keep positions): one ``torch._assert_async`` each, and no ``.item()`` / ``.tolist()`` / ``bool()``.
    Run on CPU tensors with the host-read switch turned off, as on CUDA."""
    asserted = []
    monkeypatch.setattr(common, "reads_on_host", lambda x: False)
    monkeypatch.setattr(torch, "_assert_async", lambda ok, msg: asserted.append((ok.clone(), msg)))
    bad_ids, bad_mask = IDS + V, torch.full((2, 5), 2)
    labels = IDS.clone()
    labels[0, 0] = -3
    with monkeypatch.context() as m:
        forbid_host_reads(m)
        lm.model._check_values(IDS, None, torch.ones(2, 5))
        lm.model._check_values(bad_ids, None, bad_mask)
        lm.model._check_values(None, torch.full((2, 5, 16), float("nan")), None)
        lm._check_labels(labels, IDS, 0)
        lm._check_logits_to_keep(torch.tensor([7]), 5)
        lm(IDS[:, :1], cache=KalmixCache(), use_cache=True)           # a whole (decode-sized) forward, cached
    assert [bool(ok) for ok, _ in asserted] == [True, True, False, False, False, False, False, True]
    messages = [msg for _, msg in asserted]
    assert "`input_ids` must be token ids in [0, vocab_size = 37)" in messages[2]
    assert "`attention_mask` must hold only 0" in messages[3]
    assert "`inputs_embeds` must be finite" in messages[4]
    assert "`labels` must be token ids" in messages[5] and "`logits_to_keep` positions" in messages[6]
    assert "`input_ids`" in messages[7]                                   # the forward checked its ids


def test_layers_leave_mask_values_to_the_model_off_the_cpu(monkeypatch):
    """A layer checks the mask's 0/1 values on CPU only (no per-layer kernel or host read on CUDA; the model
    asserts them once per forward)."""
    from tests.layers.test_edge_inputs import make
    layer = make("kaczmarz")
    monkeypatch.setattr(common, "reads_on_host", lambda x: False)
    monkeypatch.setattr(torch, "_assert_async", lambda ok, msg: pytest.fail("a layer asserted on the device"))
    mask = torch.ones(2, 5, dtype=torch.long)
    with monkeypatch.context() as m:
        forbid_host_reads(m)
        from kalmix.layers.common import context_mask
        assert context_mask("layer", mask, torch.zeros(2, 5, 8), None, 0) is not None
    o, _, _ = layer(torch.randn(2, 5, 8, dtype=torch.float64), attention_mask=mask)
    assert o.shape == (2, 5, 8)


@pytest.mark.parametrize("kw, match", [
    (dict(max_new_tokens=0), r"KalmixForCausalLM.generate: `max_new_tokens` must be an int >= 1, got 0"),
    (dict(max_new_tokens=2.5), r"`max_new_tokens` must be an int >= 1, got 2.5"),
    (dict(do_sample=True, temperature=0.0), r"`temperature` must be a finite number > 0.0 when sampling"),
    (dict(do_sample=True, temperature=-1.0), r"`temperature` must be a finite number > 0.0"),
    (dict(do_sample=True, top_k=0), r"`top_k` must be an int >= 1 \(or None: no top-k filtering\), got 0"),
    (dict(top_k=0), r"`top_k` must be an int >= 1"),
    (dict(do_sample=True, top_p=0.0), r"`top_p` must be a number in \(0, 1\] \(None: no nucleus filtering\), got 0.0"),
    (dict(do_sample=True, top_p=1.5), r"`top_p` must be a number in \(0, 1\]"),
    (dict(do_sample="yes"), r"`do_sample` must be True or False"),
    (dict(generation_config=GenerationConfig(do_sample=True, top_k=0)), r"`top_k` must be an int >= 1"),
    (dict(inputs=IDS[0]), r"`input_ids` must be an int64 or int32 tensor \[B, T\] of token ids \(one sequence"),
    (dict(attention_mask=torch.ones(2, 4)), r"`attention_mask` must be a padding mask \[B, T\] = \[2, 5\]"),
    (dict(inputs=IDS + V), r"`input_ids` must be token ids in \[0, vocab_size = 37\)"),
])
def test_generate_refuses_bad_arguments_naming_them(lm, kw, match):
    kw = {"inputs": IDS, "max_new_tokens": 2, "pad_token_id": 0, **kw}
    with pytest.raises(ValueError, match=match):
        lm.generate(**kw)


def test_generate_with_sampling_arguments_that_are_fine(lm):
    torch.manual_seed(0)
    out = lm.generate(IDS, max_new_tokens=3, do_sample=True, temperature=0.5, top_k=V + 10, top_p=1.0,
                      pad_token_id=0)
    assert out.shape == (2, 8) and torch.equal(out[:, :5], IDS)


@pytest.mark.parametrize("call, match", [
    (lambda m: Decoder(m, 0, 10, graph=False), r"Decoder: `batch_size` must be an int >= 1, got 0"),
    (lambda m: Decoder(m, 2, 1, graph=False), r"Decoder: `max_length` must be an int >= 2"),
    (lambda m: Decoder(m, 2, 10, graph=False).generate(IDS, 0), r"Decoder: `max_new_tokens` must be an int >= 1"),
    (lambda m: Decoder(m, 2, 10, graph=False).generate(IDS, 2, do_sample=True, temperature=0.0),
     r"Decoder: `temperature` must be a finite number > 0.0 when sampling"),
    (lambda m: Decoder(m, 2, 10, graph=False).generate(IDS, 2, do_sample=True, top_k=0), r"`top_k` must be an int"),
    (lambda m: Decoder(m, 2, 10, graph=False).decode(torch.zeros(2, V), 0), r"`max_new_tokens` must be an int >= 1"),
    (lambda m: Decoder(m, 2, 10, graph=False).generate(IDS, None), r"`max_new_tokens` must be an int >= 1, got None"),
    (lambda m: Decoder(m, 2, 10, graph=False).prefill(IDS[0]), r"Decoder: prompts `input_ids` must be an integer "
                                                              r"tensor \[B, T\] with T >= 1"),
    (lambda m: Decoder(m, 2, 10, graph=False).prefill(IDS[:, :0]), r"with T >= 1"),
    (lambda m: Decoder(m, 2, 10, graph=False).prefill(IDS + V), r"`input_ids` must be token ids in \[0, vocab_size"),
    (lambda m: Decoder(m, 2, 10, graph=False).step(IDS[:, 0].float()), r"Decoder: `tokens` must be an integer tensor "
                                                                      r"\[B\] = \[2\]"),
])
def test_decoder_refuses_bad_arguments_naming_them(lm, call, match):
    with pytest.raises(ValueError, match=match):
        call(lm)


def test_decoder_samples_with_a_top_k_above_the_vocabulary(lm):
    torch.manual_seed(0)
    out = Decoder(lm, 2, 10, graph=False).generate(IDS, 3, do_sample=True, top_k=V + 5)
    assert out.shape == (2, 8) and ((out >= 0) & (out < V)).all()


@pytest.fixture(scope="module")
def saved_without_tokenizer(tmp_path_factory, lm):
    folder = tmp_path_factory.mktemp("model")
    lm.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("kw, match", [
    (dict(prompt=""), r"generate: `prompt` must be a non-empty string"),
    (dict(max_new_tokens=0), r"generate: `max_new_tokens` must be an int >= 1, got 0"),
    (dict(do_sample=True, temperature=0.0), r"generate: `temperature` must be a finite number > 0.0 when sampling"),
    (dict(do_sample=True, top_k=0), r"generate: `top_k` must be an int >= 1"),
    (dict(device="tpu"), r"generate: device 'tpu' is not one of cpu, cuda or cuda:N"),
    (dict(model_dir="/nonexistent/model"), r"generate: '/nonexistent/model' is not a saved model"),
    (dict(), r"generate: no tokenizer could be loaded from .*; save the tokenizer beside the model or name its "
             r"folder with `tokenizer`"),
])
def test_generate_text_refuses_bad_arguments_naming_them(saved_without_tokenizer, kw, match):
    kw = {"model_dir": saved_without_tokenizer, "prompt": "hello", "device": "cpu", **kw}
    with pytest.raises(ValueError, match=match):
        generate_text(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_generate_text_refuses_cuda_without_a_gpu(saved_without_tokenizer):
    with pytest.raises(ValueError, match=r"generate: device 'cuda': (this torch is built without CUDA|torch sees no "
                                         r"CUDA GPU) \(torch .*\); use cpu"):
        generate_text(saved_without_tokenizer, "hello", device="cuda")
