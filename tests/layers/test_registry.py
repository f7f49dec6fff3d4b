"""The mixer registry (kalmix.layers.MIXER_SPECS): every mixer builds a model from its generic sizes, its head shape
is its op's, its decoding step is its op spec's, and the name -> class views agree with it."""
import dataclasses
import inspect

import pytest
import torch

from kalmix.layers import ALL_MIXERS, BASELINES, MIXER_SPECS, MIXERS
from kalmix.models import KalmixConfig, KalmixForCausalLM

NAMES = list(MIXER_SPECS)


def _config(name, **kw):
    spec = MIXER_SPECS[name]
    return KalmixConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, mixer=name,
                        mixer_kwargs={name: spec.size_kwargs(heads=2, head_dim=8, d_state=4)}, **kw)


@pytest.mark.parametrize("name", NAMES)
def test_every_mixer_builds_a_model_from_its_sizes(name):
    """A model of every registered mixer builds from the generic sizes; those kalmix runs train a step on CPU, the
    ones on another package's CUDA kernels refuse CPU tensors by name."""
    torch.manual_seed(0)
    model = KalmixForCausalLM(_config(name)).double()
    assert all(type(b.mixer) is MIXER_SPECS[name].layer for b in model.model.layers)
    ids = torch.randint(0, 32, (2, 7))
    if MIXER_SPECS[name].requires is not None:
        with pytest.raises(ValueError, match="need CUDA tensors"):
            model(ids, labels=ids)
        return
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters()
                                        if p.grad is not None)
    assert MIXER_SPECS[name].flops(model.model.layers[0].mixer, 7) > 0


@pytest.mark.parametrize("name", [n for n, s in MIXER_SPECS.items() if s.op is not None])
def test_heads_are_the_shape_of_the_ops_state(name):
    """``heads(layer)`` is the (H, K, V) of the op state the layer caches (linear attention's key sum rides as one
    more value column, which its cost does not count)."""
    spec = MIXER_SPECS[name]
    torch.manual_seed(0)
    layer = spec.layer(16, **spec.size_kwargs(heads=2, head_dim=8, d_state=4)).double()
    _, _, cache = layer(torch.randn(1, 3, 16, dtype=torch.float64), use_cache=True)
    state = cache[0]["recurrent_state"]
    H, K, V = spec.heads(layer)
    V += getattr(layer, "normalizer", None) == "denominator"
    assert [tuple(s.shape) for s in ((state,) if torch.is_tensor(state) else state)] == \
        list(spec.op.state_shapes(1, H, K, V))


@pytest.mark.parametrize("name", NAMES)
def test_sizes_and_compact_variant_are_layer_arguments(name):
    spec = MIXER_SPECS[name]
    params = set(inspect.signature(spec.layer.__init__).parameters)
    assert set(spec.sizes.values()) <= params and set(spec.compact) <= params
    assert spec.size_kwargs() == {} and spec.size_kwargs(heads=None, d_state=None) == {}
    with pytest.raises(ValueError, match=r"unknown size\(s\) \['heads_dim'\]; the sizes are"):
        spec.size_kwargs(heads_dim=8)


def test_name_views_and_headline_mixers():
    assert ALL_MIXERS == {n: s.layer for n, s in MIXER_SPECS.items()}
    assert MIXERS == {n: s.layer for n, s in MIXER_SPECS.items() if s.requires is None}
    assert set(BASELINES) == {n for n, s in MIXER_SPECS.items() if s.requires == "fla"} == {"deltanet"}
    # the benchmarks' default comparison: kalmix's four mixers beside softmax attention and Gated DeltaNet
    assert [n for n, s in MIXER_SPECS.items() if s.headline] == ["attention", "gdn", "kaczmarz", "gka", "vla",
                                                                 "kalman"]
    assert [n for n, s in MIXER_SPECS.items() if not s.context_parallel] == ["deltanet"]


@pytest.mark.parametrize("name", [n for n, s in MIXER_SPECS.items() if s.op is not None])
def test_decoding_runs_the_ops_fused_step_where_the_layer_runs_its_impl(name):
    spec = MIXER_SPECS[name]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    kw = spec.size_kwargs(heads=2, head_dim=8, d_state=4)
    fused = "triton" in spec.op.step_impls
    for impl, device, want in ((None, cuda, "triton" if fused else "naive"), (None, cpu, "naive"),
                               ("torch", cuda, "naive"), ("naive", cpu, "naive")):
        assert spec.layer(16, impl=impl, **kw).step_impl(device) == want, (impl, device)
    if "triton" in spec.op.impls:
        assert spec.layer(16, impl="triton", **kw).step_impl(cpu) == ("triton" if fused else "naive")
    # the ops with a one-launch Triton step: Kaczmarz (GDN's too), GKA, Kalman
    assert fused == (name in ("gdn", "kaczmarz", "gka", "kalman"))


def test_a_mixer_spec_refuses_an_unknown_size_or_a_misplaced_cost():
    spec = MIXER_SPECS["kaczmarz"]
    with pytest.raises(ValueError, match=r"'kaczmarz': sizes \['width'\] are not among"):
        dataclasses.replace(spec, sizes={"width": "d_model"})
    with pytest.raises(ValueError, match=r"'kaczmarz': give `cost` exactly when the layer runs no kalmix op"):
        dataclasses.replace(spec, cost=MIXER_SPECS["attention"].cost)
    with pytest.raises(ValueError, match=r"'attention': give `cost` exactly when"):
        dataclasses.replace(MIXER_SPECS["attention"], cost=None)
