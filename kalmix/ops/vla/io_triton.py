"""VLA's work around the A and S paths as Triton kernels (impl="triton"), one autograd function and one kernel
per direction each:

- ``prologue``: q, k, u → the A path's unit rows k̂, û in fp32 and the S path's φ(q), k̂ in the activations'
  dtype (φ = elu + 1, k̂ = k / max(‖k‖, 1e-12) as ``F.normalize``, or φ(k) / max(‖φ(k)‖, 1e-12) with
  ``feature_key``); its backward sums the two paths' gradients of k̂ and takes all three through the
  normalisation and φ.
- ``readout``: o_t = (S's output)_t / max(φ(q_t)·n_t, eps) with n_t = n_0 + Σ_{s≤t} φ(k_s), and the final n, by
  chunks of C tokens in parallel: each chunk's Σ φ(k), a walk per sequence over those [K] sums for n before every
  chunk, then each chunk from there (Σ inside a chunk as a masked product); the backward the same way round, its
  walk going backwards over the chunks' Σ ∂den_t φ(q_t) for ∂k. Packed sequences (``cu_seqlens``) take the
  chunk table of ``kalmix.ops.common.triton_utils``: no chunk crosses a sequence, each walk starts from its own
  sequence's n_0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kalmix.ops.common.checks import compute_dtype
from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.triton_utils import (chunk_rows, chunk_table, dot, load_rows, load_tokens, operand_dtype,
                                            seq_range, store_rows, store_tokens)
from kalmix.ops.common.varlen import Offsets, batch_offsets
from kalmix.ops.vla.apath_triton import unit_grad

ROWS = 16       # token rows (of one head) per program of the prologue kernels
# The readout's chunks, and the warps of its per-chunk kernels. H100, bf16, H = 8, K = V = 128, 32K tokens
# (scratch sweep, readout alone, fwd+bwd): C 16 / 32 / 64 at 2 warps 0.61 / 0.78 / 7.9 ms at T = 2048 and 0.96 /
# 0.84 / 8.0 at T = 16384 (the walk over the chunk sums grows with T / C); at 4 warps 0.90 / 0.85 / 1.05 and
# 1.14 / 0.94 / 1.14; 8 warps slower still.
C = 32
WARPS = 2
BV = 64         # columns of S's output per step of the readout kernels
CARRY_STAGES = 3  # loads in flight in the walk over the chunk sums


@triton.jit
def _phi(x):
    """elu(x) + 1."""
    return tl.where(x > 0, x + 1., tl.exp(x))


@triton.jit
def _dphi(x):
    return tl.where(x > 0, 1., tl.exp(x))


@triton.jit
def _unit(x):
    """x / max(‖x‖, 1e-12) per row, and the divisor [rows]."""
    nrm = tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-12)
    return x / nrm[:, None], nrm


@triton.jit
def _unit_back(x, g):
    """The gradient of x from that of x / max(‖x‖, 1e-12)."""
    xh, nrm = _unit(x)
    return unit_grad(xh, g, nrm)


@triton.jit
def _phi_in(x, L, K, BK: tl.constexpr, C: tl.constexpr):
    """φ(x) for a [C, BK] block of L rows and K columns, zero outside them."""
    valid = (tl.arange(0, C)[:, None] < L) & (tl.arange(0, BK)[None, :] < K)
    return tl.where(valid, _phi(x), 0.)


@triton.jit
def _key_in(k, L, K, FEATURE_KEY: tl.constexpr, BK: tl.constexpr, C: tl.constexpr):
    """What k̂ normalises: k, or φ(k) with FEATURE_KEY."""
    if FEATURE_KEY:
        k = _phi_in(k, L, K, BK, C)
    return k


@triton.jit
def _prologue_fwd_kernel(q_ptr, k_ptr, u_ptr, kh32_ptr, uh32_ptr, fq_ptr, kh_ptr, n_rows, K,
                         FEATURE_KEY: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr):
    """ROWS rows of the [rows, K] views of the tensors per program (rows as tokens of one head: H = 1)."""
    r0 = tl.program_id(0) * ROWS
    L = n_rows - r0
    k, _ = _unit(_key_in(load_rows(k_ptr, r0, L, 0, 1, K, 0, BK, ROWS), L, K, FEATURE_KEY, BK, ROWS))
    u, _ = _unit(load_rows(u_ptr, r0, L, 0, 1, K, 0, BK, ROWS))
    store_rows(kh32_ptr, k, r0, L, 0, 1, K, 0, BK, ROWS)
    store_rows(kh_ptr, k, r0, L, 0, 1, K, 0, BK, ROWS)
    store_rows(uh32_ptr, u, r0, L, 0, 1, K, 0, BK, ROWS)
    store_rows(fq_ptr, _phi(load_rows(q_ptr, r0, L, 0, 1, K, 0, BK, ROWS)), r0, L, 0, 1, K, 0, BK, ROWS)


@triton.jit
def _prologue_bwd_kernel(q_ptr, k_ptr, u_ptr, dkh32_ptr, duh32_ptr, dfq_ptr, dkh_ptr, dq_ptr, dk_ptr, du_ptr, n_rows,
                         K, HAS_DKH32: tl.constexpr, HAS_DUH32: tl.constexpr, HAS_DFQ: tl.constexpr,
                         HAS_DKH: tl.constexpr, FEATURE_KEY: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr):
    r0 = tl.program_id(0) * ROWS
    L = n_rows - r0
    q = load_rows(q_ptr, r0, L, 0, 1, K, 0, BK, ROWS)
    dq = tl.zeros_like(q)
    if HAS_DFQ:
        dq = load_rows(dfq_ptr, r0, L, 0, 1, K, 0, BK, ROWS) * _dphi(q)
    store_rows(dq_ptr, dq, r0, L, 0, 1, K, 0, BK, ROWS)
    g = tl.zeros_like(q)
    if HAS_DKH32:
        g += load_rows(dkh32_ptr, r0, L, 0, 1, K, 0, BK, ROWS)
    if HAS_DKH:
        g += load_rows(dkh_ptr, r0, L, 0, 1, K, 0, BK, ROWS)
    k = load_rows(k_ptr, r0, L, 0, 1, K, 0, BK, ROWS)
    dk = _unit_back(_key_in(k, L, K, FEATURE_KEY, BK, ROWS), g)
    if FEATURE_KEY:
        dk *= _dphi(k)
    store_rows(dk_ptr, dk, r0, L, 0, 1, K, 0, BK, ROWS)
    g = tl.zeros_like(q)
    if HAS_DUH32:
        g = load_rows(duh32_ptr, r0, L, 0, 1, K, 0, BK, ROWS)
    store_rows(du_ptr, _unit_back(load_rows(u_ptr, r0, L, 0, 1, K, 0, BK, ROWS), g), r0, L, 0, 1, K, 0, BK, ROWS)


@triton.jit
def _phi_rows(ptr, t0, L, i_h, H, K, BK: tl.constexpr, C: tl.constexpr):
    """(x, φ(x)) for rows t0..t0+C of head i_h of a [tokens, H, K] tensor, φ zero outside the rows and columns."""
    x = load_rows(ptr, t0, L, i_h, H, K, 0, BK, C)
    return x, _phi_in(x, L, K, BK, C)


@triton.jit
def _chunk_vec(ptr, j, i_h, H, K, BK: tl.constexpr):
    """Pointers and mask of the [K] vector of chunk j, head i_h in a [chunks, H, K] tensor."""
    o_k = tl.arange(0, BK)
    return ptr + (j * H + i_h).to(tl.int64) * K + o_k, o_k < K


@triton.jit
def _phi_sums_kernel(k_ptr, chunks_ptr, s_ptr, H, K, C: tl.constexpr, BK: tl.constexpr):
    """One (chunk, head) per program: the chunk's Σ_t φ(k_t)."""
    j, i_h = tl.program_id(0), tl.program_id(1)
    t0, L, _, _, _ = chunk_rows(chunks_ptr, j, C)
    _, fk = _phi_rows(k_ptr, t0, L, i_h, H, K, BK, C)
    p, m = _chunk_vec(s_ptr, j, i_h, H, K, BK)
    tl.store(p, tl.sum(fk, axis=0), mask=m)


