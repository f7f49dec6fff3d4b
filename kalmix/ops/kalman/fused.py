"""Kalman linear attention as fused Triton kernels: one program per (sequence, head, block of channels) runs the
filter of its [N, BD] lanes token by token in registers; only o (and the variance) reach HBM.

The kernels run the covariance form of the same filter (README.md, "Fused kernels"): per lane the state is the
posterior variance y = 1/λ and the mean μ, and a step costs one reciprocal,

    u = ā² y + p̄,   g = 1 / (1 + φ u),   y' = u g,   μ' = (ā μ + r u) g.

Every quantity is a sum or product of non-negative terms except ā μ + r u, whose rounding is that of the moment
form, so nothing cancels. The backward is the exact adjoint of this step run in reverse. It needs each step's
input state: the forward stores (y, μ) every C tokens (the checkpoints), and the backward recomputes the C
states of a chunk into registers from its checkpoint, then walks them back. The first chunk of a sequence is
the short one (L mod C tokens, or C) and runs as plain loops, its backward recomputing each input state from
the initial state, so every later chunk is full and unrolled. Both kernels load a full chunk's inputs one
chunk ahead of its use (software pipelining by hand), so the loads' latency hides behind a chunk of math.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.triton_utils import INTERPRET, chunk_starts
from kalmix.ops.common.varlen import Offsets, batch_offsets

# `python benchmarks/kalman_fused.py --configs CHUNK,FWD_BD,FWD_WARPS,BWD_BD1,BWD_BD2,BWD_WARPS` times other values
# of the constants below on a GPU; `python benchmarks/kernel_report.py --ops kalman` prints registers and spills.
CHUNK = 4                               # tokens between checkpoints (unrolled; the backward holds their states)
FWD_CONFIG = (16, 1)                                        # (channels per program, warps)
# the forward halves its channel blocks (down to 2) until it launches this many programs, so that few long
# sequences still fill the GPU (B = 2, T = 16384: 256 programs at blocks of 16, and blocks of 4 the fastest there:
# `kalmix speed --device cuda --ops kalman_attention --seq-lens 16384`)
FWD_MIN_PROGRAMS = 1024
# the forward's register cap, so that 16 one-warp programs fit per multiprocessor (at its uncapped 136, B = 16,
# T = 2048's 2048 programs ran in 1.03 waves)
FWD_MAXNREG = 128
BWD_CONFIG = (4, 2, 1)                                      # (BD1, BD2, warps): [BD1, BN, BD2] lanes per program
# (4, 2) makes Triton lay each thread's 4 lanes along N with no spills; (2, 4) spills (--configs 4,16,1,2,4,1)
# the GPU takes 1/x in fp32 as one approximate reciprocal (rel. error ~1 ulp) instead of a full-range division
FAST_RCP = tl.constexpr(not INTERPRET)


@triton.jit
def _lanes(i_d, i_h, N, D, BN: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr, EVEN: tl.constexpr):
    """A program's lanes as a [BD1, BN, BD2] grid: slot offsets o_n [1, BN, 1], channels o_d [BD1, 1, BD2]
    (channel = block start + d1·BD2 + d2), their masks (constant true when EVEN: N = BN and the blocks tile D),
    and the offsets in an [H, N, D] tensor. Triton spreads the threads over BD2 first, then BD1, then BN (what
    is left of BN stays inside a thread), so the shape picks which sums stay inside a thread."""
    o_n = tl.arange(0, BN)[None, :, None]
    o_d = i_d * BD1 * BD2 + tl.arange(0, BD1)[:, None, None] * BD2 + tl.arange(0, BD2)[None, None, :]
    if EVEN:
        m_n, m_d = tl.full([1, BN, 1], 1, tl.int1), tl.full([BD1, 1, BD2], 1, tl.int1)
    else:
        m_n, m_d = o_n < N, o_d < D
    return o_n, o_d, m_n, m_d, i_h * N * D + o_n * D + o_d


@triton.jit
def _rcp(x):
    if FAST_RCP and x.dtype == tl.float32:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def _sum_n(x):
    return tl.sum(x, axis=1, keep_dims=True)


@triton.jit
def _sum_d(x):
    return tl.sum(tl.sum(x, axis=2, keep_dims=True), axis=0, keep_dims=True)


@triton.jit
def _rows(geo, t):
    """Token t's row offsets (int64 scalars) in the [B·T, H, N] tensors and in the [B·T, H, D] ones: rows are
    addressed from scalar pointers, the lanes by 32-bit offsets."""
    bos, i_h, H, N, D = geo[0], geo[1], geo[2], geo[3], geo[4]
    tok = bos + t
    return tok * H * N + i_h * N, tok * H * D + i_h * D


@triton.jit
def _load_token(io, lanes, rows, ACC: tl.constexpr):
    """q, k [1, BN, 1] and v, w [BD1, 1, BD2] of the token at ``rows`` (``_rows``)."""
    o_n, o_d, m_n, m_d = lanes
    q = tl.load(io[0] + rows[0] + o_n, mask=m_n, other=0.).to(ACC)
    k = tl.load(io[1] + rows[0] + o_n, mask=m_n, other=0.).to(ACC)
    v = tl.load(io[2] + rows[1] + o_d, mask=m_d, other=0.).to(ACC)
    w = tl.load(io[3] + rows[1] + o_d, mask=m_d, other=0.).to(ACC)
    return q, k, v, w


@triton.jit
def _load_run(io, geo, lanes, t0, L0, L, LEN: tl.constexpr, ADJOINT: tl.constexpr, HAS_DVAR: tl.constexpr,
              ACC: tl.constexpr):
    """The inputs of the full chunk of LEN tokens from t0 as a nested tuple (inputs, rest), all loads issued
    together: (q, k, v, w) for the forward, ``_load_adjoint_inputs`` for the backward. The start is clamped
    into [L0, L − LEN], so a load one chunk ahead past either end of the full chunks rereads a real one; the
    rows' offsets are computed once per chunk."""
    rows = _rows(geo, tl.minimum(tl.maximum(t0, L0), L - LEN))
    H, N, D = geo[2], geo[3], geo[4]
    return _load_rows(io, lanes, rows, H * N, H * D, LEN, ADJOINT, HAS_DVAR, ACC)


