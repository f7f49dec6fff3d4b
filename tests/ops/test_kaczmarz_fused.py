"""kaczmarz_attention(impl="triton"): the choice between fla's kernels and kalmix's own, the reparameterisation
and packing. kalmix's kernels run here in the interpreter; fla's need CUDA, so its branch runs with a stand-in
for fla's chunk_gated_delta_rule (kalmix's chunked torch delta rule). benchmarks/kaczmarz_fla.py runs both
engines on a GPU."""
import logging

import pytest
import torch

from kalmix import ops
from kalmix.ops.common.delta import chunk_delta_rule
from kalmix.ops.common.testing import CASES, assert_close, random_functional_grads
from kalmix.ops.common.varlen import run_packed
from kalmix.ops.kaczmarz import fused


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
    return [o.detach().double(), S.detach().double()], [x.double() for x in random_functional_grads((o, S), xs)]


@pytest.mark.parametrize("engine", ["fla", "kalmix"])
@pytest.mark.parametrize("packed", [False, True])
def test_both_engines_match_the_loop(monkeypatch, engine, packed):
    calls = []

    def stand_in(*a, **kw):
        calls.append(1)
        return _gdn_stand_in(*a, **kw)
    monkeypatch.setattr(fused, "_fla_gdn", stand_in)
    monkeypatch.setattr(fused, "engine", lambda device, dtype, needs_grad: engine)
    cu = torch.tensor([0, 9, 9, 70]) if packed else None
    args, state = _draw(70, seed=4, n_seq=3 if packed else 2, B=1 if packed else None)
    eps, scale = 1e-3, 0.4

    def fused_fn(xs):
        xs = [x.float() for x in xs]
        return fused.kaczmarz_fused(*xs[:5], state=xs[5], eps=eps, scale=scale, cu_seqlens=cu)

    def ref_fn(xs):
        return ops.kaczmarz_attention(*xs[:5], initial_state=xs[5], eps=eps, scale=scale, cu_seqlens=cu,
                                      output_final_state=True, impl="naive")
    out, grad = _outputs_and_grads(fused_fn, args, state)
    ref_out, ref_grad = _outputs_and_grads(ref_fn, args, state)
    for i, (x, r) in enumerate(zip(out + grad, ref_out + ref_grad)):
        assert_close(f"output/grad {i}", x, r, 2e-5)
    assert bool(calls) == (engine == "fla")


def test_engine_choice(monkeypatch):
    """fla wherever it runs both ways; kalmix's kernels for training where fla refuses its gated backward, for
    fp64 and off CUDA."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for refused in (False, True):
        monkeypatch.setattr(fused, "fla_gated_backward_refused", lambda device, r=refused: r)
        assert fused.engine(cuda, torch.bfloat16, needs_grad=False) == "fla"
        assert fused.engine(cuda, torch.bfloat16, needs_grad=True) == ("kalmix" if refused else "fla")
        assert fused.engine(cuda, torch.float64, needs_grad=False) == "kalmix"
        assert fused.engine(cpu, torch.float32, needs_grad=False) == "kalmix"


def test_standing_in_for_fla_on_a_gpu_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(fused, "_told", False)
    with caplog.at_level(logging.WARNING, logger="kalmix"):
        fused.announce(torch.bfloat16)
        fused.announce(torch.bfloat16)
    assert caplog.text.count("kalmix's own chunked Triton kernels run the op forward and backward") == 1
    assert "fla refuses its gated backward" in caplog.text


def test_reparameterisation_is_the_kaczmarz_step():
    """Gated DeltaNet on (k, v) / sqrt(‖k‖² + eps) with β = η equals the raw-key loop, zero keys included."""
    args, state = _draw(20, seed=5)
    q, k, v, g, eta = args
    k_hat, v_hat, beta = fused.reparameterise(k, v, eta, 1e-2)
    assert beta.dtype == torch.float64 and (k_hat[0, 3] == 0).all() and (k_hat.norm(dim=-1) <= 1).all()
    o, S = chunk_delta_rule(q, k_hat, k_hat, v_hat, g, beta.double(), scale=0.3, state=state)
    ref_o, ref_S = ops.kaczmarz_attention(q, k, v, g, eta, initial_state=state, eps=1e-2, scale=0.3,
                                          output_final_state=True, impl="naive")
    assert_close("o", o, ref_o, 1e-12)
    assert_close("S", S, ref_S, 1e-12)


def test_zero_key_without_eps_writes_nothing_and_has_finite_gradients():
    k = torch.zeros(1, 2, 1, 4, requires_grad=True)
    v, eta = torch.randn(1, 2, 1, 3, requires_grad=True), torch.rand(1, 2, 1, requires_grad=True)
    k_hat, v_hat, beta = fused.reparameterise(k, v, eta, 0.0)
    assert (k_hat == 0).all() and (v_hat == 0).all()
    (k_hat.sum() + v_hat.sum() + beta.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (k, v, eta))


def test_fused_reparameterisation_and_its_gradient_match_torch():
    """The kernels' k̂, v̂ and their backward against autograd through the formula, over rows that span several
    programs (a zero key with eps > 0 included)."""
    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(3, 11, 2, 5, generator=gen, dtype=torch.float64), torch.randn(3, 11, 2, 7, generator=gen,
                                                                                       dtype=torch.float64)
    k[1, 4, 0] = 0.0
    dk_hat, dv_hat = torch.randn_like(k), torch.randn_like(v)
    eps = 1e-3
    grads = []
    for fused_path in (True, False):
        kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
        if fused_path:
            k_hat, v_hat, _ = fused.reparameterise(kk, vv, torch.ones(3, 11, 2, dtype=torch.float64), eps)
        else:
            c = ((kk * kk).sum(-1, keepdim=True) + eps).rsqrt()
            k_hat, v_hat = kk * c, vv * c
        grads.append([k_hat, v_hat, *torch.autograd.grad((k_hat * dk_hat).sum() + (v_hat * dv_hat).sum(), (kk, vv))])
    for name, x, r in zip(["k_hat", "v_hat", "dk", "dv"], *grads):
        assert_close(name, x.detach(), r.detach(), 1e-12)
