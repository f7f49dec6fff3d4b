"""The fused Triton Kalman kernels (interpreter on CPU) beyond the shared contract: wide channel blocks, the
kernel specialisations without variance or final-state gradients, and the realistic trained regime."""
import pytest
import torch

from kalmix import ops
from kalmix.ops import SPECS
from kalmix.ops.common.testing import assert_close, launch_args, outputs_and_grads
from kalmix.ops.kalman.spec import realistic_inputs as kalman_realistic_inputs


@pytest.mark.parametrize("min_programs", [None, 1])
def test_several_channel_blocks_and_odd_sizes(min_programs, monkeypatch):
    """D = 37 spans several channel blocks (the last one partial), N = 3 pads the slot axis, T = 23 is not a
    multiple of the chunk; the forward's blocks are its narrowest here, and its widest with min_programs = 1."""
    from kalmix.ops.kalman import fused
    if min_programs is not None:
        monkeypatch.setattr(fused, "FWD_MIN_PROGRAMS", min_programs)
    case = SPECS["kalman"]
    gen = torch.Generator().manual_seed(0)
    args = case.inputs(2, 23, 1, 3, 37, torch.float64, gen)
    state = case.random_state(2, 1, 3, 37, torch.float64, gen)
    ref_out, ref_grad = outputs_and_grads(case, args, state, "naive")
    out, grad = outputs_and_grads(case, args, state, "triton")
    for i, (x, r) in enumerate(zip(out + grad, ref_out + ref_grad)):
        assert_close(f"output/grad {i}", x, r, 1e-12)


def test_unmasked_lanes_and_packed_sequences():
    """N = 4 and D = 32 tile every channel block exactly (the unmasked specialisation); packed sequences with an
    empty one and lengths around the chunk exercise the one-chunk-ahead loads at every sequence end."""
    from kalmix.ops.kalman import fused
    assert fused._even(4, 32, fused.FWD_CONFIG[0]) and fused._even(4, 32, fused.BWD_CONFIG[0] * fused.BWD_CONFIG[1])
    case = SPECS["kalman"]
    gen = torch.Generator().manual_seed(3)
    C = fused.CHUNK
    lens = [3 * C + 1, 0, C, 1, 2 * C - 1]
    cu = torch.tensor([0] + lens).cumsum(0)
    args = case.inputs(1, int(cu[-1]), 1, 4, 32, torch.float64, gen)
    state = case.random_state(len(lens), 1, 4, 32, torch.float64, gen)
    ref_out, ref_grad = outputs_and_grads(case, args, state, "naive", cu_seqlens=cu)
    out, grad = outputs_and_grads(case, args, state, "triton", cu_seqlens=cu)
    for i, (x, r) in enumerate(zip(out + grad, ref_out + ref_grad)):
        assert_close(f"output/grad {i}", x, r, 1e-12)


@pytest.mark.parametrize("variance,final", [(False, False), (False, True), (True, False)])
def test_without_variance_or_final_state_gradients(variance, final):
    gen = torch.Generator().manual_seed(1)
    args = SPECS["kalman"].inputs(1, 13, 2, 4, 5, torch.float64, gen)
    grads = {}
    for impl in ("naive", "triton"):
        xs = [a.detach().requires_grad_() for a in args]
        o, var, st = ops.kalman_attention(*xs, output_variance=variance, output_final_state=final, impl=impl)
        assert (var is None) != variance and (st is None) != final
        loss = (o * o).sum() + ((var * var).sum() if variance else 0) + (st[1].sum() + st[0].log().sum()
                                                                        if final else 0)
        grads[impl] = torch.autograd.grad(loss, xs)
    for i, (x, r) in enumerate(zip(grads["triton"], grads["naive"])):
        assert_close(f"grad {i}", x, r, 1e-12)


def test_realistic_regime_fp32_and_gradients():
    """Decay near 1, process noise 1e-7..1e-6, value precision up to 1e4: fp32 kernels against the fp64 loop."""
    args64 = [x.requires_grad_() for x in kalman_realistic_inputs(300, torch.float64, seed=2, N=4, D=20)]
    args32 = [x.detach().float().requires_grad_() for x in args64]
    res = {}
    for impl, args in (("naive", args64), ("triton", args32)):
        o, var, (lam, mu) = ops.kalman_attention(*args, output_variance=True, output_final_state=True, impl=impl)
        gen = torch.Generator().manual_seed(0)
        loss = sum((x * torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x)).sum() for x in (o, var, mu))
        res[impl] = [o, var, lam, mu, *torch.autograd.grad(loss, args)]
    assert res["naive"][2].max() > 1e5, "the regime should reach large precisions"
    for i, (x, r) in enumerate(zip(res["triton"], res["naive"])):
        assert_close(f"output/grad {i}", x, r, 3e-5)


def test_no_checkpoints_without_grad_mode(monkeypatch):
    """Under no_grad the forward writes no checkpoints even when its inputs require gradients (autograd's
    needs_input_grad ignores grad mode); with grad mode on it does, and the outputs are the same."""
    from kalmix.ops.kalman import fused
    saves = launch_args(monkeypatch, fused._kalman_fwd_kernel, "SAVE")
    gen = torch.Generator().manual_seed(4)
    args = [a.requires_grad_() for a in SPECS["kalman"].inputs(1, 9, 1, 4, 8, torch.float64, gen)]
    with torch.no_grad():
        o_eval = ops.kalman_attention(*args, impl="triton")[0]
    o_train = ops.kalman_attention(*args, impl="triton")[0]
    assert saves == [False, True]
    assert o_train.grad_fn is not None
    assert_close("o", o_eval, o_train, 0)