@triton.jit
def _load_rows(io, lanes, rows, s_qk, s_vd, LEN: tl.constexpr, ADJOINT: tl.constexpr, HAS_DVAR: tl.constexpr,
               ACC: tl.constexpr):
    if ADJOINT:
        inputs = _load_adjoint_inputs(io, lanes, rows, HAS_DVAR, ACC)
    else:
        inputs = _load_token(io, lanes, rows, ACC)
    if LEN > 1:
        nxt = (rows[0] + s_qk, rows[1] + s_vd)
        return inputs, _load_rows(io, lanes, nxt, s_qk, s_vd, LEN - 1, ADJOINT, HAS_DVAR, ACC)
    else:
        return inputs, ()


@triton.jit
def _unless(ok, lanes):
    """The lanes with every mask off unless ``ok`` (the loads ahead of a sequence's first full chunk)."""
    o_n, o_d, m_n, m_d = lanes
    return o_n, o_d, tl.where(ok, m_n, False), tl.where(ok, m_d, False)


@triton.jit
def _load_checkpoint(cky_ptr, ckmu_ptr, offset, mask):
    """(y, μ) at element offsets ``offset`` of the [n_checkpoints, H, N, D] checkpoint buffers."""
    return tl.load(cky_ptr + offset, mask=mask, other=1.), tl.load(ckmu_ptr + offset, mask=mask, other=0.)


@triton.jit
def _filter_step(k, v, w, par, y, mu):
    """One predict + update of every lane: the new (y, μ) and the step's gain g = 1 / (1 + φ u)."""
    a, a2, p = par
    u = a2 * y + p
    wu = w * u
    g = _rcp(1.0 + (k * k) * wu)
    return u * g, (a * mu + (k * v) * wu) * g, g


