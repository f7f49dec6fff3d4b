"""kaczmarz_attention(impl="triton"): the choice between fla's kernels and kalmix's own, the Kaczmarz step kernel
and packing. kalmix's kernels run here in the interpreter; fla's need CUDA, so its branch runs with a stand-in
for fla's chunk_gated_delta_rule (kalmix's chunked torch delta rule). benchmarks/kaczmarz_fused.py runs both
engines on a GPU."""
import logging

import pytest
import torch

from kalmix import ops
from kalmix.ops import SPECS
from kalmix.ops.common import delta_triton
from kalmix.ops.common.delta import chunk_delta_rule
from kalmix.ops.common.testing import assert_close, launch_args, random_functional_grads
from kalmix.ops.common.varlen import check_offsets, run_packed
from kalmix.ops.kaczmarz import beta_triton, fused


def _gdn_stand_in(q, k, v, g, beta, *, scale, state, cu_seqlens, final_state):
    """fla's contract (packed sequences, [N, H, K, V] states, the final one only when asked) computed by kalmix's
    chunked delta rule."""
    def core(q, k, v, g, beta, *, state):
        o, S = chunk_delta_rule(q, k, k, v, g, beta, scale=scale, state=state[0], chunk_size=8)
        return (o,), (S,)
    if state is None:
        n = q.shape[0] if cu_seqlens is None else cu_seqlens.n
        state = q.new_zeros(n, q.shape[2], q.shape[3], v.shape[3])
    (o,), (S,) = run_packed(core, cu_seqlens, [q, k, v, g, beta.to(q.dtype)], (state.to(q.dtype),))
    return o, (S if final_state else None)


def _draw(T, seed, n_seq=2, B=None):
    gen = torch.Generator().manual_seed(seed)
    B = n_seq if B is None else B
    args = SPECS["kaczmarz"].inputs(B, T, 2, 5, 7, torch.float64, gen)
    args[1][0, 3] = 0.0                                  # a zero key: its gradient is η/eps · …
    state = SPECS["kaczmarz"].random_state(n_seq, 2, 5, 7, torch.float64, gen)
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
    monkeypatch.setattr(fused, "engine", lambda device, dtype: engine)
    cu = check_offsets("test", torch.tensor([0, 9, 9, 70]), 70) if packed else None
    args, state = _draw(70, seed=4, n_seq=3 if packed else 2, B=1 if packed else None)
    eps, scale = 1e-3, 0.4

    def fused_fn(xs):
        xs = [x.float() for x in xs]
        return fused.kaczmarz_fused(*xs[:5], state=xs[5], eps=eps, scale=scale, cu_seqlens=cu)[:2]

    def ref_fn(xs):
        return ops.kaczmarz_attention(*xs[:5], initial_state=xs[5], eps=eps, scale=scale, cu_seqlens=cu,
                                      output_final_state=True, impl="naive")
    out, grad = _outputs_and_grads(fused_fn, args, state)
    ref_out, ref_grad = _outputs_and_grads(ref_fn, args, state)
    for i, (x, r) in enumerate(zip(out + grad, ref_out + ref_grad)):
        assert_close(f"output/grad {i}", x, r, 2e-5)
    assert bool(calls) == (engine == "fla")


