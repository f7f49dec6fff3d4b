"""VLA's triton pieces in the interpreter: the A-path kernels against the chunked torch A path (values and every
gradient, partial sub-chunks and segments, padded K), the prologue and readout kernels against torch, the chunked
normaliser against a running sum."""
import pytest
import torch
import torch.nn.functional as F

from kalmix import ops
from kalmix.ops.common.testing import assert_close, launch_args, random_functional_grads
from kalmix.ops.vla import apath_triton, io_triton
from kalmix.ops.vla.apath_triton import write_directions_triton
from kalmix.ops.vla.chunk import normaliser, write_directions
from kalmix.ops.vla.io_triton import prologue, readout
from kalmix.ops.vla.naive import feature_map


def _inputs(B, T, H, K, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    kh, uh = (F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1) for _ in range(2))
    X = torch.randn(B, H, K, K, generator=gen, dtype=torch.float64)
    A0 = X @ X.mT / K + 0.5 * torch.eye(K, dtype=torch.float64)
    return [x.to(dtype) for x in (kh, uh, A0)]


def _cut_into_parts(monkeypatch, n: int):
    """Let the A path's forward and the backward's carry cut each sequence into up to n parts, however short
    (B·H = 4 and K <= 32, one column block, in these tests)."""
    monkeypatch.setattr(apath_triton, "MIN_PART_BLOCKS", 1)
    monkeypatch.setattr(apath_triton, "MIN_PROGRAMS", 4 * n)
    monkeypatch.setattr(apath_triton, "CARRY_MIN_PROGRAMS", 4 * n)
    monkeypatch.setattr(apath_triton, "GRAM_BYTES", 1)              # the parts' Gram sums one part at a time


def _run(fn, xs, final_grad=True):
    xs = [x.detach().requires_grad_() for x in xs]
    alpha, A = fn(*xs)
    grads = random_functional_grads((alpha, A) if final_grad else (alpha,), xs)
    grads[-1] = 0.5 * (grads[-1] + grads[-1].mT)           # only A's symmetric part is meaningful
    return [alpha.detach(), A.detach(), *grads]


@pytest.mark.parametrize("T,K,final_grad,cols", [(150, 20, True, 64), (150, 20, True, 16), (100, 8, False, 64),
                                                  (5, 16, True, 64), (300, 8, True, 64)])