@triton.jit
def _fwd_token(io, geo, lanes, par, t, y, mu, HAS_VAR: tl.constexpr, ACC: tl.constexpr):
    rows = _rows(geo, t)
    q, k, v, w = _load_token(io, lanes, rows, ACC)
    y, mu, _ = _filter_step(k, v, w, par, y, mu)
    o_d, m_d = lanes[1], lanes[3]
    tl.store(io[4] + rows[1] + o_d, _sum_n(q * mu), mask=m_d)
    if HAS_VAR:
        tl.store(io[5] + rows[1] + o_d, _sum_n(q * q * y), mask=m_d)
    return y, mu


@triton.jit
def _fwd_run(run, par, y, mu, o_c, var_c, ci, i: tl.constexpr, HAS_VAR: tl.constexpr):
    """Steps through the loaded tokens of ``run`` (``_load_run``), writing token i's outputs into row i of the
    chunk's [C, 1, BD] output tiles."""
    q, k, v, w = run[0]
    y, mu, _ = _filter_step(k, v, w, par, y, mu)
    o_c = tl.where(ci == i, _sum_n(q * mu), o_c)
    if HAS_VAR:
        var_c = tl.where(ci == i, _sum_n(q * q * y), var_c)
    if len(run[1]) > 0:
        y, mu, o_c, var_c = _fwd_run(run[1], par, y, mu, o_c, var_c, ci, i + 1, HAS_VAR)
    return y, mu, o_c, var_c


@triton.jit
def _fwd_chunk(io, geo, lanes, par, t0, run, y, mu, BD: tl.constexpr, C: tl.constexpr, HAS_VAR: tl.constexpr,
               ACC: tl.constexpr):
    """The C tokens from t0, whose inputs ``run`` were loaded one chunk ahead; outputs stored at the end."""
    H, D = geo[2], geo[4]
    o_d, m_d = lanes[1], lanes[3]
    ci = tl.arange(0, C)[:, None, None]
    zero = tl.zeros([C, 1, BD], ACC)
    y, mu, o_c, var_c = _fwd_run(run, par, y, mu, zero, zero, ci, 0, HAS_VAR)
    row0 = _rows(geo, t0)[1]
    rows = ci * H * D + o_d
    tl.store(io[4] + row0 + rows, o_c, mask=m_d)
    if HAS_VAR:
        tl.store(io[5] + row0 + rows, var_c, mask=m_d)
    return y, mu


@triton.jit
def _program(a_ptr, p_ptr, cu_ptr, chunk_ptr, H, N, D, BN: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr,
             C: tl.constexpr, EVEN: tl.constexpr, ACC: tl.constexpr):
    """What both kernels derive from the program id: channel block, sequence and head, the sequence start
    and length, the lanes (and their state offsets), the lanes' (ā, ā², p̄), and the chunking: chunk 0 holds
    the first L0 <= C tokens of the L, every later chunk exactly C; checkpoints of the sequence start at
    c_base."""
    i_d, i_sh = tl.program_id(0), tl.program_id(1)
    i_s, i_h = i_sh // H, i_sh % H
    bos = tl.load(cu_ptr + i_s).to(tl.int64)
    L = tl.load(cu_ptr + i_s + 1).to(tl.int64) - bos
    o_n, o_d, m_n, m_d, lane = _lanes(i_d, i_h, N, D, BN, BD1, BD2, EVEN)
    m_nd = m_n & m_d
    a = tl.load(a_ptr + lane, mask=m_nd, other=1.).to(ACC)
    p = tl.load(p_ptr + lane, mask=m_nd, other=0.).to(ACC)
    n_chunks = tl.cdiv(L, C)
    L0 = L - tl.maximum(n_chunks - 1, 0) * C
    c_base = tl.load(chunk_ptr + i_s).to(tl.int64)
    return (i_d, i_h, bos, (o_n, o_d, m_n, m_d), m_nd, lane, i_s * H * N * D + lane, (a, a * a, p), L, n_chunks,
            L0, c_base)