def test_engine_choice(monkeypatch):
    """fla wherever it runs both ways; kalmix's kernels where fla refuses its gated backward (with or without
    gradients: one engine per machine), for fp64 and off CUDA."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for refused in (False, True):
        monkeypatch.setattr(fused, "fla_gated_backward_refused", lambda device, r=refused: r)
        assert fused.engine(cuda, torch.bfloat16) == ("kalmix" if refused else "fla")
        assert fused.engine(cuda, torch.float64) == "kalmix"
        assert fused.engine(cpu, torch.float32) == "kalmix"


def test_standing_in_for_fla_on_a_gpu_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(fused, "_told", False)
    with caplog.at_level(logging.WARNING, logger="kalmix"):
        fused.announce(torch.bfloat16)
        fused.announce(torch.bfloat16)
    assert caplog.text.count("kalmix's own chunked Triton kernels run the op forward and backward") == 1
    assert "fla refuses its gated backward" in caplog.text


def test_raw_key_delta_rule_with_the_step_is_the_kaczmarz_loop():
    """The delta rule on the raw keys and values with β = kaczmarz_step(k, η, eps) equals the loop, zero keys
    included (their step is η/eps)."""
    args, state = _draw(20, seed=5)
    q, k, v, g, eta = args
    beta = fused.kaczmarz_step(k, eta, 1e-2)
    assert beta.dtype == torch.float64
    o, S = chunk_delta_rule(q, k, k, v, g, beta, scale=0.3, state=state)
    ref_o, ref_S = ops.kaczmarz_attention(q, k, v, g, eta, initial_state=state, eps=1e-2, scale=0.3,
                                          output_final_state=True, impl="naive")
    assert_close("o", o, ref_o, 1e-12)
    assert_close("S", S, ref_S, 1e-12)


def test_zero_key_without_eps_writes_nothing_and_has_finite_gradients():
    k = torch.zeros(1, 2, 1, 4, requires_grad=True)
    eta = torch.rand(1, 2, 1, requires_grad=True)
    beta = fused.kaczmarz_step(k, eta, 0.0)
    assert (beta == 0).all()
    beta.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (k, eta))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_step_kernel_and_its_gradient_match_torch(monkeypatch, dtype):
    """kaczmarz_step's kernels against autograd through η/(‖k‖² + eps), over rows that span several programs (a
    zero key with eps > 0 included, each program striding over several row blocks); 16-bit keys are squared and
    summed in fp32."""
    monkeypatch.setattr(beta_triton, "STEP_PROGRAMS", 2)
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(3, 11, 2, 5, generator=gen, dtype=torch.float64).to(dtype)
    k[1, 4, 0] = 0.0
    eta = torch.rand(3, 11, 2, generator=gen, dtype=torch.float64).to(dtype)
    dbeta = torch.randn(3, 11, 2, generator=gen, dtype=torch.float64)
    eps = 1e-3
    got, ref = [], []
    for fn, out in ((fused.kaczmarz_step, got), (lambda k, eta, eps: eta / ((k * k).sum(-1) + eps), ref)):
        kk, ee = k.double().requires_grad_(), eta.double().requires_grad_()
        if fn is fused.kaczmarz_step:
            kk, ee = k.clone().requires_grad_(), eta.clone().requires_grad_()
        beta = fn(kk, ee, eps)
        out += [beta.double(), *(x.double() for x in torch.autograd.grad((beta * dbeta.to(beta.dtype)).sum(),
                                                                          (kk, ee)))]
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    for name, x, r in zip(["beta", "dk", "deta"], got, ref):
        assert_close(name, x.detach(), r.detach(), tol)


@pytest.mark.parametrize("engine, programs, T", [("fla", 2048, 37), ("fla", 3, 37), ("kalmix", None, 150)])
def test_the_step_pass_checks_the_values_like_the_other_impls(monkeypatch, engine, programs, T):
    """impl="triton" checks g and eta in the pass that computes the step (fla's engine: the step pass, across
    several programs, each striding over several row blocks with 3; kalmix's: its first chunk kernel, one
    program per chunk and head, the bad value in the short last chunk or a middle one): the same errors as
    check_ranges, NaN included; check_values=False skips it."""
    if programs is not None:
        monkeypatch.setattr(beta_triton, "STEP_PROGRAMS", programs)
    monkeypatch.setattr(fused, "_fla_gdn", _gdn_stand_in)
    monkeypatch.setattr(fused, "engine", lambda device, dtype: engine)
    args, _ = _draw(T, seed=6)
    q, k, v, g, eta = (a.float() for a in args)

    def put(x, t, value):
        return x.clone().index_put_((torch.tensor(1), torch.tensor(t), torch.tensor(1)), torch.tensor(value))
    bad = {"g > 0": ("g", put(g, T - 1, 0.5), r"`g` must lie in \(-inf, 0.0\]"),
           "eta = 0": ("eta", put(eta, T - 1, 0.), r"`eta` must lie in \(0.0, 1.0\]"),
           "eta > 1": ("eta", eta * 1.5 + 0.5, r"`eta` must lie in \(0.0, 1.0\]"),
           "NaN g": ("g", put(g, T - 1, float("nan")), r"`g` contains NaN"),
           "NaN eta": ("eta", put(eta, T // 2, float("nan")), r"`eta` contains NaN")}
    for name, (which, x, msg) in bad.items():
        gates = {"g": g, "eta": eta, which: x}
        with pytest.raises(ValueError, match=msg):
            ops.kaczmarz_attention(q, k, v, gates["g"], gates["eta"], impl="triton")
        o, _ = ops.kaczmarz_attention(q, k, v, gates["g"], gates["eta"], impl="triton", check_values=False)
        assert o.shape == v.shape, name
    ops.kaczmarz_attention(q, k, v, g, eta, impl="triton")             # in range: no error


@pytest.mark.parametrize("K,V,eps", [(8, 8, 1e-6), (12, 40, 0.0), (16, 5, 0.1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decoding_step_kernel_matches_the_token_loop(K, V, eps, dtype):
    """A one-token inference call runs step.py's single kernel: o and the new state equal the token loop's."""
    gen = torch.Generator().manual_seed(K + V)
    q, k = (torch.randn(3, 1, 2, K, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(3, 1, 2, V, generator=gen, dtype=dtype)
    g, eta = -torch.rand(3, 1, 2, generator=gen, dtype=dtype), torch.rand(3, 1, 2, generator=gen, dtype=dtype)
    S0 = torch.randn(3, 2, K, V, generator=gen, dtype=torch.promote_types(dtype, torch.float32))
    outs = {}
    for impl in ("triton", "naive"):
        with torch.no_grad():
            outs[impl] = ops.kaczmarz_attention(q, k, v, g, eta, eps=eps, initial_state=S0, output_final_state=True,
                                                impl=impl, check_values=False)
    tol = 1e-14 if dtype == torch.float64 else 1e-6
    for name, x, r in zip(("o", "S"), outs["triton"], outs["naive"]):
        assert_close(name, x, r, tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_head_dim_beyond_the_chunked_kernels_is_refused_at_entry(dtype, monkeypatch, draw):
    """One K above the largest kalmix's chunked kernels hold for the dtype (the next power of two runs out of an
    H100's shared memory) is a ValueError naming the limit and K, raised before any kernel is launched; at the limit
    the op runs."""
    limit = delta_triton.MAX_K[dtype]
    launched = launch_args(monkeypatch, delta_triton._prep_kernel, "STEP")
    (q, k, v, g, eta), _ = draw("kaczmarz", 1, 3, 1, limit + 1, 4, dtype=dtype)
    with pytest.raises(ValueError, match=rf"kaczmarz_attention: impl='triton' takes K <= {limit} \(kalmix's chunked "
                                         rf"delta-rule kernels .*\), got K = {limit + 1}; impl='torch' takes any K"):
        ops.kaczmarz_attention(q, k, v, g, eta, impl="triton")
    assert launched == []
    (q, k, v, g, eta), _ = draw("kaczmarz", 1, 3, 1, limit, 4, dtype=dtype)
    o, _ = ops.kaczmarz_attention(q, k, v, g, eta, impl="triton")
    assert launched == [True] and torch.isfinite(o).all()


def test_head_dim_beyond_flas_kernels_is_refused_at_entry(monkeypatch, draw):
    """Where fla's engine runs, its limit (K <= 256, which fla asserts) is the op's ValueError."""
    monkeypatch.setattr(fused, "engine", lambda device, dtype: "fla")
    (q, k, v, g, eta), _ = draw("kaczmarz", 1, 3, 1, fused.FLA_MAX_K + 1, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"takes K <= 256 \(fla's chunk_gated_delta_rule .*\), got K = 257"):
        ops.kaczmarz_attention(q, k, v, g, eta, impl="triton")