@triton.jit
def _carry_kernel(s_ptr, init_ptr, cu_ptr, first_ptr, start_ptr, final_ptr, H, K, REVERSE: tl.constexpr,
                  C: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """One (sequence, head) per program: start[j] = init + Σ of the sequence's chunk sums s before its chunk j (after
    it when REVERSE), and final = init + Σ_j s[j] (init for an empty sequence)."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    _, _, c0, n_c = seq_range(cu_ptr, first_ptr, i_n, C)
    o_k = tl.arange(0, BK)
    base = (i_n * H + i_h).to(tl.int64) * K
    acc = tl.load(init_ptr + base + o_k, mask=o_k < K, other=0.)
    for jj in tl.range(0, n_c, num_stages=STAGES):
        j = c0 + (n_c - 1 - jj if REVERSE else jj)
        p, m = _chunk_vec(s_ptr, j, i_h, H, K, BK)
        x = tl.load(p, mask=m, other=0.)
        p, m = _chunk_vec(start_ptr, j, i_h, H, K, BK)
        tl.store(p, acc, mask=m)
        acc += x
    tl.store(final_ptr + base + o_k, acc, mask=o_k < K)


@triton.jit
def _readout_fwd_kernel(os_ptr, q_ptr, k_ptr, nst_ptr, chunks_ptr, o_ptr, den_ptr, H, K, V, eps, C: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr):
    """One (chunk, head) per program, from n before the chunk: the normaliser of each token (kept for the backward)
    and o."""
    j, i_h = tl.program_id(0), tl.program_id(1)
    t0, L, rows, cols, _ = chunk_rows(chunks_ptr, j, C)
    p, m = _chunk_vec(nst_ptr, j, i_h, H, K, BK)
    n = tl.load(p, mask=m, other=0.)
    _, fq = _phi_rows(q_ptr, t0, L, i_h, H, K, BK, C)
    _, fk = _phi_rows(k_ptr, t0, L, i_h, H, K, BK, C)
    den = tl.sum(fq * n[None, :], axis=1) + tl.sum(tl.where(cols <= rows, dot(fq, tl.trans(fk), DT), 0.), axis=1)
    store_tokens(den_ptr, den, t0, L, i_h, H, C)
    inv = 1. / tl.maximum(den, eps)[:, None]
    for v0 in range(0, V, BV):
        store_rows(o_ptr, load_rows(os_ptr, t0, L, i_h, H, V, v0, BV, C) * inv, t0, L, i_h, H, V, v0, BV, C)


@triton.jit
def _readout_bwd_kernel(do_ptr, os_ptr, q_ptr, k_ptr, nst_ptr, den_ptr, chunks_ptr, dos_ptr, dq_ptr, dden_ptr, p_ptr,
                        H, K, V, eps, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr):
    """One (chunk, head) per program: ∂(S's output), ∂den, ∂q (from n after each token) and the chunk's
    Σ_t ∂den_t φ(q_t), which ``_carry_kernel`` sums backwards for ∂k."""
    j, i_h = tl.program_id(0), tl.program_id(1)
    t0, L, rows, cols, _ = chunk_rows(chunks_ptr, j, C)
    den = load_tokens(den_ptr, t0, L, i_h, H, 1., C)
    inv = 1. / tl.maximum(den, eps)
    dd = tl.zeros([C], DT)
    for v0 in range(0, V, BV):
        do = load_rows(do_ptr, t0, L, i_h, H, V, v0, BV, C)
        dd += tl.sum(do * load_rows(os_ptr, t0, L, i_h, H, V, v0, BV, C), axis=1)
        store_rows(dos_ptr, do * inv[:, None], t0, L, i_h, H, V, v0, BV, C)
    dd = tl.where(den > eps, -dd * inv * inv, 0.)
    store_tokens(dden_ptr, dd, t0, L, i_h, H, C)
    q, fq = _phi_rows(q_ptr, t0, L, i_h, H, K, BK, C)
    _, fk = _phi_rows(k_ptr, t0, L, i_h, H, K, BK, C)
    p, m = _chunk_vec(nst_ptr, j, i_h, H, K, BK)
    n_t = tl.load(p, mask=m, other=0.)[None, :] + dot(tl.where(cols <= rows, 1., 0.).to(DT), fk, DT)
    store_rows(dq_ptr, dd[:, None] * n_t * _dphi(q), t0, L, i_h, H, K, 0, BK, C)
    p, m = _chunk_vec(p_ptr, j, i_h, H, K, BK)
    tl.store(p, tl.sum(dd[:, None] * fq, axis=0), mask=m)


@triton.jit
def _readout_dk_kernel(q_ptr, k_ptr, dden_ptr, gst_ptr, chunks_ptr, dk_ptr, H, K, C: tl.constexpr, BK: tl.constexpr,
                       DT: tl.constexpr):
    """One (chunk, head) per program: ∂k_s = φ'(k_s) (∂n after the chunk + Σ_{t≥s in it} ∂den_t φ(q_t))."""
    j, i_h = tl.program_id(0), tl.program_id(1)
    t0, L, rows, cols, _ = chunk_rows(chunks_ptr, j, C)
    dd = load_tokens(dden_ptr, t0, L, i_h, H, 0., C)
    _, fq = _phi_rows(q_ptr, t0, L, i_h, H, K, BK, C)
    p, m = _chunk_vec(gst_ptr, j, i_h, H, K, BK)
    dfk = tl.load(p, mask=m, other=0.)[None, :] + dot(tl.where(cols >= rows, dd[None, :], 0.), fq, DT)
    store_rows(dk_ptr, dfk * _dphi(load_rows(k_ptr, t0, L, i_h, H, K, 0, BK, C)), t0, L, i_h, H, K, 0, BK, C)


class PrologueFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, u, feature_key: bool):
        q, k, u = (x.contiguous() for x in (q, k, u))
        K, n_rows = q.shape[-1], q.numel() // q.shape[-1]
        kh32, uh32 = (torch.empty(q.shape, dtype=compute_dtype(q), device=q.device) for _ in range(2))
        fq, kh = torch.empty_like(q), torch.empty_like(k)
        _prologue_fwd_kernel[(triton.cdiv(n_rows, ROWS),)](q, k, u, kh32, uh32, fq, kh, n_rows, K,
                                                            FEATURE_KEY=feature_key, ROWS=ROWS,
                                                            BK=triton.next_power_of_2(K))
        ctx.save_for_backward(q, k, u)
        ctx.feature_key = feature_key
        ctx.set_materialize_grads(False)
        return kh32, uh32, fq, kh

    @staticmethod
    @no_autocast
    def backward(ctx, dkh32, duh32, dfq, dkh):
        q, k, u = ctx.saved_tensors
        K, n_rows = q.shape[-1], q.numel() // q.shape[-1]
        dq, dk, du = torch.empty_like(q), torch.empty_like(k), torch.empty_like(u)
        grads = [None if g is None else g.contiguous() for g in (dkh32, duh32, dfq, dkh)]
        _prologue_bwd_kernel[(triton.cdiv(n_rows, ROWS),)](
            q, k, u, *[q if g is None else g for g in grads], dq, dk, du, n_rows, K,
            *[g is not None for g in grads], FEATURE_KEY=ctx.feature_key, ROWS=ROWS, BK=triton.next_power_of_2(K))
        return dq, dk, du, None


class ReadoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o_s, q, k, n0, eps: float, offsets):
        o_s, q, k, n0 = (x.contiguous() for x in (o_s, q, k, n0))
        B, T, H, K = q.shape
        V = o_s.shape[-1]
        cu = batch_offsets(B, T, q.device) if offsets is None else offsets.tensor
        first, chunks = chunk_table(offsets, B, T, C, q.device)
        NC, kw = chunks.shape[0], dict(C=C, BK=_bk(K))
        sums = torch.empty(NC, H, K, dtype=n0.dtype, device=q.device)
        n_start, nT = torch.empty_like(sums), torch.empty_like(n0)
        _phi_sums_kernel[(NC, H)](k, chunks, sums, H, K, num_warps=WARPS, **kw)
        _carry_kernel[(n0.shape[0], H)](sums, n0, cu, first, n_start, nT, H, K, REVERSE=False, STAGES=CARRY_STAGES,
                                        **kw)
        o = torch.empty_like(o_s)
        den = torch.empty(B, T, H, dtype=n0.dtype, device=q.device)
        _readout_fwd_kernel[(NC, H)](o_s, q, k, n_start, chunks, o, den, H, K, V, eps, BV=_bv(V),
                                     DT=operand_dtype(n0.dtype), num_warps=WARPS, num_stages=_stages(q), **kw)
        ctx.save_for_backward(o_s, q, k, n_start, den, cu, first, chunks)
        ctx.eps = eps
        ctx.set_materialize_grads(False)
        return o, nT

    @staticmethod
    @no_autocast
    def backward(ctx, do, dnT):
        o_s, q, k, n_start, den, cu, first, chunks = ctx.saved_tensors
        H, K, V, N = q.shape[2], q.shape[3], o_s.shape[-1], first.shape[0]
        NC, kw = chunks.shape[0], dict(C=C, BK=_bk(K), DT=operand_dtype(n_start.dtype))
        do = torch.zeros_like(o_s) if do is None else do.contiguous()
        dnT = torch.zeros(N, H, K, dtype=n_start.dtype, device=q.device) if dnT is None else dnT.contiguous()
        dos, dq, dk, dn0 = torch.empty_like(o_s), torch.empty_like(q), torch.empty_like(k), torch.empty_like(dnT)
        dden = torch.empty_like(den)
        sums, g_start = torch.empty_like(n_start), torch.empty_like(n_start)
        _readout_bwd_kernel[(NC, H)](do, o_s, q, k, n_start, den, chunks, dos, dq, dden, sums, H, K, V, ctx.eps,
                                     BV=_bv(V), num_warps=WARPS, num_stages=_stages(q), **kw)
        _carry_kernel[(N, H)](sums, dnT, cu, first, g_start, dn0, H, K, REVERSE=True, C=C, BK=kw["BK"],
                              STAGES=CARRY_STAGES)
        _readout_dk_kernel[(NC, H)](q, k, dden, g_start, chunks, dk, H, K, num_warps=WARPS, **kw)
        return dos, dq, dk, dn0, None, None


