"""The contract every op honours, checked for every impl against the fp64 token loop."""
import pytest
import torch

from kalmix.ops import SPECS
from kalmix.ops.common.testing import assert_close, outputs_and_grads, random_functional_grads, run_case

TOL64 = 1e-6
# every parallel impl of every op that runs on CPU tensors (triton in the interpreter)
PARALLEL = [(n, i) for n, c in SPECS.items() for i in c.runnable_impls(torch.device("cpu")) if i != "naive"]
ALL = [(n, "naive") for n in SPECS] + PARALLEL


@pytest.mark.parametrize("T", [1, 63, 100, 257])
@pytest.mark.parametrize("name,impl", PARALLEL)
def test_impl_matches_naive_fp64(name, T, impl, draw):
    case = SPECS[name]
    args, state = draw(name, 2, T, 2, 5, 7, seed=T)
    ref_out, ref_grad = outputs_and_grads(case, args, state, "naive")
    out, grad = outputs_and_grads(case, args, state, impl)
    for i, (x, r) in enumerate(zip(out, ref_out)):
        assert_close(f"{name}/{impl} output {i}", x, r, TOL64)
    for i, (x, r) in enumerate(zip(grad, ref_grad)):
        assert_close(f"{name}/{impl} grad of input {i}", x, r, TOL64)


@pytest.mark.parametrize("name,impl", ALL)
def test_default_initial_state_and_no_final_state(name, impl, draw):
    case = SPECS[name]
    args, _ = draw(name, 2, 20, 2, 4, 6)
    o, *rest = case.fn(*args, impl=impl)
    assert o.shape == (2, 20, 2, 6) and torch.isfinite(o).all()
    assert rest[-1] is None
    assert all(x is None for x in rest[:-1])        # the optional outputs (Kalman's variance) only when asked for


@pytest.mark.parametrize("name,impl", ALL)
def test_chained_calls_equal_one_call(name, impl, draw):
    case = SPECS[name]
    args, state = draw(name, 2, 90, 2, 5, 3)
    full = run_case(case, args, state, impl)
    cut = 37
    first = [a[:, :cut] if a.dim() >= 3 and a.shape[1] == 90 else a for a in args]
    second = [a[:, cut:] if a.dim() >= 3 and a.shape[1] == 90 else a for a in args]
    out1 = run_case(case, first, state, impl)
    n_state = len(state) if isinstance(state, tuple) else 1
    mid = tuple(out1[-n_state:]) if n_state > 1 else out1[-1]
    out2 = run_case(case, second, mid, impl)
    n_act = len(full) - n_state
    for i in range(n_act):
        assert_close(f"output {i}", torch.cat([out1[i], out2[i]], dim=1), full[i], 1e-10)
    for i in range(n_act, len(full)):
        assert_close(f"state {i}", out2[i], full[i], 1e-10)


@pytest.mark.parametrize("name,impl", ALL)
def test_varlen_equals_loop_over_sequences(name, impl, draw):
    case = SPECS[name]
    lens = [5, 0, 70, 1, 30]
    T = sum(lens)
    args, state = draw(name, 1, T, 2, 4, 3, n_state=len(lens))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    packed = run_case(case, args, state, impl, cu_seqlens=cu)
    n_state = len(state) if isinstance(state, tuple) else 1
    n_act = len(packed) - n_state
    for i, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        seq = [a[:, bos:eos] if a.dim() >= 3 and a.shape[1] == T else a for a in args]
        st = tuple(s[i:i + 1] for s in state) if isinstance(state, tuple) else state[i:i + 1]
        if eos == bos:
            ref_state = list(st) if isinstance(st, tuple) else [st]
            ref_act = []
        else:
            out = run_case(case, seq, st, impl)
            ref_act, ref_state = out[:n_act], out[n_act:]
        for j, r in enumerate(ref_act):
            assert_close(f"seq {i} output {j}", packed[j][:, bos:eos], r, 1e-10)
        for j, r in enumerate(ref_state):
            assert_close(f"seq {i} state {j}", packed[n_act + j][i:i + 1], r, 1e-10)


@pytest.mark.parametrize("name,impl", PARALLEL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_compute_in_fp32(name, impl, dtype, draw):
    case = SPECS[name]
    args64, state64 = draw(name, 2, 40, 2, 4, 6)
    ref = run_case(case, args64, state64, "naive")
    args = [a.to(dtype) for a in args64]
    out = run_case(case, args, state64, impl)
    assert out[0].dtype == dtype
    assert all(s.dtype == torch.float32 for s in out[1:] if s.shape[1] != 40)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    # bf16 rounds the inputs themselves, so compare with the reference on the rounded inputs
    ref = run_case(case, [a.double() for a in args], state64, "naive") if dtype != torch.float32 else ref
    assert_close(f"{name} {dtype} output", out[0].double(), ref[0], tol)


@pytest.mark.parametrize("name,impl", PARALLEL)
def test_impl_matches_naive_with_default_state(name, impl, draw):
    case = SPECS[name]
    args, _ = draw(name, 2, 100, 2, 5, 7, seed=5)
    res = {}
    for which in ("naive", impl):
        xs = [a.detach().requires_grad_() for a in args]
        out = [x for x in run_case(case, xs, None, which)]
        gen = torch.Generator().manual_seed(0)
        loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in out)
        res[which] = out + list(torch.autograd.grad(loss, xs))
    for i, (x, r) in enumerate(zip(res[impl], res["naive"])):
        assert_close(f"{name}/{impl} tensor {i}", x, r, TOL64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,impl", ALL)
def test_autocast_does_not_touch_the_state_math(name, impl, dtype, draw):
    """An op called inside a CPU autocast region computes exactly what it computes outside: outputs and
    gradients (the backward called outside the region, as torch.autocast prescribes)."""
    case = SPECS[name]
    args, state = draw(name, 2, 40, 2, 4, 6, dtype=torch.float32)
    args = [a.to(dtype) if a.dim() >= 3 else a for a in args]
    results = []
    for autocast in (False, True):
        leaves = [a.detach().requires_grad_() for a in args]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs = run_case(case, leaves, state, impl)
        results.append(outs + random_functional_grads(outs, leaves))
    for x, r in zip(*results):
        assert torch.equal(x, r)
