"""The generalised delta rule of delta.py as chunked Triton kernels, forward and backward (tensor-core form).

Per head, with a write key w_t, an erase key e_t, a step β_t and a log-decay g_t:

    S_t = γ_t S_{t-1} + β_t w_t (v_t − γ_t S_{t-1}ᵀ e_t)ᵀ,    o_t = scale · S_tᵀ q_t          S: [K, V]

Per chunk of C tokens with start state S_0, G_t = Σ_{r≤t} g_r (inside the chunk) and D[t, s] = exp(G_t − G_s)
for s ≤ t (0 above the diagonal):

    A = strictly_lower(diag(β) (E Wᵀ) ⊙ D),   T = (I + A)⁻¹
    W̃ = T diag(β e^G) E,   Ũ = T diag(β) V,   U = Ũ − W̃ S_0                  (the pseudo-values u_t)
    O = scale · (diag(e^G) Q S_0 + ((Q Wᵀ) ⊙ D) U)
    S_C = e^{G_C} S_0 + (diag(e^{G_C − G}) W)ᵀ U

The backward runs the adjoint of these equations (README of kalmix/ops/kaczmarz, "Chunked form"): the
chunk-end state gradients dS_C go backwards over chunks with dU = scale·Pᵀ dO + diag(e^{G_C−G}) W dS_C and
dS_0 = scale·Qᵀ diag(e^G) dO + e^{G_C} dS_C − W̃ᵀ dU, and every chunk then differentiates its own equations,
through T by dA = −(Tᵀ dŨ) Ũᵀ − (Tᵀ dW̃) W̃ᵀ. Chunk-start states are recomputed, never stored by the forward;
T, W̃ and Ũ are (T in the activations' dtype: it only ever feeds tensor-core products).

Kernels (every tensor laid out [tokens, H, *] with packed sequences; a chunk never crosses a sequence):
    _step_kernel      per row block: the Kaczmarz step β = η/(‖k‖² + eps) and its backward, for fla's kernels
    _prep_kernel      per (chunk, head): G, T, W̃, Ũ (kept by the forward for the backward); with ``step_eps``
                      the step itself from the chunk's keys
    _states_kernel    per (sequence, head, V block), forward over chunks: chunk-start states h, U, final state
    _output_kernel    per (chunk, head): O
    _dv_local_kernel  per (chunk, head): dU's term from the chunk's own outputs, scale·Pᵀ dO
    _dstates_kernel   per (sequence, head, V block), backward over chunks: the rest of dU, dS_C per chunk, dS_0
    _grads_qw_kernel  per (chunk, head): dq, dw and dg's terms from o and S_C, dW̃
    _grads_wy_kernel  per (chunk, head): through T, W̃, Ũ: dv, de, dβ, the rest of dw, dg
The backward recomputes the states (one pass over the chunks) but not the chunk systems.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kalmix.ops.common.checks import compute_dtype
from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.varlen import batch_offsets

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
CHUNK = 64
# per operand width (16-bit activations, or fp32/fp64): the V block, the pipeline depth and each kernel's warps
# (or warps and its own pipeline depth). fp32 operands need twice the shared memory, and the backward's per-chunk
# kernels hold three [C, K] fp32 accumulators, hence the smaller fp32 tiles. "narrow": the V block and launches of
# the two kernels that walk each (sequence, head) through its chunks in order, used when their programs at the usual
# V block would not fill the GPU (``_narrow``; at B = 4, T = 8192 on an H100). Each value measured the fastest of
# those tried at 32K tokens, K = V = 128 (H100, H200): `python benchmarks/delta_triton.py --configs prep=8 ...` times
# others against them
CONFIGS = {16: dict(BV=64, stages=2, prep=(4, 3), states=(4, 3), output=4, dv_local=4, dstates=(8, 3),
                    grads_qw=(8, 3), grads_wy=4, narrow=dict(BV=32, states=(4, 4), dstates=(4, 3))),
           32: dict(BV=32, stages=1, prep=8, states=8, output=8, dv_local=4, dstates=8, grads_qw=8, grads_wy=8)}
DOT_FP32 = tl.constexpr("ieee" if INTERPRET else "tf32x3")   # fp32 inputs: products accurate to ~fp32


@triton.jit
def _dot_acc(a, b, acc, DT: tl.constexpr):
    """acc + a @ b on tensor cores with both operands in DT (the activations' 16-bit dtype, or fp32 as 3×TF32;
    fp64 stays fp64), accumulated by the tensor-core instruction itself (acc None: a fresh product)."""
    if DT == tl.float32:        # (the interpreter's 16-bit operands are multiplied in fp32)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_FP32)
    elif DT == tl.float64:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a.to(DT), b.to(DT), acc)


@triton.jit
def _dot(a, b, DT: tl.constexpr):
    """a @ b as ``_dot_acc`` multiplies."""
    return _dot_acc(a, b, None, DT)


@triton.jit
def _acc(x):
    """The arithmetic dtype: fp64 stays fp64, everything else becomes fp32."""
    if x.dtype == tl.float64:
        return x
    else:
        return x.to(tl.float32)


@triton.jit
def _chunk_rows(chunks_ptr, i_c, C: tl.constexpr):
    """Token range [bos, bos + L) of chunk i_c and its row indices / validity as [C, 1] and [1, C] grids."""
    bos = tl.load(chunks_ptr + 2 * i_c)
    L = tl.load(chunks_ptr + 2 * i_c + 1) - bos
    r = tl.arange(0, C)
    return bos, L, r[:, None], r[None, :], r < L


@triton.jit
def _rows(ptr, bos, L, i_h, H, D, d0, BD: tl.constexpr, C: tl.constexpr):
    """Pointers to rows bos..bos+C of head i_h, columns d0..d0+BD of a [tokens, H, D] tensor (a scalar row base
    plus 32-bit offsets), and the mask of rows < L and columns < D."""
    r = tl.arange(0, C)[:, None]
    d = d0 + tl.arange(0, BD)[None, :]
    return ptr + (bos.to(tl.int64) * H + i_h) * D + (r * (H * D) + d), (r < L) & (d < D)


@triton.jit
def _load_tokens(ptr, bos, L, i_h, H, other, C: tl.constexpr):
    """Rows bos..bos+C of head i_h of a [tokens, H] tensor as [C], ``other`` past row L."""
    return tl.load(ptr + (bos + tl.arange(0, C)) * H + i_h, mask=tl.arange(0, C) < L, other=other)


@triton.jit
def _store_tokens(ptr, x, bos, L, i_h, H, C: tl.constexpr):
    tl.store(ptr + (bos + tl.arange(0, C)) * H + i_h, x, mask=tl.arange(0, C) < L)


@triton.jit
def _load_rows(ptr, bos, L, i_h, H, D, d0, BD: tl.constexpr, C: tl.constexpr):
    """That block as fp32 [C, BD], 0 outside the rows and columns."""
    return _acc(_raw_rows(ptr, bos, L, i_h, H, D, d0, BD, C))


@triton.jit
def _raw_rows(ptr, bos, L, i_h, H, D, d0, BD: tl.constexpr, C: tl.constexpr):
    """That block in the tensor's dtype (for tensor-core operands: no round trip through fp32)."""
    p, m = _rows(ptr, bos, L, i_h, H, D, d0, BD, C)
    return tl.load(p, mask=m, other=0.)