def _bk(K: int) -> int:
    return max(16, triton.next_power_of_2(K))


def _bv(V: int) -> int:
    return min(BV, triton.next_power_of_2(V))


def _stages(x: torch.Tensor) -> int:
    """Pipeline stages of the readout's chunk loops: 32-bit tiles at 3 stages exceed an H100's shared memory."""
    return 3 if x.element_size() == 2 else 1


def prologue(q: torch.Tensor, k: torch.Tensor, u: torch.Tensor, feature_key: bool = False):
    """k̂, û in the state dtype (fp32; fp64 for fp64 inputs) and φ(q), k̂ in the activations' dtype.

    Args:
        q, k, u: [B, T, H, K]; feature_key: k̂ = φ(k)/‖φ(k)‖ instead of k/‖k‖.
    Returns:
        kh32, uh32, fq, kh, each [B, T, H, K].
    """
    return PrologueFunction.apply(q, k, u, feature_key)


def readout(o_s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, n0: torch.Tensor, eps: float,
            cu_seqlens: Offsets | None = None):
    """o_t = o_s[t] / max(φ(q_t)·n_t, eps), n_t = n_0 + Σ_{s≤t} φ(k_s) (from the token's own sequence's start with
    ``cu_seqlens``).

    Args:
        o_s: [B, T, H, V] (S's output); q, k: [B, T, H, K]; n0: [N, H, K] in the state dtype (N = B, or the number
            of packed sequences); cu_seqlens: checked ``Offsets`` of packed sequences (B = 1).
    Returns:
        o [B, T, H, V] in o_s's dtype, n_T [N, H, K] (an empty sequence's is its n0).
    """
    return ReadoutFunction.apply(o_s, q, k, n0, eps, cu_seqlens)