@triton.jit
def _kalman_fwd_kernel(q_ptr, k_ptr, v_ptr, w_ptr, a_ptr, p_ptr, lam0_ptr, mu0_ptr, o_ptr, var_ptr,
                       lamT_ptr, muT_ptr, cky_ptr, ckmu_ptr, cu_ptr, chunk_ptr, H: tl.constexpr,
                       N: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, C: tl.constexpr,
                       HAS_VAR: tl.constexpr, SAVE: tl.constexpr, EVEN: tl.constexpr, ACC: tl.constexpr):
    i_d, i_h, bos, lanes, m_nd, lane, st, par, L, n_chunks, L0, c_base = _program(
        a_ptr, p_ptr, cu_ptr, chunk_ptr, H, N, D, BN, 1, BD, C, EVEN, ACC)
    y = 1.0 / tl.load(lam0_ptr + st, mask=m_nd, other=1.).to(ACC)
    mu = tl.load(mu0_ptr + st, mask=m_nd, other=0.).to(ACC)
    io = (q_ptr, k_ptr, v_ptr, w_ptr, o_ptr, var_ptr)
    geo = (bos, i_h, H, N, D)
    if SAVE and n_chunks > 0:
        tl.store(cky_ptr + c_base * H * N * D + lane, y, mask=m_nd)
        tl.store(ckmu_ptr + c_base * H * N * D + lane, mu, mask=m_nd)
    for t in range(0, L0):
        y, mu = _fwd_token(io, geo, lanes, par, t, y, mu, HAS_VAR, ACC)
    # software pipelining: chunk c's inputs are loaded while chunk c - 1 runs
    run = _load_run(io, geo, _unless(n_chunks > 1, lanes), L0, L0, L, C, False, False, ACC)
    for c in range(1, n_chunks):
        ahead = _load_run(io, geo, lanes, L0 + c * C, L0, L, C, False, False, ACC)
        if SAVE:
            tl.store(cky_ptr + (c_base + c) * H * N * D + lane, y, mask=m_nd)
            tl.store(ckmu_ptr + (c_base + c) * H * N * D + lane, mu, mask=m_nd)
        y, mu = _fwd_chunk(io, geo, lanes, par, L0 + (c - 1) * C, run, y, mu, BD, C, HAS_VAR, ACC)
        run = ahead
    tl.store(lamT_ptr + st, 1.0 / y, mask=m_nd)
    tl.store(muT_ptr + st, mu, mask=m_nd)


@triton.jit
def _recompute(io, geo, lanes, par, t, y, mu, ACC: tl.constexpr):
    """The state after token t from the state before it (no outputs)."""
    _, k, v, w = _load_token(io, lanes, _rows(geo, t), ACC)
    y, mu, _ = _filter_step(k, v, w, par, y, mu)
    return y, mu


@triton.jit
def _load_adjoint_inputs(io, lanes, rows, HAS_DVAR: tl.constexpr, ACC: tl.constexpr):
    """The token's q, k, v, w, rows, do and dvar (do again when there is no variance gradient)."""
    q, k, v, w = _load_token(io, lanes, rows, ACC)
    o_d, m_d = lanes[1], lanes[3]
    do = tl.load(io[4] + rows[1] + o_d, mask=m_d, other=0.).to(ACC)
    dvar = tl.load(io[5] + rows[1] + o_d, mask=m_d, other=0.).to(ACC) if HAS_DVAR else do
    return q, k, v, w, rows, do, dvar


