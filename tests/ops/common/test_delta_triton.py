"""kalmix's chunked delta-rule kernels (interpreter on CPU) against the fp64 chunked torch path: separate write
and erase keys, partial chunks, several V blocks, a head size that is not a power of two, packed sequences
around the chunk length, fp32 in the ill-conditioned regime of near-identical keys, and each gradient source."""
import pytest
import torch
import torch.nn.functional as F

from kalmix.ops.common import delta_triton as dt
from kalmix.ops.common.delta import chunk_delta_rule
from kalmix.ops.common.testing import assert_close, random_functional_grads
from kalmix.ops.common.varlen import check_offsets, run_packed


def _inputs(B, T, H, K, V, n_seq, seed, similar_keys=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = r(B, T, H, K)
    if similar_keys:        # every key within a few degrees of one direction, full steps, no decay
        w = F.normalize(F.normalize(r(K), dim=0) + 0.05 * r(B, T, H, K), dim=-1)
        e, g, beta = w.clone(), torch.zeros(B, T, H, dtype=torch.float64), torch.ones(B, T, H, dtype=torch.float64)
    else:
        w, e = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
        g = -0.5 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
        beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return [q, w, e, r(B, T, H, V), g, beta, r(n_seq, H, K, V)]


def _reference(xs, scale, cu=None):
    def core(q, w, e, v, g, beta, *, state):
        o, S = chunk_delta_rule(q, w, e, v, g, beta, scale=scale, state=state[0])
        return (o,), (S,)
    (o,), (S,) = run_packed(core, cu, xs[:6], (xs[6],))
    return o, S


def _outputs_and_grads(fn, xs, dtype, wrt_o=True, wrt_S=True, tied=False):
    """Outputs and gradients (zeros where an input does not reach the loss); ``tied`` runs e = w as one leaf,
    whose gradient then lands on w."""
    xs = [x.to(dtype).requires_grad_() for x in xs]
    o, S = fn([xs[0], xs[1], xs[1], *xs[3:]] if tied else xs)
    grads = random_functional_grads([t for t, use in ((o, wrt_o), (S, wrt_S)) if use], xs)
    return [o.detach(), S.detach()] + grads


def _compare(xs, dtype, tol, cu=None, **kw):
    scale = 0.3
    ref = _outputs_and_grads(lambda x: _reference(x, scale, cu), xs, torch.float64, **kw)
    got = _outputs_and_grads(lambda x: dt.chunk_delta_rule_triton(*x[:6], scale=scale, state=x[6], cu_seqlens=cu),
                             xs, dtype, **kw)
    for name, x, r in zip("o S dq dw de dv dg dbeta dS0".split(), got, ref):
        assert_close(name, x, r, tol)


def test_partial_chunks_several_v_blocks_odd_head_size():
    """T = 150 ends in a partial chunk; V = 40 spans two V blocks of 32 (the last partial); K = 20 pads to 32."""
    assert dt.CONFIGS[32]["BV"] < 40          # the config of fp32 and fp64 activations
    _compare(_inputs(2, 150, 2, 20, 40, 2, seed=0), torch.float64, 1e-12)


def test_packed_sequences_around_the_chunk_length():
    C = dt.CHUNK
    lens = [C, 1, 0, C + 1, 2 * C - 3]
    cu = check_offsets("test", torch.tensor([0] + lens).cumsum(0), None)
    _compare(_inputs(1, cu.bounds[-1], 1, 16, 16, len(lens), seed=1), torch.float64, 1e-12, cu=cu)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_strong_decays_in_partial_chunks(dtype, tol):
    """Decays of trained layers reach g ~ −5 per token: |G| within a chunk then exceeds exp's fp32 range (88), and
    the rows past a partial chunk's end must not overflow (they once gave inf · 0 = NaN in every gradient)."""
    lens = [5, 70, 33]
    cu = check_offsets("test", torch.tensor([0] + lens).cumsum(0), None)
    xs = _inputs(1, cu.bounds[-1], 2, 16, 16, len(lens), seed=4)
    xs[4] = xs[4] * 20                                   # g in (−10, 0]
    _compare(xs, dtype, tol, cu=cu)


@pytest.mark.parametrize("wrt_o,wrt_S", [(True, False), (False, True)])
def test_each_gradient_source_alone(wrt_o, wrt_S):
    _compare(_inputs(1, 70, 1, 16, 16, 1, seed=2), torch.float64, 1e-12, wrt_o=wrt_o, wrt_S=wrt_S)


def test_fp32_with_near_identical_keys():
    """Unit steps on keys a few degrees apart make I + A far from the identity; fp32 must still track the fp64
    path. The keys are tied (w = e, as in Kaczmarz/GDN): here the gradients through w and e alone are
    ill-conditioned (fp32 torch misses them by 20%) while their sum, the key's gradient, is not."""
    _compare(_inputs(1, 130, 1, 16, 16, 1, seed=3, similar_keys=True), torch.float32, 2e-5, tied=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_kaczmarz_step_mode_with_key_norms_spread_over_two_decades(dtype, tol):
    """step_eps: raw keys whose norms spread over 0.1..10 inside every chunk (A's entries then reach ~100·η),
    β = η/(‖k‖² + eps) computed by the kernels; the key's one gradient and dη against autograd through the
    formula on the fp64 torch path, packed sequences included."""
    gen = torch.Generator().manual_seed(4)
    lens = [dt.CHUNK + 5, 0, 70]
    cu = check_offsets("test", torch.tensor([0] + lens).cumsum(0), None)
    T, H, K, V, eps = cu.bounds[-1], 2, 16, 24, 1e-3
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    k = F.normalize(r(1, T, H, K), dim=-1) * 10 ** (2 * torch.rand(1, T, H, 1, generator=gen, dtype=torch.float64) - 1)
    k[0, 3, 1] = 0.0
    xs = [r(1, T, H, K), k, r(1, T, H, V), -0.3 * torch.rand(1, T, H, generator=gen, dtype=torch.float64),
          0.05 + 0.95 * torch.rand(1, T, H, generator=gen, dtype=torch.float64), r(len(lens), H, K, V)]

    def ref(x):
        (o,), (S,) = run_packed(
            lambda q, k, v, g, eta, *, state: [[t] for t in chunk_delta_rule(
                q, k, k, v, g, eta / ((k * k).sum(-1) + eps), scale=0.3, state=state[0])],
            cu, x[:5], (x[5],))
        return o, S
    want = _outputs_and_grads(ref, xs, torch.float64)
    got = _outputs_and_grads(lambda x: dt.chunk_delta_rule_triton(x[0], x[1], x[1], *x[2:5], scale=0.3, state=x[5],
                                                                  cu_seqlens=cu, step_eps=eps), xs, dtype)
    for name, x, w in zip("o S dq dk dv dg deta dS0".split(), got, want):
        assert_close(name, x, w, tol)


@pytest.mark.parametrize("narrow", [False, True])
def test_16_bit_activations_at_both_launches_of_the_sequential_kernels(monkeypatch, narrow):
    """bf16 activations with the states and dstates kernels at CONFIGS' usual V block and at the "narrow" one
    the op picks when few (sequence, head) programs would leave the GPU idle: V = 80 spans 2 or 3 V blocks (the
    last partial). Against the fp64 path on the same bf16-rounded inputs (the interpreter multiplies 16-bit
    operands in fp32; T, W̃, Ũ, h and U are stored in bf16)."""
    monkeypatch.setattr(dt, "_narrow", lambda *a: narrow)
    cfg = dt.CONFIGS[16]
    assert cfg["narrow"]["BV"] < cfg["BV"] < 80 < 2 * cfg["BV"]
    xs = [x.to(torch.bfloat16).double() if i < 4 else x for i, x in enumerate(_inputs(2, 130, 2, 32, 80, 2, seed=6))]
    scale = 0.3
    ref = _outputs_and_grads(lambda x: _reference(x, scale), xs, torch.float64)
    got = _outputs_and_grads(lambda x: dt.chunk_delta_rule_triton(*[t.to(torch.bfloat16) if i < 4 else t.float()
                                                                    for i, t in enumerate(x[:6])],
                                                                  scale=scale, state=x[6].float()),
                             xs, torch.float64)
    for name, x, r in zip("o S dq dw de dv dg dbeta dS0".split(), got, ref):
        assert_close(name, x.double(), r, 2e-2)


def test_no_initial_state_and_16_bit_gates():
    """state=None runs without an initial state: the same outputs and gradients as zeros, bit for bit, and no
    gradient for it; gates stored in bf16 are read as they are and their gradients come back in bf16."""
    q, w, e, v, g, beta, s0 = (x.float() for x in _inputs(2, 70, 2, 16, 16, 2, seed=5))
    g, beta = g.bfloat16(), beta.bfloat16()
    runs = []
    for state in (torch.zeros_like(s0), None):
        xs = [x.clone().requires_grad_() for x in (q, w, e, v, g, beta)]
        o, S = dt.chunk_delta_rule_triton(*xs, scale=0.3, state=state)
        runs.append([o, S, *torch.autograd.grad((o * v).sum() + S.sum(), xs)])
    for name, a, b in zip("o S dq dw de dv dg dbeta".split(), *runs):
        assert torch.equal(a, b), name
    assert runs[1][-2].dtype == runs[1][-1].dtype == torch.bfloat16
