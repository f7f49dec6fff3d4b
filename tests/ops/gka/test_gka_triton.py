"""Gated KalmaNet's triton impl in the interpreter, against the exact-solve reference (autograd through
torch.linalg.solve) at the realistic ridge, the token loop's Chebyshev forward, and its own inference call."""
import pytest
import torch

from kalmix import ops
from kalmix.ops import SPECS
from kalmix.ops.common.testing import assert_close, launch_args, random_functional_grads, rel_err
from kalmix.ops.gka import fused
from kalmix.ops.gka.spec import layer_inputs

NAMES = "o H U dq dk dv dg dbeta dalpha dH0 dU0".split()


def run(impl, args, state, num_iters, ridge=0.02, final_grad=True, **kw):
    xs = [a.detach().requires_grad_() for a in [*args, *state]]
    o, (Hs, Us) = ops.gated_kalmanet(*xs[:6], initial_state=tuple(xs[6:]), output_final_state=True, ridge=ridge,
                                     num_iters=num_iters, impl=impl, **kw)
    return [o.detach(), Hs.detach(), Us.detach(), *random_functional_grads([o, Hs, Us] if final_grad else [o], xs)]


@pytest.mark.parametrize("tail_min_k", [0, fused.MAX_K])
@pytest.mark.parametrize("T,K,V,final_grad", [(150, 20, 70, True), (64, 8, 8, False), (1, 16, 4, True)])
def test_matches_exact_solve_with_gradients_fp64(T, K, V, final_grad, tail_min_k, monkeypatch):
    """120 steps at ridge 0.02 (κ <= 51) reach ~1e-13, so the implicit-differentiation gradients must equal
    autograd through torch.linalg.solve. T = 150: three chunks, the last partial; K = 20 pads to 32;
    V = 70 takes two column blocks. The adjoint solve's tail in its own kernel (tail_min_k 0) and in the solve's."""
    monkeypatch.setattr(fused, "TAIL_MIN_K", tail_min_k)
    args, state = layer_inputs(2, T, 2, K, V, seed=T)
    ref = run("torch", args, state, None, final_grad=final_grad)
    got = run("triton", args, state, 120, final_grad=final_grad)
    for name, x, r in zip(NAMES, got, ref):
        assert_close(name, x, r, 1e-9)


@pytest.mark.parametrize("C", [16, 64])
def test_other_chunk_lengths(C, monkeypatch):
    """fp64 runs at fp32's chunk length (32); 16-bit activations use 64."""
    monkeypatch.setitem(fused.CONFIGS[32], "C", C)
    args, state = layer_inputs(1, 100, 2, 8, 8, seed=C)
    for name, x, r in zip(NAMES, run("triton", args, state, 120), run("torch", args, state, None)):
        assert_close(name, x, r, 1e-9)


def test_gradients_converge_to_the_exact_solves_with_the_steps():
    args, state = layer_inputs(1, 90, 2, 16, 8, seed=1)
    ref = run("torch", args, state, None)
    errs = [max(rel_err(x, r) for x, r in zip(run("triton", args, state, n)[3:], ref[3:])) for n in (10, 20, 40)]
    assert errs[0] > 5 * errs[1] > 25 * errs[2], errs


@pytest.mark.parametrize("num_iters", [1, 7, 30])
def test_forward_equals_the_token_loops_chebyshev(num_iters):
    """Same solver, same steps: the forward and final states match the token loop to rounding (odd step counts
    end on the kernel's single-step tail)."""
    args, state = layer_inputs(1, 100, 2, 12, 6, seed=2)
    kw = dict(initial_state=state, output_final_state=True, num_iters=num_iters)
    o, (Hs, Us) = ops.gated_kalmanet(*args, impl="triton", **kw)
    ref, (Hr, Ur) = ops.gated_kalmanet(*args, impl="naive", **kw)
    for name, x, r in (("o", o, ref), ("H", Hs, Hr), ("U", Us, Ur)):
        assert_close(name, x, r, 1e-12)


def test_inference_call_matches_training_call():
    args, state = layer_inputs(2, 70, 2, 8, 8, seed=3)
    with torch.no_grad():
        o, (Hs, Us) = ops.gated_kalmanet(*args, initial_state=state, output_final_state=True, impl="triton")
    ref = run("triton", args, state, 30)
    for name, x, r in (("o", o, ref[0]), ("H", Hs, ref[1]), ("U", Us, ref[2])):
        assert_close(name, x, r, 1e-14)


def test_fp32_against_fp64_in_the_layer_regime():
    """A long decay-near-1 history (‖H‖ grows to ~100): fp32 stays within 1e-4 of fp64, gradients included."""
    args, state = layer_inputs(1, 300, 2, 16, 16, seed=4)
    ref = run("triton", args, state, 30)
    got = run("triton", [a.float() for a in args], tuple(s.float() for s in state), 30)
    for name, x, r in zip(NAMES, got, ref):
        assert_close(name, x, r, 1e-4)


def test_head_dim_beyond_registers_and_exact_solve_are_refused(monkeypatch):
    """K above H_c's register tile is a ValueError naming the limit and K, raised before any kernel is launched."""
    launched = launch_args(monkeypatch, fused._states_kernel, "BD")
    gen = torch.Generator().manual_seed(0)
    args = SPECS["gka"].inputs(1, 4, 1, fused.MAX_K + 1, 4, torch.float32, gen)
    with pytest.raises(ValueError, match=r"gated_kalmanet: impl='triton' takes K <= 128 \(the kernels hold H_c "
                                         r"\[K, K\] in one register tile\), got K = 129; impl='torch' takes any K"):
        ops.gated_kalmanet(*args, impl="triton")
    assert launched == []
    args = SPECS["gka"].inputs(1, 4, 1, 8, 4, torch.float32, gen)
    with pytest.raises(ValueError, match="num_iters=None"):
        ops.gated_kalmanet(*args, num_iters=None, impl="triton")


@pytest.mark.parametrize("K,V,num_iters", [(8, 8, 30), (12, 20, 7), (16, 8, 0)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decoding_step_kernel_matches_the_token_loop(K, V, num_iters, dtype):
    """A one-token inference call runs step.py's single kernel: o and the new (H, U) equal the token loop's."""
    args, state = layer_inputs(3, 1, 2, K, V, seed=5, dtype=dtype)
    state = tuple(s.to(dtype) for s in state)
    with torch.no_grad():
        o, (Hs, Us) = ops.gated_kalmanet(*args, initial_state=state, output_final_state=True, impl="triton",
                                         num_iters=num_iters)
        ref, (Hr, Ur) = ops.gated_kalmanet(*args, initial_state=state, output_final_state=True, impl="naive",
                                           num_iters=num_iters)
    tol = 1e-14 if dtype == torch.float64 else 1e-6
    for name, x, r in (("o", o, ref), ("H", Hs, Hr), ("U", Us, Ur)):
        assert_close(name, x, r, tol)