@triton.jit
def _adjoint_step(io, geo, lanes, par, inputs, y_p, mu_p, y_t, mu_t, g, carry, HAS_DVAR: tl.constexpr):
    """A token's gradients from its inputs, the states around it and the step's gain; carries (Gy, Gμ) back
    across it and accumulates the per-lane sums behind dā and dp̄. Only stores: the loads happened on the way
    forward."""
    o_n, o_d, m_n, m_d = lanes
    a, a2, _ = par
    Gy, Gmu, acc_u, acc_mu, acc_p = carry
    q, k, v, w, rows, do, dvar = inputs
    phi = k * k * w
    r = k * (w * v)
    Gmu_t = Gmu + q * do
    if HAS_DVAR:
        Gy_t = Gy + q * q * dvar
        dq = _sum_d(do * mu_t + 2 * q * dvar * y_t)
    else:
        Gy_t = Gy
        dq = _sum_d(do * mu_t)
    g_phi = -y_t * (Gy_t * y_t + Gmu_t * mu_t)              # ∂L/∂φ
    g_r = Gmu_t * y_t                                       # ∂L/∂r
    Gu = g * (Gy_t * g + Gmu_t * (r - mu_t * phi))          # ∂L/∂u
    g_mu_a = Gmu_t * g                                      # ∂L/∂(ā μ_{t-1})
    # φ = k² Λv and r = k Λv v
    dk = _sum_d(2 * k * w * g_phi + (w * v) * g_r)
    kg_r = _sum_n(k * g_r)
    part = geo[5] + rows[0]                                 # this block's share of Σ_d, summed on the host
    tl.store(io[6] + part + o_n, dq, mask=m_n)
    tl.store(io[7] + part + o_n, dk, mask=m_n)
    tl.store(io[8] + rows[1] + o_d, w * kg_r, mask=m_d)
    tl.store(io[9] + rows[1] + o_d, _sum_n(k * k * g_phi) + v * kg_r, mask=m_d)
    return a2 * Gu, a * g_mu_a, acc_u + Gu * y_p, acc_mu + g_mu_a * mu_p, acc_p + Gu


@triton.jit
def _reverse_run(io, geo, lanes, par, run, y, mu, carry, HAS_DVAR: tl.constexpr):
    """Adjoint of the tokens of ``run`` from the state before the first: step forward, recurse, step back, so
    every intermediate state (and gain) stays in registers (one per nesting level)."""
    inputs = run[0]
    y1, mu1, g = _filter_step(inputs[1], inputs[2], inputs[3], par, y, mu)
    if len(run[1]) > 0:
        carry = _reverse_run(io, geo, lanes, par, run[1], y1, mu1, carry, HAS_DVAR)
    return _adjoint_step(io, geo, lanes, par, inputs, y, mu, y1, mu1, g, carry, HAS_DVAR)