@pytest.mark.parametrize("parts", [False, True])
def test_kernels_match_torch_a_path_fp64(T, K, final_grad, cols, parts, monkeypatch):
    """T = 150: ten sub-chunks in three blocks, the last ones partial; K = 20 pads to 32 (with cols = 16 the
    backward's per-block kernels split it over two column blocks, the second one partly masked). With parts the
    forward walks each part from A at its start computed directly, and the backward's carry each part from the
    later parts' sums (T = 150: three parts, the last one shorter; T = 300: three parts of two, two and one
    blocks)."""
    monkeypatch.setattr(apath_triton, "BLOCK_COLS", cols)
    col_grids = launch_args(monkeypatch, apath_triton._apath_bwd_du_kernel, "grid")
    if parts:
        _cut_into_parts(monkeypatch, 3)
        grids = launch_args(monkeypatch, apath_triton._apath_fwd_kernel, "grid")
        carries = launch_args(monkeypatch, apath_triton._apath_carry_kernel, "grid")
    xs = _inputs(2, T, 2, K, seed=T)
    ref = _run(write_directions, xs, final_grad)
    got = _run(write_directions_triton, xs, final_grad)
    if parts:                                   # (parts of the B = 2 sequences, heads)
        assert grids == [(2 * {150: 3, 100: 2, 5: 1, 300: 3}[T], 2)]
        assert carries == [(2 * {150: 3, 100: 2, 5: 1, 300: 3}[T], 2)] * (2 if T > 5 else 1)
    assert col_grids == [(2 * -(-T // 64) * (2 if cols == 16 else 1), 2)]     # (blocks · column blocks, heads)
    for name, x, r in zip("alpha A dk du dA0".split(), got, ref):
        assert_close(name, x, r, 1e-11)


@pytest.mark.filterwarnings("ignore:invalid value encountered in sqrt")  # the interpreter runs numpy
def test_parts_after_an_indefinite_initial_state_are_nan(monkeypatch):
    """A part's start is A_0's inverse plus Gram sums: where A_0 has no Cholesky factor it is NaN, not a guess."""
    _cut_into_parts(monkeypatch, 2)
    kh, uh, A0 = _inputs(2, 128, 2, 8, seed=7)
    A0[0, 1] = -A0[0, 1]
    alpha, _ = write_directions_triton(kh, uh, A0)
    assert alpha[0, 64:, 1].isnan().all()
    assert alpha[0, :, 0].isfinite().all() and alpha[1].isfinite().all()


def test_inference_call_matches_and_keys_shape():
    xs = _inputs(1, 40, 3, 8, seed=3)
    alpha, A = write_directions_triton(*xs)
    ref_alpha, ref_A = write_directions(*xs)
    assert_close("alpha", alpha, ref_alpha, 1e-11)
    assert_close("A", A, ref_A, 1e-11)


def test_nothing_stored_for_the_backward_without_grad_mode(monkeypatch):
    """Under no_grad the forward stores neither A checkpoints nor R⁻¹ rows, even for inputs that require
    gradients (autograd's needs_input_grad ignores grad mode); with grad mode on it stores both."""
    stores = launch_args(monkeypatch, apath_triton._apath_fwd_kernel, "STORE")
    rinvs = launch_args(monkeypatch, apath_triton._apath_fwd_kernel, "RINV")
    xs = [x.requires_grad_() for x in _inputs(1, 20, 1, 8, seed=5)]
    with torch.no_grad():
        alpha_eval = write_directions_triton(*xs)[0]
    alpha_train = write_directions_triton(*xs)[0]
    assert stores == [False, True] and rinvs == [False, True]
    assert_close("alpha", alpha_eval, alpha_train, 0)


@pytest.mark.parametrize("parts", [1, 3])
def test_fp32_against_fp64_with_strong_evidence(parts, monkeypatch):
    """Repeated penalty directions shrink A along them by orders of magnitude (the regime where fp32 drifts); with
    parts, A at their starts comes from fp64 sums of û ûᵀ."""
    _cut_into_parts(monkeypatch, parts)
    kh, uh, A0 = _inputs(2, 200, 2, 16, seed=5)
    uh = F.normalize(uh[:, :4].repeat(1, 50, 1, 1) + 0.05 * uh, dim=-1)
    ref = _run(write_directions, [kh, uh, A0])
    got = _run(write_directions_triton, [x.float() for x in (kh, uh, A0)])
    for name, x, r in zip("alpha A dk du dA0".split(), got, ref):
        assert_close(name, x, r, 2e-4)


@pytest.mark.parametrize("parts", [1, 2])
def test_fp32_initial_state_gradient_of_a_carried_ill_conditioned_state(parts, monkeypatch):
    """A_0 from 600 earlier tokens on 4 directions (condition number ~1e3): Ā_0 = A_0⁻¹ B̃ A_0⁻¹ would lose
    ~cond² of fp32's precision, the carried Ā keeps it; with parts, the second starts from A_0's fp64 inverse."""
    _cut_into_parts(monkeypatch, parts)
    kh, uh, _ = _inputs(2, 600, 2, 16, seed=11)
    uh = F.normalize(uh[:, :4].repeat(1, 150, 1, 1) + 0.05 * uh, dim=-1)
    _, A0 = write_directions(kh, uh, torch.eye(16, dtype=torch.float64).expand(2, 2, 16, 16) / 0.1)
    A0 = 0.5 * (A0 + A0.mT)
    ev = torch.linalg.eigvalsh(A0)
    assert ev.max() / ev.min() > 500
    xs = _inputs(2, 130, 2, 16, seed=12)[:2] + [A0]
    ref = _run(write_directions, xs)
    got = _run(write_directions_triton, [x.float() for x in xs])
    for name, x, r in zip("alpha A dk du dA0".split(), got, ref):
        assert_close(name, x, r, 2e-5)


def test_gradients_without_the_initial_state_gradient():
    """A_0 a constant (the op's default): the forward keeps no R⁻¹ rows and the backward no Ā carry."""
    kh, uh, A0 = _inputs(2, 150, 2, 20, seed=4)
    got, ref = [], []
    for fn, out in ((write_directions_triton, got), (write_directions, ref)):
        xs = [x.detach().requires_grad_() for x in (kh, uh)]
        alpha, A = fn(*xs, A0)
        out += [alpha.detach(), A.detach(), *random_functional_grads((alpha, A), xs)]
    for name, x, r in zip("alpha A dk du".split(), got, ref):
        assert_close(name, x, r, 1e-11)


@pytest.mark.parametrize("dtype,limit,holder", [(torch.float32, apath_triton.MAX_K, "the A path holds A"),
                                                 (torch.bfloat16, apath_triton.MAX_K, "the A path holds A"),
                                                 (torch.float64, 64, "kalmix's chunked delta-rule kernels")])
def test_head_dim_beyond_the_kernels_is_refused_at_entry(dtype, limit, holder, monkeypatch, draw):
    """K above the A path's register tile, or for fp64 above what the S path's delta-rule kernels hold, is a
    ValueError naming the limit and K, raised before any kernel is launched."""
    launched = launch_args(monkeypatch, io_triton._prologue_fwd_kernel, "ROWS")
    (q, k, v, u), _ = draw("vla", 1, 4, 1, limit + 1, 4, dtype=dtype)
    with pytest.raises(ValueError, match=rf"variational_linear_attention: impl='triton' takes K <= {limit} "
                                         rf"\({holder}.*\), got K = {limit + 1}; impl='torch' takes any K"):
        ops.variational_linear_attention(q, k, v, u, impl="triton")
    assert launched == []


@pytest.mark.parametrize("T", [1, 64, 100])
def test_normaliser_matches_running_sum(T):
    gen = torch.Generator().manual_seed(T)
    fq, fk = (torch.rand(2, T, 3, 5, generator=gen, dtype=torch.float64) for _ in range(2))
    n0 = torch.rand(2, 3, 5, generator=gen, dtype=torch.float64)
    ncum = n0[:, None] + fk.cumsum(1)
    den, n = normaliser(fq, fk, n0, chunk_size=16)
    assert_close("den", den, (fq * ncum).sum(-1), 1e-13)
    assert_close("n", n, ncum[:, -1], 1e-13)


def test_prologue_matches_torch():
    """K = 20 (padded to 32), 50 rows (not a multiple of the program's rows), a zero k row and a zero u row (the
    1e-12 floor of the normalisation)."""
    gen = torch.Generator().manual_seed(21)
    q, k, u = (torch.randn(2, 5, 5, 20, generator=gen, dtype=torch.float64) for _ in range(3))
    k[0, 1, 2] = 0.
    u[1, 4, 0] = 0.

    def torch_prologue(q, k, u):
        kh = F.normalize(k, dim=-1)
        return kh, F.normalize(u, dim=-1), feature_map(q), kh

    res = []
    for fn in (prologue, torch_prologue):
        xs = [x.detach().requires_grad_() for x in (q, k, u)]
        outs = fn(*xs)
        res.append([o.detach() for o in outs] + random_functional_grads(outs, xs))
    for name, x, r in zip("kh32 uh32 fq kh dq dk du".split(), *res):
        assert_close(name, x, r, 1e-13)


@pytest.mark.parametrize("T,V,eps", [(150, 80, 1e-4), (40, 16, 2.0)])
def test_readout_matches_torch(T, V, eps):
    """Several chunks, the last one partial, and two V blocks; with eps = 2 (and small features) the normaliser of
    the first tokens is clamped."""
    gen = torch.Generator().manual_seed(T)
    o_s = torch.randn(2, T, 3, V, generator=gen, dtype=torch.float64)
    q, k = (torch.randn(2, T, 3, 20, generator=gen, dtype=torch.float64) - 2 * (eps > 1) for _ in range(2))
    n0 = torch.rand(2, 3, 20, generator=gen, dtype=torch.float64) * (eps < 1)

    def torch_readout(o_s, q, k, n0):
        den, n = normaliser(feature_map(q), feature_map(k), n0)
        return o_s / den.clamp_min(eps)[..., None], n

    res = []
    for fn in (lambda *x: readout(*x, eps), torch_readout):
        xs = [x.detach().requires_grad_() for x in (o_s, q, k, n0)]
        outs = fn(*xs)
        res.append([o.detach() for o in outs] + random_functional_grads(outs, xs))
    if eps > 1:
        den, _ = normaliser(feature_map(q), feature_map(k), n0)
        assert (den < eps).any() and (den > eps).any()
    for name, x, r in zip("o n dos dq dk dn0".split(), *res):
        assert_close(name, x, r, 1e-12)
