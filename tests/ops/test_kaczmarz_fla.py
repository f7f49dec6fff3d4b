"""kaczmarz_attention(impl="triton") on fla: fla's kernels need CUDA, so these CPU tests check kalmix's side of
it — the reparameterisation, packing, and the backward recomputed through the torch path where fla refuses
its gated backward — with a stand-in for fla's chunk_gated_delta_rule (kalmix's own chunked gated delta rule).
benchmarks/kaczmarz_fla.py runs the real thing on a GPU."""
import logging

import pytest
import torch

from kalmix import ops
from kalmix.ops.common.delta import chunk_delta_rule
from kalmix.ops.common.testing import CASES, assert_close
from kalmix.ops.common.varlen import run_packed
from kalmix.ops.kaczmarz import on_fla


def _gdn_stand_in(q, k, v, g, beta, *, scale, state, cu_seqlens):
    """fla's contract (packed sequences, [N, H, K, V] states) computed by kalmix's chunked delta rule."""
    def core(q, k, v, g, beta, *, state):
        o, S = chunk_delta_rule(q, k, k, v, g, beta, scale=scale, state=state[0], chunk_size=8)
        return (o,), (S,)
    (o,), (S,) = run_packed(core, cu_seqlens, [q, k, v, g, beta.to(q.dtype)], (state.to(q.dtype),))
    return o, S


def _draw(T, seed, n_seq=2, B=None):
    gen = torch.Generator().manual_seed(seed)
    B = n_seq if B is None else B
    args = CASES["kaczmarz"].inputs(B, T, 2, 5, 7, torch.float64, gen)
    args[1][0, 3] = 0.0                                  # a zero key: its gradient is η/eps · …
    state = CASES["kaczmarz"].state(n_seq, 2, 5, 7, torch.float64, gen)
    return args, state


def _outputs_and_grads(fn, args, state):
    xs = [a.detach().requires_grad_() for a in args] + [state.detach().requires_grad_()]
    o, S = fn(xs)
    gen = torch.Generator().manual_seed(1)
    loss = sum((t.double() * torch.randn(t.shape, generator=gen, dtype=torch.float64)).sum() for t in (o, S))
    return [o.detach().double(), S.detach().double()], [x.double() for x in torch.autograd.grad(loss, xs)]


@pytest.mark.parametrize("refused", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_fla_path_matches_the_loop(monkeypatch, caplog, refused, packed):
    monkeypatch.setattr(on_fla, "_fla_gdn", _gdn_stand_in)
    monkeypatch.setattr(on_fla, "fla_gated_backward_refused", lambda device: refused)
    monkeypatch.setattr(on_fla, "_told", False)
    cu = torch.tensor([0, 9, 9, 30]) if packed else None
    args, state = _draw(30, seed=4, n_seq=3 if packed else 2, B=1 if packed else None)
    eps, scale = 1e-3, 0.4

    def fla_fn(xs):
        xs = [x.float() for x in xs]
        return on_fla.kaczmarz_fla(*xs[:5], state=xs[5], eps=eps, scale=scale, cu_seqlens=cu)

    def ref_fn(xs):
        return ops.kaczmarz_attention(*xs[:5], initial_state=xs[5], eps=eps, scale=scale, cu_seqlens=cu,
                                      output_final_state=True, impl="naive")
    with caplog.at_level(logging.WARNING, logger="kalmix"):
        out, grad = _outputs_and_grads(fla_fn, args, state)
    ref_out, ref_grad = _outputs_and_grads(ref_fn, args, state)
    for i, (x, r) in enumerate(zip(out + grad, ref_out + ref_grad)):
        assert_close(f"output/grad {i}", x, r, 2e-5)
    assert ("recomputes through kalmix's chunked torch path" in caplog.text) == refused


def test_reparameterisation_is_the_kaczmarz_step():
    """Gated DeltaNet on (k, v) / sqrt(‖k‖² + eps) with β = η equals the raw-key loop, zero keys included."""
    args, state = _draw(20, seed=5)
    q, k, v, g, eta = args
    k_hat, v_hat, beta = on_fla.reparameterise(k, v, eta, 1e-2)
    assert beta.dtype == torch.float32 and (k_hat[0, 3] == 0).all() and (k_hat.norm(dim=-1) <= 1).all()
    o, S = chunk_delta_rule(q, k_hat, k_hat, v_hat, g, beta.double(), scale=0.3, state=state)
    ref_o, ref_S = ops.kaczmarz_attention(q, k, v, g, eta, initial_state=state, eps=1e-2, scale=0.3,
                                          output_final_state=True, impl="naive")
    assert_close("o", o, ref_o, 1e-6)          # β passes through fp32
    assert_close("S", S, ref_S, 1e-6)


def test_zero_key_without_eps_writes_nothing_and_has_finite_gradients():
    k = torch.zeros(1, 2, 1, 4, requires_grad=True)
    v, eta = torch.randn(1, 2, 1, 3, requires_grad=True), torch.rand(1, 2, 1, requires_grad=True)
    k_hat, v_hat, beta = on_fla.reparameterise(k, v, eta, 0.0)
    assert (k_hat == 0).all() and (v_hat == 0).all()
    (k_hat.sum() + v_hat.sum() + beta.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (k, v, eta))


def test_fp64_is_refused_with_the_alternatives():
    args, state = _draw(4, seed=6)
    with pytest.raises(ValueError, match="bf16/fp16/fp32 inputs; use impl='torch'"):
        on_fla.kaczmarz_fla(*args, state=state, eps=1e-6, scale=1.0)