@triton.jit
def _kalman_bwd_kernel(q_ptr, k_ptr, v_ptr, w_ptr, a_ptr, p_ptr, lam0_ptr, lamT_ptr, cky_ptr, ckmu_ptr, do_ptr,
                       dvar_ptr, dlamT_ptr, dmuT_ptr, dq_ptr, dk_ptr, dv_ptr, dw_ptr, da_ptr, dp_ptr, dlam0_ptr,
                       dmu0_ptr, cu_ptr, chunk_ptr, TT, H: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
                       BN: tl.constexpr, BD1: tl.constexpr,
                       BD2: tl.constexpr, C: tl.constexpr, HAS_DVAR: tl.constexpr,
                       HAS_DFINAL: tl.constexpr, EVEN: tl.constexpr, ACC: tl.constexpr):
    i_d, i_h, bos, lanes, m_nd, lane, st, par, L, n_chunks, L0, c_base = _program(
        a_ptr, p_ptr, cu_ptr, chunk_ptr, H, N, D, BN, BD1, BD2, C, EVEN, ACC)
    lam0 = tl.load(lam0_ptr + st, mask=m_nd, other=1.).to(ACC)
    zero = tl.zeros([BD1, BN, BD2], ACC)
    if HAS_DFINAL:                                          # dy_T = −dλ_T λ_T²
        lamT = tl.load(lamT_ptr + st, mask=m_nd, other=1.).to(ACC)
        Gy = -tl.load(dlamT_ptr + st, mask=m_nd, other=0.).to(ACC) * lamT * lamT
        Gmu = tl.load(dmuT_ptr + st, mask=m_nd, other=0.).to(ACC)
    else:
        Gy, Gmu = zero, zero
    io = (q_ptr, k_ptr, v_ptr, w_ptr, do_ptr, dvar_ptr, dq_ptr, dk_ptr, dv_ptr, dw_ptr)
    geo = (bos, i_h, H, N, D, i_d.to(tl.int64) * TT * H * N)          # the last: this block's Σ_d partials
    carry = (Gy, Gmu, zero, zero, zero)
    # the full chunks, last first; chunk c - 1's inputs and checkpoint are loaded while chunk c runs
    ok = n_chunks > 1
    run = _load_run(io, geo, _unless(ok, lanes), L0 + (n_chunks - 2) * C, L0, L, C, True, HAS_DVAR, ACC)
    y, mu = _load_checkpoint(cky_ptr, ckmu_ptr, (c_base + tl.maximum(n_chunks - 1, 0)) * H * N * D + lane,
                             tl.where(ok, m_nd, False))
    for cc in range(1, n_chunks):
        c = n_chunks - cc
        ahead = _load_run(io, geo, lanes, L0 + (c - 2) * C, L0, L, C, True, HAS_DVAR, ACC)
        y_ahead, mu_ahead = _load_checkpoint(cky_ptr, ckmu_ptr, (c_base + tl.maximum(c - 1, 0)) * H * N * D + lane,
                                             m_nd)
        carry = _reverse_run(io, geo, lanes, par, run, y, mu, carry, HAS_DVAR)
        run, y, mu = ahead, y_ahead, mu_ahead
    # chunk 0 (L0 tokens): each token's input state recomputed from the initial state, O(L0²) steps
    y0 = 1.0 / lam0
    mu0 = tl.load(ckmu_ptr + c_base * H * N * D + lane, mask=tl.where(n_chunks > 0, m_nd, False), other=0.)
    for jj in range(0, L0):
        j = L0 - 1 - jj
        y, mu = y0, mu0
        for i in range(0, j):
            y, mu = _recompute(io, geo, lanes, par, i, y, mu, ACC)
        inputs = _load_adjoint_inputs(io, lanes, _rows(geo, j), HAS_DVAR, ACC)
        y1, mu1, g = _filter_step(inputs[1], inputs[2], inputs[3], par, y, mu)
        carry = _adjoint_step(io, geo, lanes, par, inputs, y, mu, y1, mu1, g, carry, HAS_DVAR)
    Gy, Gmu, acc_u, acc_mu, acc_p = carry
    tl.store(da_ptr + st, 2 * par[0] * acc_u + acc_mu, mask=m_nd)
    tl.store(dp_ptr + st, acc_p, mask=m_nd)
    tl.store(dlam0_ptr + st, -Gy / (lam0 * lam0), mask=m_nd)
    tl.store(dmu0_ptr + st, Gmu, mask=m_nd)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def _offsets(cu_seqlens: Offsets | None, B: int, T: int, device: torch.device):
    """Sequence starts ``cu`` [S + 1], each sequence's first checkpoint [S] and the number of checkpoints (one per
    chunk of CHUNK tokens)."""
    cu = batch_offsets(B, T, device) if cu_seqlens is None else cu_seqlens.tensor
    return cu, *chunk_starts(cu_seqlens, B, T, CHUNK, device)


class KalmanFusedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, w, a, p, lam0, mu0, cu_seqlens, output_variance: bool, grad_enabled: bool):
        B, T, H, N = q.shape
        D = v.shape[-1]
        q, k, v, w, a, p, lam0, mu0 = (x.contiguous() for x in (q, k, v, w, a, p, lam0, mu0))
        cu, chunk_off, n_ck = _offsets(cu_seqlens, B, T, q.device)
        n_seq = cu.numel() - 1
        save = grad_enabled and any(ctx.needs_input_grad[:8])     # (needs_input_grad ignores no_grad)
        o = torch.empty_like(v)
        var = torch.empty_like(v) if output_variance else None
        lamT, muT = torch.empty_like(lam0), torch.empty_like(mu0)
        cky = torch.empty((n_ck, H, N, D), dtype=lam0.dtype, device=q.device) if save else None
        ckmu = torch.empty_like(cky) if save else None
        BD, warps = FWD_CONFIG
        while BD > 2 and triton.cdiv(D, BD) * n_seq * H < FWD_MIN_PROGRAMS:
            BD //= 2
        _kalman_fwd_kernel[(triton.cdiv(D, BD), n_seq * H)](
            q, k, v, w, a, p, lam0, mu0, o, o if var is None else var, lamT, muT,
            lamT if cky is None else cky, muT if ckmu is None else ckmu, cu, chunk_off, H, N, D,
            BN=_pow2(N), BD=BD, C=CHUNK, HAS_VAR=output_variance, SAVE=save, EVEN=_even(N, D, BD), ACC=_acc(q),
            num_warps=warps, maxnreg=FWD_MAXNREG)
        if save:
            ctx.save_for_backward(q, k, v, w, a, p, lam0, lamT, cky, ckmu, cu, chunk_off)
        ctx.set_materialize_grads(False)
        return o, var, lamT, muT

    @staticmethod
    @no_autocast
    def backward(ctx, do, dvar, dlamT, dmuT):
        q, k, v, w, a, p, lam0, lamT, cky, ckmu, cu, chunk_off = ctx.saved_tensors
        B, T, H, N = q.shape
        D = v.shape[-1]
        n_seq = cu.numel() - 1
        do = torch.zeros_like(v) if do is None else do.contiguous()
        has_final = dlamT is not None or dmuT is not None
        if has_final:
            dlamT = torch.zeros_like(lam0) if dlamT is None else dlamT.contiguous()
            dmuT = torch.zeros_like(lam0) if dmuT is None else dmuT.contiguous()
        BD1, BD2, warps = BWD_CONFIG
        n_db = triton.cdiv(D, BD1 * BD2)
        part = torch.empty((2, n_db, B * T, H, N), dtype=lam0.dtype, device=q.device)   # Σ_d per block
        dv, dw = torch.empty_like(v), torch.empty_like(w)
        dadp = torch.empty((2,) + lam0.shape, dtype=lam0.dtype, device=q.device)        # per sequence
        dlam0, dmu0 = torch.empty_like(lam0), torch.empty_like(lam0)
        _kalman_bwd_kernel[(n_db, n_seq * H)](
            q, k, v, w, a, p, lam0, lamT, cky, ckmu, do, do if dvar is None else dvar.contiguous(),
            dlamT if has_final else lam0, dmuT if has_final else lam0, part[0], part[1], dv, dw, dadp[0], dadp[1],
            dlam0, dmu0, cu, chunk_off, B * T, H, N, D, BN=_pow2(N), BD1=BD1, BD2=BD2, C=CHUNK,
            HAS_DVAR=dvar is not None, HAS_DFINAL=has_final, EVEN=_even(N, D, BD1 * BD2), ACC=_acc(q), num_warps=warps)
        dq, dk = part.sum(1).view(2, B, T, H, N).to(q.dtype)
        da, dp = dadp.sum(1)
        return dq, dk, dv, dw, da.to(a.dtype), dp.to(p.dtype), dlam0, dmu0, None, None, None


def _even(N: int, D: int, block: int) -> bool:
    """No lane of any program is masked: N is a power of two and the channel blocks tile D."""
    return N == _pow2(N) and D % block == 0


def _acc(x: torch.Tensor):
    """The state dtype of the kernels: fp64 for fp64 inputs, else fp32."""
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def kalman_fused(q, k, v, w, decay, process_noise, *, state, output_variance, cu_seqlens=None):
    """Fused Triton filter (packed sequences, checked ``Offsets``, handled in the kernels); ``state`` = (precision,
    mean) [S, H, N, D] in the state dtype (fp32, fp64 for fp64 inputs). Activations keep their dtype; the math is in
    fp32/fp64."""
    o, var, lam, mu = KalmanFusedFunction.apply(q, k, v, w, decay, process_noise, state[0], state[1], cu_seqlens,
                                                output_variance, torch.is_grad_enabled())
    return (o, var), (lam, mu)