@triton.jit
def _load_cols(ptr, bos, L, i_h, H, D, d0, BD: tl.constexpr, C: tl.constexpr):
    """The block of ``_load_rows`` transposed, loaded as fp32 [BD, C]."""
    return _acc(_raw_cols(ptr, bos, L, i_h, H, D, d0, BD, C))


@triton.jit
def _raw_cols(ptr, bos, L, i_h, H, D, d0, BD: tl.constexpr, C: tl.constexpr):
    """``_load_cols`` in the tensor's dtype."""
    r = tl.arange(0, C)[None, :]
    d = d0 + tl.arange(0, BD)[:, None]
    return tl.load(ptr + (bos.to(tl.int64) * H + i_h) * D + (r * (H * D) + d), mask=(r < L) & (d < D), other=0.)


@triton.jit
def _store_rows(ptr, x, bos, L, i_h, H, D, d0, BD: tl.constexpr, C: tl.constexpr):
    p, m = _rows(ptr, bos, L, i_h, H, D, d0, BD, C)
    tl.store(p, x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _state(ptr, base, K, V, v0, BK: tl.constexpr, BV: tl.constexpr):
    """Pointers to columns v0..v0+BV of the [K, V] matrix at ``ptr + base``, and their mask."""
    k = tl.arange(0, BK)[:, None]
    v = v0 + tl.arange(0, BV)[None, :]
    return ptr + base + (k * V + v), (k < K) & (v < V)


@triton.jit
def _load_state(ptr, base, K, V, v0, BK: tl.constexpr, BV: tl.constexpr):
    return _acc(_raw_state(ptr, base, K, V, v0, BK, BV))


@triton.jit
def _raw_state(ptr, base, K, V, v0, BK: tl.constexpr, BV: tl.constexpr):
    """Columns v0..v0+BV of the [K, V] matrix at ``ptr + base`` in its dtype."""
    p, m = _state(ptr, base, K, V, v0, BK, BV)
    return tl.load(p, mask=m, other=0.)


@triton.jit
def _raw_state_t(ptr, base, K, V, v0, BK: tl.constexpr, BV: tl.constexpr):
    """Columns v0..v0+BV of the [K, V] matrix at ``ptr + base``, transposed ([BV, BK]) in its dtype."""
    k = tl.arange(0, BK)[None, :]
    v = v0 + tl.arange(0, BV)[:, None]
    return tl.load(ptr + base + (k * V + v), mask=(k < K) & (v < V), other=0.)


@triton.jit
def _store_state(ptr, base, x, K, V, v0, BK: tl.constexpr, BV: tl.constexpr):
    p, m = _state(ptr, base, K, V, v0, BK, BV)
    tl.store(p, x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _last(G, L, C: tl.constexpr):
    """G at row L − 1 (the chunk's last token) of a [C] vector."""
    return tl.sum(tl.where(tl.arange(0, C) == L - 1, G, 0.), axis=0)


@triton.jit
def _gate_rows(g_ptr, beta_ptr, bos, i_h, H, valid, C: tl.constexpr):
    """g_t and β_t of the chunk's rows as [C] fp32 (0 past its end)."""
    r = (bos + tl.arange(0, C)) * H + i_h
    return _acc(tl.load(g_ptr + r, mask=valid, other=0.)), _acc(tl.load(beta_ptr + r, mask=valid, other=0.))


@triton.jit
def _gates(g_ptr, beta_ptr, bos, L, i_h, H, valid, C: tl.constexpr):
    """G_t (log decay from the chunk start) and β_t as [C] fp32, and G at the chunk's last token."""
    g, beta = _gate_rows(g_ptr, beta_ptr, bos, i_h, H, valid, C)
    G = tl.cumsum(g, axis=0)
    return G, beta, _last(G, L, C)


@triton.jit
def _inv_den(den):
    """1/den, 0 where den = 0 (the step of a zero key with eps = 0: it writes nothing)."""
    return tl.where(den > 0, 1. / tl.where(den > 0, den, 1.), 0.)


@triton.jit
def _inv_sq_norm(k, eps):
    """c² = 1/(‖k‖² + eps) per row of a [R, BK] block (0 where ‖k‖² + eps = 0: such a key writes nothing)."""
    return _inv_den(tl.sum(k * k, axis=1) + eps)


@triton.jit
def _no_extrema(R: tl.constexpr):
    """Running (min, max, NaN count) per lane of an [R] block before any value: (+inf, −inf, 0)."""
    return tl.full([R], float("inf"), tl.float32), tl.full([R], -float("inf"), tl.float32), tl.zeros([R], tl.float32)


@triton.jit
def _add_extrema(ext, x, valid):
    """The running extremes ``ext`` (``_no_extrema``) updated with the valid values of the [R] block x (as fp32)."""
    lo, hi, nan = ext
    x = x.to(tl.float32)
    return (tl.minimum(lo, tl.where(valid, x, float("inf"))), tl.maximum(hi, tl.where(valid, x, -float("inf"))),
            nan + (valid & (x != x)).to(tl.float32))


@triton.jit
def _store_extrema(out, ext):
    """min, max and NaN count of the running extremes at out[0..2]: one range of a program's row in the
    [programs, n, 3] layout checks.defer_check folds (no atomics, nothing to initialise)."""
    lo, hi, nan = ext
    tl.store(out, tl.min(lo, axis=0))
    tl.store(out + 1, tl.max(hi, axis=0))
    tl.store(out + 2, tl.sum(nan, axis=0))


@triton.jit
def _step_kernel(k_ptr, eta_ptr, g_ptr, ext_ptr, dbeta_ptr, out_ptr, dk_ptr, n_rows, eps, K, R: tl.constexpr,
                 BK: tl.constexpr, BACKWARD: tl.constexpr, CHECK: tl.constexpr):
    """Blocks of R (token, head) rows, strided over the programs. Forward: β = η c², c² = 1/(‖k‖² + eps); CHECK
    also writes g's and η's min, max and NaN count over the program's rows to its [2, 3] row of ``ext``
    ([programs, 2, 3], folded by checks.defer_check: no atomics, nothing to initialise). BACKWARD: from dβ,
    dη = c² dβ and dk = −2 η c⁴ dβ k."""
    d = tl.arange(0, BK)[None, :]
    ext_g, ext_e = _no_extrema(R), _no_extrema(R)
    for r0 in range(tl.program_id(0) * R, n_rows, tl.num_programs(0) * R):
        r = r0 + tl.arange(0, R)
        m = r < n_rows
        off, mk = r[:, None].to(tl.int64) * K + d, m[:, None] & (d < K)
        k = _acc(tl.load(k_ptr + off, mask=mk, other=0.))
        c2 = _inv_sq_norm(k, eps)
        eta = _acc(tl.load(eta_ptr + r, mask=m, other=0.))
        if BACKWARD:
            dbeta = _acc(tl.load(dbeta_ptr + r, mask=m, other=0.))
            tl.store(out_ptr + r, (c2 * dbeta).to(out_ptr.dtype.element_ty), mask=m)
            dk = (-2. * eta * c2 * c2 * dbeta)[:, None] * k
            tl.store(dk_ptr + off, dk.to(dk_ptr.dtype.element_ty), mask=mk)
        else:
            tl.store(out_ptr + r, eta * c2, mask=m)
            if CHECK:
                ext_g = _add_extrema(ext_g, tl.load(g_ptr + r, mask=m, other=0.), m)
                ext_e = _add_extrema(ext_e, eta, m)
    if CHECK:
        row = ext_ptr + tl.program_id(0) * 6
        _store_extrema(row, ext_g)
        _store_extrema(row + 3, ext_e)


# the step pass's row block, most programs and warps: the fastest tried (16-64 rows, 1056-2112 programs, 4-8 warps)
# at 32K tokens × 8 heads × K = 128 on an H100, its value check written as per-program extrema rather than atomics
# into one buffer (`python benchmarks/kaczmarz_fused.py` times the op with fla's engine, which runs this pass)
_STEP_ROWS, _STEP_PROGRAMS, _STEP_WARPS = 32, 1056, 8


def step_programs(n_rows: int) -> int:
    """Programs of the step pass over ``n_rows`` (token, head) rows."""
    return max(1, min(triton.cdiv(n_rows, _STEP_ROWS), _STEP_PROGRAMS))


def step_extrema(n_rows: int, device: torch.device) -> torch.Tensor:
    """The buffer the step pass over ``n_rows`` rows writes its check into: per program, g's then η's min, max and
    NaN count ([programs, 2, 3] fp32, every element written by the pass)."""
    return torch.empty(step_programs(n_rows), 2, 3, device=device)


def _step_launch(k, eta, dbeta, out, dk, eps, backward, g=None, ext=None):
    K = k.shape[-1]
    n = eta.numel()
    _step_kernel[(step_programs(n),)](k, eta, g, ext, dbeta, out, dk, n, eps, K, R=_STEP_ROWS,
                                      BK=triton.next_power_of_2(K), BACKWARD=backward, CHECK=ext is not None,
                                      num_warps=_STEP_WARPS)


def kaczmarz_step(k: torch.Tensor, eta: torch.Tensor, eps: float, g: torch.Tensor | None = None,
                  ext: torch.Tensor | None = None) -> torch.Tensor:
    """β = η/(‖k‖² + eps) (0 where ‖k‖² + eps = 0) for k [..., K] and eta [...], in fp32 (fp64 for fp64 k): the
    Kaczmarz step that turns the delta rule on raw keys into the projection. One pass over k; differentiable.
    With ``ext`` (``step_extrema(eta.numel())``) the same pass writes each program's min, max and NaN
    count of g (like eta) and eta into it, for the op's value check (``checks.defer_check``)."""
    if ext is not None:
        g = g.contiguous()
    if torch.is_grad_enabled() and (k.requires_grad or eta.requires_grad):
        return _KaczmarzStep.apply(k, eta, float(eps), g, ext)
    k, eta = k.contiguous(), eta.contiguous()
    beta = torch.empty(eta.shape, dtype=compute_dtype(k), device=k.device)
    _step_launch(k, eta, None, beta, None, float(eps), False, g, ext)
    return beta


class _KaczmarzStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, eta, eps, g, ext):
        k, eta = k.contiguous(), eta.contiguous()
        beta = torch.empty(eta.shape, dtype=compute_dtype(k), device=k.device)
        _step_launch(k, eta, None, beta, None, eps, False, g, ext)
        ctx.save_for_backward(k, eta)
        ctx.eps = eps
        return beta

    @staticmethod
    @no_autocast
    def backward(ctx, dbeta):
        k, eta = ctx.saved_tensors
        dk, deta = torch.empty_like(k), torch.empty_like(eta)
        _step_launch(k, eta, dbeta.contiguous(), deta, dk, ctx.eps, True)
        return dk, deta, None, None, None


@triton.jit
def _decay(G, rows, cols, STRICT: tl.constexpr):
    """D[t, s] = exp(G_t − G_s) on s < t (STRICT) or s <= t, else 0 (masked before exp: nothing overflows)."""
    keep = (cols < rows) if STRICT else (cols <= rows)
    return tl.where(keep, tl.exp(tl.where(keep, G[:, None] - G[None, :], 0.)), 0.)


@triton.jit
def _dot32(a, b, DT: tl.constexpr):
    """a @ b with fp32 operands (the triangular solve's): 3×TF32 for fp32 activations, one TF32 pass for 16-bit
    ones (fp64 stays fp64)."""
    if DT == tl.float32:
        return tl.dot(a, b, input_precision=DOT_FP32)
    elif DT == tl.float64:
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _merge(Tm, A, rows, cols, size: tl.constexpr, DT: tl.constexpr):
    """T for blocks of ``size`` from Tm, T of their four sub-blocks: with N = Tm·(A's sub-blocks below the diagonal
    inside each block), nilpotent of order 4, T = (I + N)⁻¹ Tm = (I − N)(I + N²) Tm."""
    sub: tl.constexpr = size // 4
    N = _dot32(Tm, tl.where((rows // size == cols // size) & (rows // sub != cols // sub), A, 0.), DT)
    X = Tm - _dot32(N, Tm, DT)
    return X + _dot32(N, _dot32(N, X, DT), DT)


@triton.jit
def _system(KW, G, beta, rows, cols, C: tl.constexpr, DT: tl.constexpr):
    """T = (I + A)⁻¹ for A = strictly_lower(diag(β) KW ⊙ D), KW = E Wᵀ: the diagonal blocks of 4 by forward
    substitution (the blocks' rows i together), then two merges of four blocks each (4 → 16 → 64)."""
    tl.static_assert(C == 64)
    A = KW * _decay(G, rows, cols, True) * beta[:, None]
    eye = (rows == cols).to(G.dtype)
    Tm = eye
    for i in tl.static_range(1, 4):
        sel = (rows % 4) == i
        Tm = tl.where(sel, eye - _dot32(tl.where(sel & (rows // 4 == cols // 4), A, 0.), Tm, DT), Tm)
    return _merge(_merge(Tm, A, rows, cols, 16, DT), A, rows, cols, 64, DT)


@triton.jit
def _prep_kernel(w_ptr, e_ptr, v_ptr, g_ptr, beta_ptr, chunks_ptr, Gc_ptr, T_ptr, wt_ptr, ut_ptr, step_ptr, ext_ptr,
                 step_eps, H, K, V, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                 STEP: tl.constexpr, CHECK: tl.constexpr):
    """Per (chunk, head): G, T, W̃, Ũ. STEP (w is e = k, ``beta`` is η): the step β = η/(‖k‖² + eps), ‖k_t‖² read
    off the diagonal of K Kᵀ (which the system needs anyway), stored to ``step``. CHECK: g's then η's min, max and
    NaN count over the chunk into this program's [2, 3] row of ``ext`` ([programs, 2, 3], the step pass's
    layout)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, rows, cols, valid = _chunk_rows(chunks_ptr, i_c, C)
    g, beta = _gate_rows(g_ptr, beta_ptr, bos, i_h, H, valid, C)
    G = tl.cumsum(g, axis=0)
    E = _load_rows(e_ptr, bos, L, i_h, H, K, 0, BK, C)
    W = E if STEP else _load_rows(w_ptr, bos, L, i_h, H, K, 0, BK, C)
    KW = _dot(E, tl.trans(W), DT)
    r = tl.arange(0, C)
    if STEP:
        eta = beta
        beta = eta * _inv_den(tl.sum(tl.where(rows == cols, KW, 0.), axis=1) + step_eps)
        tl.store(step_ptr + (bos + r) * H + i_h, beta, mask=valid)
    Tm = _system(KW, G, beta, rows, cols, C, DT)
    tl.store(Gc_ptr + (bos + r) * H + i_h, G, mask=valid)
    _store_rows(T_ptr, Tm, bos, L, i_h, H, C, 0, C, C)
    _store_rows(wt_ptr, _dot(Tm, E * (beta * tl.exp(G))[:, None], DT), bos, L, i_h, H, K, 0, BK, C)
    for v0 in range(0, V, BV):
        Vt = _load_rows(v_ptr, bos, L, i_h, H, V, v0, BV, C)
        _store_rows(ut_ptr, _dot(Tm, Vt * beta[:, None], DT), bos, L, i_h, H, V, v0, BV, C)
    if CHECK:
        row = ext_ptr + (i_c * tl.num_programs(1) + i_h) * 6
        _store_extrema(row, _add_extrema(_no_extrema(C), g, valid))
        _store_extrema(row + 3, _add_extrema(_no_extrema(C), eta, valid))


@triton.jit
def _seq_range(cu_ptr, coff_ptr, i_n, C: tl.constexpr):
    bos = tl.load(cu_ptr + i_n)
    eos = tl.load(cu_ptr + i_n + 1)
    return bos, eos, tl.load(coff_ptr + i_n), tl.cdiv(eos - bos, C)


@triton.jit
def _chunk_at(bos, eos, j, C: tl.constexpr):
    t0 = bos + j * C
    r = tl.arange(0, C)
    L = tl.minimum(eos - t0, C)
    return t0, L, r < L


@triton.jit
def _chunk_gate(Gc_ptr, t0, L, i_h, H, valid, C: tl.constexpr):
    """The stored G of the chunk at t0 as [C] and its value at the last token. Rows past the chunk's end hold
    G_end, as a cumulative sum over zero gates would: with 0 there, D = exp(G_t − G_s) of a padded row t
    overflowed once |G| > 88 (inf · 0 = NaN in the products over rows)."""
    G = tl.load(Gc_ptr + (t0 + tl.arange(0, C)) * H + i_h, mask=valid, other=0.)
    G_end = _last(G, L, C)
    return tl.where(valid, G, G_end), G_end


@triton.jit
def _states_kernel(w_ptr, wt_ptr, ut_ptr, Gc_ptr, s0_ptr, cu_ptr, coff_ptr, h_ptr, u_ptr, sT_ptr, H, K, V,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, HAS_S0: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    v0 = i_v * BV
    bos, eos, c0, n_c = _seq_range(cu_ptr, coff_ptr, i_n, C)
    if HAS_S0:
        S = _load_state(s0_ptr, i_nh.to(tl.int64) * K * V, K, V, v0, BK, BV)
    else:
        S = tl.zeros([BK, BV], dtype=sT_ptr.dtype.element_ty)
    for j in range(0, n_c):
        t0, L, valid = _chunk_at(bos, eos, j, C)
        _store_state(h_ptr, ((c0 + j).to(tl.int64) * H + i_h) * K * V, S, K, V, v0, BK, BV)
        U = _load_rows(ut_ptr, t0, L, i_h, H, V, v0, BV, C) - _dot(
            _raw_rows(wt_ptr, t0, L, i_h, H, K, 0, BK, C), S, DT)
        _store_rows(u_ptr, U, t0, L, i_h, H, V, v0, BV, C)
        G, G_end = _chunk_gate(Gc_ptr, t0, L, i_h, H, valid, C)
        # the decay e^{G_C − G} scales U's [C, BV] rows rather than W's [C, K] ones; W stays in its dtype
        S = tl.exp(G_end) * S + _dot(tl.trans(_raw_rows(w_ptr, t0, L, i_h, H, K, 0, BK, C)),
                                     U * tl.exp(G_end - G)[:, None], DT)
    _store_state(sT_ptr, i_nh.to(tl.int64) * K * V, S, K, V, v0, BK, BV)


@triton.jit
def _chunk_scores(q_ptr, w_ptr, Gc_ptr, chunks_ptr, i_c, i_h, H, K, C: tl.constexpr, BK: tl.constexpr,
                  DT: tl.constexpr):
    """Chunk i_c's first token and length, G, Q and the decayed scores P = (Q Wᵀ) ⊙ D (the output's intra-chunk
    term, and in the backward the one dU gets from the chunk's own outputs). Q in its dtype (a tensor-core
    operand only)."""
    bos, L, rows, cols, valid = _chunk_rows(chunks_ptr, i_c, C)
    G, _ = _chunk_gate(Gc_ptr, bos, L, i_h, H, valid, C)
    Q = _raw_rows(q_ptr, bos, L, i_h, H, K, 0, BK, C)
    W = _raw_rows(w_ptr, bos, L, i_h, H, K, 0, BK, C)
    return bos, L, G, Q, _dot(Q, tl.trans(W), DT) * _decay(G, rows, cols, False)


@triton.jit
def _output_kernel(q_ptr, w_ptr, u_ptr, Gc_ptr, h_ptr, chunks_ptr, o_ptr, scale, H, K, V,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr):
    """Per (chunk, head), over its V blocks: O (P once per chunk)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, G, Q, P = _chunk_scores(q_ptr, w_ptr, Gc_ptr, chunks_ptr, i_c, i_h, H, K, C, BK, DT)
    eG = scale * tl.exp(G)[:, None]
    P = scale * P
    for v0 in range(0, V, BV):
        S0 = _raw_state(h_ptr, (i_c.to(tl.int64) * H + i_h) * K * V, K, V, v0, BK, BV)
        U = _raw_rows(u_ptr, bos, L, i_h, H, V, v0, BV, C)
        _store_rows(o_ptr, eG * _dot(Q, S0, DT) + _dot(P, U, DT), bos, L, i_h, H, V, v0, BV, C)


@triton.jit
def _dv_local_kernel(q_ptr, w_ptr, Gc_ptr, do_ptr, chunks_ptr, du_ptr, scale, H, K, V,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr):
    """Per (chunk, head), over its V blocks: dU's term from the chunk's own outputs, scale·Pᵀ dO with
    P = (Q Wᵀ) ⊙ D (_dstates_kernel adds the term from the later chunks)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, _, _, P = _chunk_scores(q_ptr, w_ptr, Gc_ptr, chunks_ptr, i_c, i_h, H, K, C, BK, DT)
    Pt = scale * tl.trans(P)
    for v0 in range(0, V, BV):
        dO = _raw_rows(do_ptr, bos, L, i_h, H, V, v0, BV, C)
        _store_rows(du_ptr, _dot(Pt, dO, DT), bos, L, i_h, H, V, v0, BV, C)


@triton.jit
def _dstates_kernel(q_ptr, w_ptr, wt_ptr, Gc_ptr, do_ptr, dsT_ptr, cu_ptr, coff_ptr, du_ptr, dh_ptr, ds0_ptr,
                    scale, H, K, V, C: tl.constexpr, BH: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                    HAS_DST: tl.constexpr, HAS_DS0: tl.constexpr):
    """Per (sequence, head, V block), backward over chunks: dS_C of every chunk, and dU = (the local term that
    _dv_local_kernel left in du) + diag(e^{G_C − G}) W dS_C, in place; dS_0 when HAS_DS0 (there is an initial
    state). dS is held as two blocks of BH rows of K (the second one empty when K <= BH)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    v0 = i_v * BV
    bos, eos, c0, n_c = _seq_range(cu_ptr, coff_ptr, i_n, C)
    base = i_nh.to(tl.int64) * K * V
    if HAS_DST:
        dS1 = _load_state(dsT_ptr, base, K, V, v0, BH, BV)
        dS2 = _load_state(dsT_ptr, base + BH * V, K - BH, V, v0, BH, BV)
    else:
        dS1 = tl.zeros([BH, BV], dtype=Gc_ptr.dtype.element_ty)
        dS2 = tl.zeros([BH, BV], dtype=Gc_ptr.dtype.element_ty)
    for jj in range(0, n_c):
        j = n_c - 1 - jj
        t0, L, valid = _chunk_at(bos, eos, j, C)
        hb = ((c0 + j).to(tl.int64) * H + i_h) * K * V
        _store_state(dh_ptr, hb, dS1, K, V, v0, BH, BV)
        _store_state(dh_ptr, hb + BH * V, dS2, K - BH, V, v0, BH, BV)
        G, G_end = _chunk_gate(Gc_ptr, t0, L, i_h, H, valid, C)
        dU = _dot(_raw_rows(w_ptr, t0, L, i_h, H, K, 0, BH, C), dS1, DT) + _dot(
            _raw_rows(w_ptr, t0, L, i_h, H, K, BH, BH, C), dS2, DT)
        dU = _load_rows(du_ptr, t0, L, i_h, H, V, v0, BV, C) + tl.exp(G_end - G)[:, None] * dU
        _store_rows(du_ptr, dU, t0, L, i_h, H, V, v0, BV, C)
        dO = _raw_rows(do_ptr, t0, L, i_h, H, V, v0, BV, C)
        eG = tl.exp(G)[None, :]
        dS1 = (scale * _dot(_load_cols(q_ptr, t0, L, i_h, H, K, 0, BH, C) * eG, dO, DT) + tl.exp(G_end) * dS1
               - _dot(_raw_cols(wt_ptr, t0, L, i_h, H, K, 0, BH, C), dU, DT))
        dS2 = (scale * _dot(_load_cols(q_ptr, t0, L, i_h, H, K, BH, BH, C) * eG, dO, DT) + tl.exp(G_end) * dS2
               - _dot(_raw_cols(wt_ptr, t0, L, i_h, H, K, BH, BH, C), dU, DT))
    if HAS_DS0:
        _store_state(ds0_ptr, base, dS1, K, V, v0, BH, BV)
        _store_state(ds0_ptr, base + BH * V, dS2, K - BH, V, v0, BH, BV)


@triton.jit
def _grads_qw_kernel(q_ptr, w_ptr, g_ptr, beta_ptr, chunks_ptr, h_ptr, dh_ptr, u_ptr, du_ptr, do_ptr,
                     dq_ptr, dw_ptr, dwt_ptr, dG_ptr, scale, H, K, V,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr):
    """Per chunk: dq; the parts of dw (dwp) and of dG from o and S_C; dW̃ = −dU S_0ᵀ for _grads_wy_kernel."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, rows, cols, valid = _chunk_rows(chunks_ptr, i_c, C)
    G, beta, G_end = _gates(g_ptr, beta_ptr, bos, L, i_h, H, valid, C)
    base = (i_c.to(tl.int64) * H + i_h) * K * V
    dQ = tl.zeros([C, BK], dtype=G.dtype)           # Σ_v dO S_0ᵀ
    dWs = tl.zeros([C, BK], dtype=G.dtype)          # Σ_v U dS_Cᵀ
    dWt = tl.zeros([C, BK], dtype=G.dtype)          # Σ_v dU S_0ᵀ (dW̃ is its negative)
    dP = tl.zeros([C, C], dtype=G.dtype)            # Σ_v dO Uᵀ
    dGe = tl.zeros([BK], dtype=G.dtype)             # Σ_v (S_0 ⊙ dS_C) summed over V
    for v0 in range(0, V, BV):
        S0t = _raw_state_t(h_ptr, base, K, V, v0, BK, BV)
        dSCt = _raw_state_t(dh_ptr, base, K, V, v0, BK, BV)
        U = _raw_rows(u_ptr, bos, L, i_h, H, V, v0, BV, C)
        dO = _raw_rows(do_ptr, bos, L, i_h, H, V, v0, BV, C)
        dQ = _dot_acc(dO, S0t, dQ, DT)
        dP = _dot_acc(dO, tl.trans(U), dP, DT)
        dWs = _dot_acc(U, dSCt, dWs, DT)
        dWt = _dot_acc(_raw_rows(du_ptr, bos, L, i_h, H, V, v0, BV, C), S0t, dWt, DT)
        dGe += tl.sum(_acc(S0t) * _acc(dSCt), axis=0)
    dG_end = tl.sum(dGe, axis=0)
    _store_rows(dwt_ptr, -dWt, bos, L, i_h, H, K, 0, BK, C)
    Q = _raw_rows(q_ptr, bos, L, i_h, H, K, 0, BK, C)
    W = _raw_rows(w_ptr, bos, L, i_h, H, K, 0, BK, C)
    # S_C's terms e^{G_C} S_0 + (e^{G_C − G} W)ᵀ U
    dWs = tl.exp(G_end - G)[:, None] * dWs
    dG_end = dG_end * tl.exp(G_end) + tl.sum(tl.sum(_acc(W) * dWs, axis=1), axis=0)
    # o = scale·e^G Q S_0 + scale·((Q Wᵀ) ⊙ D) U: dq and dw in full, then dG = Σ_k q dq − Σ_k w dw per row (the
    # decay's derivative, as each e^{G_t − G_s} pairs q_t with w_s; S_C's term enters through dw with its sign)
    dPD = scale * dP * _decay(G, rows, cols, False)
    dQ = _dot_acc(dPD, W, scale * tl.exp(G)[:, None] * dQ, DT)
    dWs = _dot_acc(tl.trans(dPD), Q, dWs, DT)
    dG = tl.sum(_acc(Q) * dQ, axis=1) - tl.sum(_acc(W) * dWs, axis=1)
    _store_rows(dq_ptr, dQ, bos, L, i_h, H, K, 0, BK, C)
    _store_rows(dw_ptr, dWs, bos, L, i_h, H, K, 0, BK, C)
    r = tl.arange(0, C)
    tl.store(dG_ptr + (bos + r) * H + i_h, dG + tl.where(r == L - 1, dG_end, 0.), mask=valid)


@triton.jit
def _grads_wy_kernel(w_ptr, e_ptr, v_ptr, g_ptr, beta_ptr, chunks_ptr, T_ptr, du_ptr, dwt_ptr, dG_ptr, dwp_ptr,
                     dw_ptr, de_ptr, dv_ptr, dg_ptr, dbeta_ptr, step_eps, H, K, V,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, STEP: tl.constexpr):
    """Per chunk, through Ũ = T diag(β) V, W̃ = T diag(β e^G) E and T = (I + A)⁻¹: dv, de, dβ, the rest of dw
    and dG, and dg (the reverse cumulative sum of dG: G_t = Σ_{r≤t} g_r). STEP (w = e = k, β = η c² with
    c² = 1/(‖k‖² + step_eps)): one key gradient dw + de − 2 β c² dβ k, and dη = c² dβ in place of dβ. Ũ and
    W̃ are recomputed from T (H100: loading the forward's instead took 0.417 ms against 0.356)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, rows, cols, valid = _chunk_rows(chunks_ptr, i_c, C)
    G, beta, G_end = _gates(g_ptr, beta_ptr, bos, L, i_h, H, valid, C)
    eG = tl.exp(G)
    Tm = _raw_rows(T_ptr, bos, L, i_h, H, C, 0, C, C)
    Tt = tl.trans(Tm)
    dA = tl.zeros([C, C], dtype=G.dtype)            # −Σ_v (Tᵀ dŨ) Ũᵀ
    dbeta = tl.zeros([C], dtype=G.dtype)
    for v0 in range(0, V, BV):
        Vt = _load_rows(v_ptr, bos, L, i_h, H, V, v0, BV, C)
        dXv = _dot(Tt, _raw_rows(du_ptr, bos, L, i_h, H, V, v0, BV, C), DT)                   # Tᵀ dŨ
        _store_rows(dv_ptr, dXv * beta[:, None], bos, L, i_h, H, V, v0, BV, C)
        dbeta += tl.sum(Vt * dXv, axis=1)
        dA = _dot_acc(-dXv, tl.trans(_dot(Tm, Vt * beta[:, None], DT)), dA, DT)
    E = _load_rows(e_ptr, bos, L, i_h, H, K, 0, BK, C)
    W = _load_rows(w_ptr, bos, L, i_h, H, K, 0, BK, C)
    dXe = _dot(Tt, _raw_rows(dwt_ptr, bos, L, i_h, H, K, 0, BK, C), DT)                       # Tᵀ dW̃
    t_e = eG * tl.sum(E * dXe, axis=1)
    dbeta += t_e
    r = tl.arange(0, C)
    dG = tl.load(dG_ptr + (bos + r) * H + i_h, mask=valid, other=0.) + beta * t_e
    dA = _dot_acc(-dXe, tl.trans(_dot(Tm, E * (beta * eG)[:, None], DT)), dA, DT)
    # A = strictly_lower(diag(β)(E Wᵀ) ⊙ D)
    D = _decay(G, rows, cols, True)
    dA = tl.where(cols < rows, dA, 0.)
    M = dA * D * _dot(E, tl.trans(W), DT)
    dbeta += tl.sum(M, axis=1)
    M = M * beta[:, None]
    dG += tl.sum(M, axis=1) - tl.sum(M, axis=0)
    dAD = dA * D * beta[:, None]
    dE = (beta * eG)[:, None] * dXe + _dot(dAD, W, DT)
    dW = _load_rows(dwp_ptr, bos, L, i_h, H, K, 0, BK, C) + _dot(tl.trans(dAD), E, DT)
    if STEP:
        c2 = _inv_sq_norm(E, step_eps)
        _store_rows(dw_ptr, dW + dE - (2. * beta * c2 * dbeta)[:, None] * E, bos, L, i_h, H, K, 0, BK, C)
        dbeta = c2 * dbeta
    else:
        _store_rows(de_ptr, dE, bos, L, i_h, H, K, 0, BK, C)
        _store_rows(dw_ptr, dW, bos, L, i_h, H, K, 0, BK, C)
    dg = tl.sum(dG, axis=0) - tl.cumsum(dG, axis=0) + dG
    tl.store(dg_ptr + (bos + r) * H + i_h, dg.to(dg_ptr.dtype.element_ty), mask=valid)
    tl.store(dbeta_ptr + (bos + r) * H + i_h, dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid)


def _chunk_table(cu: torch.Tensor, B: int, T: int, C: int, packed: bool):
    """Per sequence: its first chunk [N]; per chunk: its token range [NC, 2] (int32, on cu's device)."""
    if not packed:
        return batch_table(B, T, C, cu.device)
    dev = cu.device
    lens = cu[1:] - cu[:-1]
    n = (lens + C - 1) // C
    coff = torch.cumsum(n, 0) - n
    n_total = int(n.sum())
    seq = torch.repeat_interleave(torch.arange(len(n), device=dev), n, output_size=n_total)
    start = cu[seq] + (torch.arange(n_total, device=dev) - coff[seq]) * C
    end = torch.minimum(start + C, cu[seq + 1])
    return coff.to(torch.int32), torch.stack([start, end], 1).to(torch.int32).contiguous()


@functools.lru_cache(maxsize=64)
def batch_table(B: int, T: int, C: int, device: torch.device):
    """``_chunk_table`` of B sequences of T tokens, kept per shape: an op call on a batch builds no tables (they
    took ~10 small kernels and their launches per call). The kernels only read them."""
    n = triton.cdiv(T, C)
    start = torch.arange(0, B * T, T)[:, None] + torch.arange(0, n * C, C)[None, :]
    end = torch.minimum(start + C, torch.arange(T, (B + 1) * T, T)[:, None])
    table = torch.stack([start, end], -1).view(-1, 2).to(device=device, dtype=torch.int32)
    return batch_offsets(B, n, device)[:-1], table      # each sequence's first chunk: starts of B runs of n


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _config(dtype: torch.dtype) -> dict:
    """CONFIGS' entry for activations of ``dtype`` (16-bit, or fp32/fp64)."""
    return CONFIGS[16 if dtype.itemsize == 2 else 32]


def _narrow(dtype: torch.dtype, V: int, n_seq_heads: int, device: torch.device) -> bool:
    """Whether the sequential kernels (states, dstates) take CONFIGS' "narrow" V blocks: when their
    (sequence, head, V block) programs at the usual V block would leave streaming multiprocessors idle."""
    cfg = _config(dtype)
    return ("narrow" in cfg and device.type == "cuda"
            and n_seq_heads * triton.cdiv(V, cfg["BV"]) < _sm_count(device))


def _launch(dtype: torch.dtype, K: int, V: int, narrow: bool = False) -> dict:
    """{kernel: launch keywords} for activations of ``dtype`` and head sizes K, V (the grids over V blocks read
    kw[kernel]["BV"]); ``narrow``: the states and dstates kernels take CONFIGS' "narrow" V block and launches."""
    cfg = _config(dtype)
    # 16-bit tiles at least 32 wide: with K = V = 16 (16-wide tiles) the bf16 kernels returned garbage (H200,
    # triton 3.6); the padding is masked
    low = 32 if dtype.itemsize == 2 else 16
    BK = max(low, triton.next_power_of_2(K))
    BV = max(low, min(cfg["BV"], triton.next_power_of_2(V)))
    # the interpreter's dot overflows on 16-bit operands (numpy has no bf16): there they are multiplied in fp32
    DT = tl.float32 if INTERPRET and dtype.itemsize == 2 else _DT[dtype]
    kw = dict(C=CHUNK, BK=BK, BV=BV, DT=DT, num_stages=cfg["stages"])
    # 16-wide tiles at 8 warps made illegal memory accesses on an H200 (triton 3.6: the fp32 output kernel, and
    # the 16-bit grads_wy kernel at 8 warps) with K = V = 16: small heads run at most 4 warps
    cap = 4 if min(BK, BV) <= 16 else 8
    sub = cfg["narrow"] if narrow and "narrow" in cfg else {}
    kws = {}
    for k, w in cfg.items():
        if k not in ("BV", "stages", "narrow"):
            w = sub.get(k, w)
            warps, stages = w if isinstance(w, tuple) else (w, cfg["stages"])
            kws[k] = dict(kw, num_warps=min(warps, cap), num_stages=stages)
            if k in sub:
                kws[k]["BV"] = max(low, min(sub["BV"], triton.next_power_of_2(V)))
    kws["dstates"]["BH"] = max(low, kws["dstates"].pop("BK") // 2)      # dS in two blocks of rows
    return kws


_DT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32, torch.float64: tl.float64}


def _prep(w, e, v, g, beta, chunks, step_eps=None, check=False):
    """Per chunk: G [tokens, H] (fp32), T [tokens, H, C] and the WY factors W̃, Ũ (the activations' dtype: the
    tensor-core operands they feed are). With ``step_eps`` (w is e, ``beta`` is η) also the step β [tokens, H]
    (fp32) the kernel computed, and with ``check`` the extremes of g and η ([programs, 2, 3]); else None."""
    Ttot, H, K = w.shape
    V = v.shape[-1]
    kw = _launch(w.dtype, K, V)
    act = dict(dtype=w.dtype, device=w.device)
    Gc = torch.empty(Ttot, H, dtype=compute_dtype(w), device=w.device)
    Tm, wt, ut = torch.empty(Ttot, H, CHUNK, **act), torch.empty(Ttot, H, K, **act), torch.empty(Ttot, H, V, **act)
    step = torch.empty_like(Gc) if step_eps is not None else None
    ext = torch.empty(chunks.shape[0] * H, 2, 3, device=w.device) if check else None
    _prep_kernel[(chunks.shape[0], H)](w, e, v, g, beta, chunks, Gc, Tm, wt, ut, step, ext,
                                       0. if step_eps is None else step_eps, H, K, V, STEP=step is not None,
                                       CHECK=check, **kw["prep"])
    return Gc, Tm, wt, ut, step, ext


def _states(w, wt, ut, Gc, s0, cu, coff, n_chunks):
    """Chunk-start states h [NC, H, K, V] and pseudo-values U (the activations' dtype), final state (fp32); s0
    None: zero initial states."""
    Ttot, H, K = w.shape
    V = ut.shape[-1]
    N = cu.numel() - 1
    kw = _launch(w.dtype, K, V, _narrow(w.dtype, V, N * H, w.device))["states"]
    act = dict(dtype=w.dtype, device=w.device)
    h, U = torch.empty(n_chunks, H, K, V, **act), torch.empty(Ttot, H, V, **act)
    sT = torch.empty(N, H, K, V, dtype=compute_dtype(w), device=w.device)
    _states_kernel[(triton.cdiv(V, kw["BV"]), N * H)](w, wt, ut, Gc, s0, cu, coff, h, U, sT, H, K, V,
                                                      HAS_S0=s0 is not None, **kw)
    return h, U, sT


def _output(q, w, U, Gc, h, chunks, scale):
    Ttot, H, K = q.shape
    V = U.shape[-1]
    kw = _launch(q.dtype, K, V)
    o = torch.empty_like(U)
    _output_kernel[(chunks.shape[0], H)](q, w, U, Gc, h, chunks, o, scale, H, K, V, **kw["output"])
    return o


class ChunkDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, w, e, v, g, beta, s0, cu, packed, scale, step_eps, check):
        B, T, H, K = q.shape
        V = v.shape[-1]
        flat = [x.reshape(B * T, *x.shape[2:]).contiguous() for x in (q, w, e, v, g, beta)]
        coff, chunks = _chunk_table(cu, B, T, CHUNK, packed)
        s0 = None if s0 is None else s0.contiguous()
        Gc, Tm, wt, ut, step, ext = _prep(*flat[1:], chunks, step_eps, check)
        if step is not None:                    # beta was η; the backward takes the step η/(‖k‖² + eps)
            flat[5] = step
        h, U, sT = _states(flat[1], wt, ut, Gc, s0, cu, coff, chunks.shape[0])
        o = _output(flat[0], flat[1], U, Gc, h, chunks, scale)
        # the backward reuses the chunk systems (their solve is the forward's costliest kernel) and recomputes
        # only the states
        ctx.save_for_backward(*flat, s0, cu, coff, chunks, Gc, Tm, wt, ut)
        ctx.scale, ctx.shape, ctx.step_eps, ctx.beta_dtype = scale, (B, T, H, K, V), step_eps, beta.dtype
        ctx.set_materialize_grads(False)
        if ext is None:
            return o.view(B, T, H, V), sT
        ctx.mark_non_differentiable(ext)
        return o.view(B, T, H, V), sT, ext

    @staticmethod
    @no_autocast
    def backward(ctx, do, dsT, *_):
        q, w, e, v, g, beta, s0, cu, coff, chunks, Gc, Tm, wt, ut = ctx.saved_tensors
        B, T, H, K, V = ctx.shape
        NC, N = chunks.shape[0], cu.numel() - 1
        kw = _launch(q.dtype, K, V, _narrow(q.dtype, V, N * H, q.device))
        h, U, _ = _states(w, wt, ut, Gc, s0, cu, coff, NC)
        do = torch.zeros_like(v) if do is None else do.reshape(B * T, H, V).contiguous()
        dU, dh = torch.empty_like(U), torch.empty_like(h)
        ds0 = None if s0 is None else Gc.new_empty(N, H, K, V)
        _dv_local_kernel[(NC, H)](q, w, Gc, do, chunks, dU, ctx.scale, H, K, V, **kw["dv_local"])
        _dstates_kernel[(triton.cdiv(V, kw["dstates"]["BV"]), N * H)](
            q, w, wt, Gc, do, dU if dsT is None else dsT.contiguous(), cu, coff, dU, dh, ds0, ctx.scale, H, K, V,
            HAS_DST=dsT is not None, HAS_DS0=s0 is not None, **kw["dstates"])
        step = ctx.step_eps is not None
        dq, dw, dv = (torch.empty_like(x) for x in (q, w, v))
        de = dw if step else torch.empty_like(e)                # STEP writes the one key's gradient to dw
        dg, dbeta = torch.empty_like(g), torch.empty_like(beta, dtype=ctx.beta_dtype)    # (η's dtype for step_eps)
        # dW̃ only feeds a tensor-core product (operands in the activations' dtype) and dw's partial sum dwp is
        # stored as dw is (as fla stores dk's): both are kept in the activations' dtype (H100: grads_qw 421 -> 404
        # us for a 16-bit dwp)
        dwp, dwt, dG = torch.empty_like(w), torch.empty_like(w), torch.empty_like(g, dtype=compute_dtype(q))
        _grads_qw_kernel[(NC, H)](q, w, g, beta, chunks, h, dh, U, dU, do, dq, dwp, dwt, dG, ctx.scale, H, K, V,
                                  **kw["grads_qw"])
        _grads_wy_kernel[(NC, H)](w, e, v, g, beta, chunks, Tm, dU, dwt, dG, dwp, dw, de, dv, dg, dbeta,
                                  0. if ctx.step_eps is None else ctx.step_eps, H, K, V, STEP=step, **kw["grads_wy"])
        shape = lambda x: x.view(B, T, *x.shape[1:])  # noqa: E731
        return (shape(dq), shape(dw), None if step else shape(de), shape(dv), shape(dg), shape(dbeta),
                ds0, None, None, None, None, None)


def chunk_delta_rule_triton(q, w, e, v, g, beta, *, scale: float, state: torch.Tensor | None,
                            cu_seqlens: torch.Tensor | None = None, step_eps: float | None = None,
                            check: bool = False):
    """The rule of the module docstring on GPU tensors (or under TRITON_INTERPRET).

    Args:
        q, w, e: [B, T, H, K]; v: [B, T, H, V], all of one dtype (bf16/fp16/fp32; fp64 runs in fp64);
        g (log γ <= 0), beta: [B, T, H], any float dtype (their gradients come in it).
        state: [N, H, K, V] initial states (N = B, or the number of packed sequences), or None (zeros).
        cu_seqlens: [N + 1] offsets of packed sequences (B = 1).
        step_eps: the Kaczmarz rule: w and e are one tensor k, ``beta`` is η and the step is
            η/(‖k‖² + step_eps) (0 where that denominator is 0), computed by the first kernel from the keys it
            loads anyway; gradients reach k (on w) and η.
        check: with ``step_eps``, that kernel also writes the extremes of g and η per (chunk, head), for
            ``checks.defer_check`` ([programs, 2, 3]: g's then η's min, max and NaN count).
    Returns:
        o [B, T, H, V] in v's dtype, final state [N, H, K, V] in fp32 (fp64 for fp64 inputs), and with ``check``
        the extremes.
    """
    if step_eps is not None and w is not e:
        raise ValueError("chunk_delta_rule_triton: step_eps needs the write and erase keys to be one tensor")
    if check and step_eps is None:
        raise ValueError("chunk_delta_rule_triton: check reads the extremes of g and η, which need step_eps")
    B, T = q.shape[:2]
    cu = batch_offsets(B, T, q.device) if cu_seqlens is None else cu_seqlens.to(torch.int32)
    acc = compute_dtype(q)
    # the kernels read the gates in fp32 whatever they are stored in; fp64 runs are converted to keep fp64
    g, beta = (x if acc == torch.float32 else x.to(acc) for x in (g, beta))
    state = None if state is None else state.to(acc)
    return ChunkDeltaRuleFunction.apply(q, w, e, v, g, beta, state, cu, cu_seqlens is not None, scale, step_eps,
                                        check)
