"""The op registry (kalmix.ops.SPECS): every spec agrees with its op's reference (impl="naive") and "torch" impl:
its state shapes, default state, optional outputs, time-invariant inputs and byte model."""
import dataclasses
import inspect

import pytest
import torch

import kalmix.ops
from kalmix.ops import SPECS
from kalmix.ops.common.cost import Shape
from kalmix.ops.common.spec import COMBINE_RULES

B, T, H, K, V = 2, 5, 2, 3, 4
NAMES = list(SPECS)


def _draw(spec, B=B, T=T, n=None, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return spec.inputs(B, T, H, K, V, dtype, gen), spec.random_state(B if n is None else n, H, K, V, dtype, gen)


def _as_tuple(state):
    return (state,) if torch.is_tensor(state) else tuple(state)


def _call(spec, args, impl, state=None, **kw):
    """The op's (outputs..., final state as a tuple) with every optional output requested."""
    requested = {flag: True for flag in spec.outputs if flag is not None}
    if state is not None and spec.single_state:
        state = state[0]
    out = spec.fn(*args, initial_state=state, output_final_state=True, impl=impl, **requested, **kw)
    return list(out[:-1]), _as_tuple(out[-1])


def test_registry_holds_every_public_op_once():
    assert all(name == spec.name for name, spec in SPECS.items())
    fns = [spec.fn for spec in SPECS.values()]
    assert len(set(fns)) == len(fns)
    public = {getattr(kalmix.ops, n) for n in kalmix.ops.__all__ if inspect.isfunction(getattr(kalmix.ops, n))}
    assert public == set(fns)
    for spec in SPECS.values():
        assert "naive" in spec.impls and set(spec.impls) <= {"naive", "torch", "triton"}, spec.name


@pytest.mark.parametrize("name", NAMES)
def test_state_shapes_and_outputs_are_the_references(name):
    """The reference returns ``n_outputs`` outputs and a final state of ``state_shapes``, one tensor exactly when
    ``single_state``; with packed sequences one row per sequence; the spec's random state has those shapes."""
    spec = SPECS[name]
    args, state = _draw(spec)
    out = spec.fn(*args, output_final_state=True, impl="naive",
                  **{flag: True for flag in spec.outputs if flag is not None})
    assert len(out) == spec.n_outputs + 1
    assert torch.is_tensor(out[-1]) == spec.single_state
    assert [tuple(s.shape) for s in _as_tuple(out[-1])] == list(spec.state_shapes(B, H, K, V))
    assert [tuple(s.shape) for s in _as_tuple(state)] == list(spec.state_shapes(B, H, K, V))
    packed, _ = _draw(spec, B=1, T=7)
    _, final = _call(spec, packed, "naive", cu_seqlens=torch.tensor([0, 2, 2, 7]))
    assert [tuple(s.shape) for s in final] == list(spec.state_shapes(3, H, K, V))


@pytest.mark.parametrize("impl", ["naive", "torch"])
@pytest.mark.parametrize("name", NAMES)
def test_default_state_is_the_ops_own(name, impl):
    """Starting from ``default_state`` is exactly starting from no state (outputs and final state)."""
    spec = SPECS[name]
    args, _ = _draw(spec)
    default = spec.default_state(B, H, K, V, torch.float64, torch.device("cpu"), {})
    assert [tuple(s.shape) for s in default] == list(spec.state_shapes(B, H, K, V))
    got, ref = _call(spec, args, impl, default), _call(spec, args, impl)
    for x, r in zip([*got[0], *got[1]], [*ref[0], *ref[1]]):
        assert torch.equal(x, r)


def test_vla_default_state_reads_the_calls_lambda0():
    spec = SPECS["vla"]
    args, _ = _draw(spec)
    default = spec.default_state(B, H, K, V, torch.float64, torch.device("cpu"), {"lambda0": 0.5})
    got, ref = _call(spec, args, "naive", default, lambda0=0.5), _call(spec, args, "naive", lambda0=0.5)
    assert all(torch.equal(x, r) for x, r in zip([*got[0], *got[1]], [*ref[0], *ref[1]]))
    assert not torch.equal(got[0][0], _call(spec, args, "naive")[0][0])


@pytest.mark.parametrize("name", NAMES)
def test_optional_outputs_only_when_asked(name):
    spec = SPECS[name]
    args, _ = _draw(spec)
    for i, flag in enumerate(spec.outputs):
        if flag is None:
            continue
        assert spec.fn(*args, impl="naive")[i] is None
        assert torch.is_tensor(spec.fn(*args, impl="naive", **{flag: True})[i])


@pytest.mark.parametrize("name", NAMES)
def test_params_are_the_time_invariant_inputs(name):
    """The last ``n_params`` inputs keep their shape at another length; every other input is [B, T, H, ...]."""
    spec = SPECS[name]
    short, _ = _draw(spec, T=T)
    longer, _ = _draw(spec, T=T + 2)
    n_acts = len(short) - spec.n_params
    for a, b in zip(short[:n_acts], longer[:n_acts]):
        assert a.shape[:3] == (B, T, H) and b.shape[:3] == (B, T + 2, H)
    for a, b in zip(short[n_acts:], longer[n_acts:]):
        assert a.shape == b.shape and a.shape[0] == H


@pytest.mark.parametrize("name", NAMES)
def test_bytes_model_reads_the_inputs_and_writes_the_output(name):
    """One forward's byte floor is every input read once (activations at ``elt`` bytes, time-invariant parameters
    in fp32) and the output written once."""
    spec = SPECS[name]
    args, _ = _draw(spec)
    n_acts = len(args) - spec.n_params
    for elt in (2, 4):
        want = (elt * sum(a.numel() for a in args[:n_acts]) + 4 * sum(p.numel() for p in args[n_acts:])
                + elt * B * T * H * V)
        assert spec.cost.bytes(Shape(B, T, H, K, V), elt, "fwd") == want


@pytest.mark.parametrize("name", NAMES)
def test_bench_heads_and_sweep(name):
    spec = SPECS[name]
    heads = spec.bench_heads(8, 64, 512, 16)
    assert len(heads) == 3 and all(isinstance(x, int) and x > 0 for x in heads)
    if spec.sweep is not None:
        assert inspect.signature(spec.fn).parameters[spec.sweep].default is not inspect.Parameter.empty
    assert spec.combine in (None, *COMBINE_RULES)


def test_a_spec_refuses_an_unknown_rule_or_step_impl():
    spec = SPECS["kaczmarz"]
    with pytest.raises(ValueError, match=r"'kaczmarz': `combine` must be None or one of \('columns', "
                                         r"'decayed_sums'\), got 'scan'"):
        dataclasses.replace(spec, combine="scan")
    with pytest.raises(ValueError, match=r"'gla': step_impls \['triton'\] are not among its impls \['naive', "
                                         r"'torch'\]"):
        dataclasses.replace(SPECS["gla"], step_impls=("triton",))
