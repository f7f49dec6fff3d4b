"""VLA's work around the A and S paths as Triton kernels (impl="triton"), one autograd function and one kernel
per direction each:

- ``prologue``: q, k, u → the A path's unit rows k̂, û in fp32 and the S path's φ(q), k̂ in the activations'
  dtype (φ = elu + 1, k̂ = k / max(‖k‖, 1e-12) as ``F.normalize``); its backward sums the two paths' gradients
  of k̂ and takes all three through the normalisation and φ.
- ``readout``: o_t = (S's output)_t / max(φ(q_t)·n_t, eps) with n_t = n_0 + Σ_{s≤t} φ(k_s), by chunks of C
  tokens (n carried across chunks, Σ inside a chunk as a masked product), and the final n.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kalmix.ops.common.checks import compute_dtype
from kalmix.ops.common.delta_triton import _DT, _dot, _load_rows, _load_tokens, _store_rows, _store_tokens

ROWS = 16       # token rows (of one head) per program of the prologue kernels
C = 64          # tokens per chunk of the readout kernels
BV_FWD = 32     # columns of S's output per program of the readout's forward (more programs: it is sequential)


@triton.jit
def _phi(x):
    """elu(x) + 1."""
    return tl.where(x > 0, x + 1., tl.exp(x))


@triton.jit
def _dphi(x):
    return tl.where(x > 0, 1., tl.exp(x))


@triton.jit
def _unit(x):
    """x / max(‖x‖, 1e-12) per row, and the divisor."""
    nrm = tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-12)[:, None]
    return x / nrm, nrm


@triton.jit
def _unit_back(x, g):
    """The gradient of x from that of x / max(‖x‖, 1e-12) (the divisor is a constant below 1e-12)."""
    xh, nrm = _unit(x)
    return tl.where(nrm > 1e-12, g - xh * tl.sum(xh * g, axis=1)[:, None], g) / nrm


@triton.jit
def _prologue_fwd_kernel(q_ptr, k_ptr, u_ptr, kh32_ptr, uh32_ptr, fq_ptr, kh_ptr, n_rows, K, ROWS: tl.constexpr,
                         BK: tl.constexpr):
    """ROWS rows of the [rows, K] views of the tensors per program (rows as tokens of one head: H = 1)."""
    r0 = tl.program_id(0) * ROWS
    L = n_rows - r0
    k, _ = _unit(_load_rows(k_ptr, r0, L, 0, 1, K, 0, BK, ROWS))
    u, _ = _unit(_load_rows(u_ptr, r0, L, 0, 1, K, 0, BK, ROWS))
    _store_rows(kh32_ptr, k, r0, L, 0, 1, K, 0, BK, ROWS)
    _store_rows(kh_ptr, k, r0, L, 0, 1, K, 0, BK, ROWS)
    _store_rows(uh32_ptr, u, r0, L, 0, 1, K, 0, BK, ROWS)
    _store_rows(fq_ptr, _phi(_load_rows(q_ptr, r0, L, 0, 1, K, 0, BK, ROWS)), r0, L, 0, 1, K, 0, BK, ROWS)


@triton.jit
def _prologue_bwd_kernel(q_ptr, k_ptr, u_ptr, dkh32_ptr, duh32_ptr, dfq_ptr, dkh_ptr, dq_ptr, dk_ptr, du_ptr, n_rows,
                         K, HAS_DKH32: tl.constexpr, HAS_DUH32: tl.constexpr, HAS_DFQ: tl.constexpr,
                         HAS_DKH: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr):
    r0 = tl.program_id(0) * ROWS
    L = n_rows - r0
    q = _load_rows(q_ptr, r0, L, 0, 1, K, 0, BK, ROWS)
    dq = tl.zeros_like(q)
    if HAS_DFQ:
        dq = _load_rows(dfq_ptr, r0, L, 0, 1, K, 0, BK, ROWS) * _dphi(q)
    _store_rows(dq_ptr, dq, r0, L, 0, 1, K, 0, BK, ROWS)
    g = tl.zeros_like(q)
    if HAS_DKH32:
        g += _load_rows(dkh32_ptr, r0, L, 0, 1, K, 0, BK, ROWS)
    if HAS_DKH:
        g += _load_rows(dkh_ptr, r0, L, 0, 1, K, 0, BK, ROWS)
    _store_rows(dk_ptr, _unit_back(_load_rows(k_ptr, r0, L, 0, 1, K, 0, BK, ROWS), g), r0, L, 0, 1, K, 0, BK, ROWS)
    g = tl.zeros_like(q)
    if HAS_DUH32:
        g = _load_rows(duh32_ptr, r0, L, 0, 1, K, 0, BK, ROWS)
    _store_rows(du_ptr, _unit_back(_load_rows(u_ptr, r0, L, 0, 1, K, 0, BK, ROWS), g), r0, L, 0, 1, K, 0, BK, ROWS)


@triton.jit
def _phi_rows(ptr, t0, L, i_h, H, K, BK: tl.constexpr, C: tl.constexpr):
    """(x, φ(x)) for rows t0..t0+C of head i_h of a [tokens, H, K] tensor, φ zero outside the rows and columns."""
    x = _load_rows(ptr, t0, L, i_h, H, K, 0, BK, C)
    valid = (tl.arange(0, C)[:, None] < L) & (tl.arange(0, BK)[None, :] < K)
    return x, tl.where(valid, _phi(x), 0.)


@triton.jit
def _readout_fwd_kernel(os_ptr, q_ptr, k_ptr, n0_ptr, o_ptr, den_ptr, nT_ptr, T, H, K, V, eps, C: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr):
    """One (V block, sequence, head) per program, over the chunks in order; V block 0 also writes the
    normaliser per token (for the backward) and the final n."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    rows, cols = tl.arange(0, C)[:, None], tl.arange(0, C)[None, :]
    o_k = tl.arange(0, BK)
    n = tl.load(n0_ptr + i_bh * K + o_k, mask=o_k < K, other=0.).to(DT)
    for j in range(0, tl.cdiv(T, C)):
        t0, L = i_b * T + j * C, tl.minimum(C, T - j * C)
        _, fq = _phi_rows(q_ptr, t0, L, i_h, H, K, BK, C)
        _, fk = _phi_rows(k_ptr, t0, L, i_h, H, K, BK, C)
        den = tl.sum(fq * n[None, :], axis=1) + tl.sum(tl.where(cols <= rows, _dot(fq, tl.trans(fk), DT), 0.), axis=1)
        o = _load_rows(os_ptr, t0, L, i_h, H, V, i_v * BV, BV, C) / tl.maximum(den, eps)[:, None]
        _store_rows(o_ptr, o, t0, L, i_h, H, V, i_v * BV, BV, C)
        if i_v == 0:
            _store_tokens(den_ptr, den, t0, L, i_h, H, C)
        n += tl.sum(fk, axis=0)
    if i_v == 0:
        tl.store(nT_ptr + i_bh * K + o_k, n, mask=o_k < K)


@triton.jit
def _readout_bwd_kernel(do_ptr, os_ptr, q_ptr, k_ptr, n0_ptr, den_ptr, dnT_ptr, dos_ptr, dq_ptr, dk_ptr, dn0_ptr,
                        dden_ptr, T, H, K, V, eps, HAS_DNT: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, DT: tl.constexpr):
    """One (sequence, head) per program: forwards over the chunks for ∂den, ∂(S's output) and ∂q (which needs n_t),
    then backwards for ∂k (which needs Σ_{t≥s} ∂den_t φ(q_t)) and ∂n_0."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    rows, cols = tl.arange(0, C)[:, None], tl.arange(0, C)[None, :]
    o_k = tl.arange(0, BK)
    n = tl.load(n0_ptr + i_bh * K + o_k, mask=o_k < K, other=0.).to(DT)
    NC = tl.cdiv(T, C)
    for j in range(0, NC):
        t0, L = i_b * T + j * C, tl.minimum(C, T - j * C)
        den = _load_tokens(den_ptr, t0, L, i_h, H, 1., C)
        inv = 1. / tl.maximum(den, eps)
        dd = tl.zeros([C], DT)
        for v0 in range(0, V, BV):
            do = _load_rows(do_ptr, t0, L, i_h, H, V, v0, BV, C)
            dd += tl.sum(do * _load_rows(os_ptr, t0, L, i_h, H, V, v0, BV, C), axis=1)
            _store_rows(dos_ptr, do * inv[:, None], t0, L, i_h, H, V, v0, BV, C)
        dd = tl.where(den > eps, -dd * inv * inv, 0.)
        _store_tokens(dden_ptr, dd, t0, L, i_h, H, C)
        q, fq = _phi_rows(q_ptr, t0, L, i_h, H, K, BK, C)
        _, fk = _phi_rows(k_ptr, t0, L, i_h, H, K, BK, C)
        n_t = n[None, :] + _dot(tl.where(cols <= rows, 1., 0.).to(DT), fk, DT)          # n after each token
        _store_rows(dq_ptr, dd[:, None] * n_t * _dphi(q), t0, L, i_h, H, K, 0, BK, C)
        n += tl.sum(fk, axis=0)
    if HAS_DNT:
        G = tl.load(dnT_ptr + i_bh * K + o_k, mask=o_k < K, other=0.).to(DT)
    else:
        G = tl.zeros([BK], DT)
    for jj in range(0, NC):
        j = NC - 1 - jj
        t0, L = i_b * T + j * C, tl.minimum(C, T - j * C)
        dd = _load_tokens(dden_ptr, t0, L, i_h, H, 0., C)
        _, fq = _phi_rows(q_ptr, t0, L, i_h, H, K, BK, C)
        k = _load_rows(k_ptr, t0, L, i_h, H, K, 0, BK, C)
        dfk = G[None, :] + _dot(tl.where(cols >= rows, dd[None, :], 0.), fq, DT)  # Σ_{t≥s} ∂den_t φ(q_t)
        _store_rows(dk_ptr, dfk * _dphi(k), t0, L, i_h, H, K, 0, BK, C)
        G += tl.sum(dd[:, None] * fq, axis=0)
    tl.store(dn0_ptr + i_bh * K + o_k, G, mask=o_k < K)


class PrologueFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, u):
        q, k, u = (x.contiguous() for x in (q, k, u))
        K, n_rows = q.shape[-1], q.numel() // q.shape[-1]
        kh32, uh32 = (torch.empty(q.shape, dtype=compute_dtype(q), device=q.device) for _ in range(2))
        fq, kh = torch.empty_like(q), torch.empty_like(k)
        _prologue_fwd_kernel[(triton.cdiv(n_rows, ROWS),)](q, k, u, kh32, uh32, fq, kh, n_rows, K, ROWS=ROWS,
                                                            BK=triton.next_power_of_2(K))
        ctx.save_for_backward(q, k, u)
        ctx.set_materialize_grads(False)
        return kh32, uh32, fq, kh

    @staticmethod
    def backward(ctx, dkh32, duh32, dfq, dkh):
        q, k, u = ctx.saved_tensors
        K, n_rows = q.shape[-1], q.numel() // q.shape[-1]
        dq, dk, du = torch.empty_like(q), torch.empty_like(k), torch.empty_like(u)
        grads = [None if g is None else g.contiguous() for g in (dkh32, duh32, dfq, dkh)]
        _prologue_bwd_kernel[(triton.cdiv(n_rows, ROWS),)](
            q, k, u, *[q if g is None else g for g in grads], dq, dk, du, n_rows, K,
            *[g is not None for g in grads], ROWS=ROWS, BK=triton.next_power_of_2(K))
        return dq, dk, du


class ReadoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o_s, q, k, n0, eps: float):
        o_s, q, k, n0 = (x.contiguous() for x in (o_s, q, k, n0))
        B, T, H, K = q.shape
        V = o_s.shape[-1]
        BV = min(BV_FWD, triton.next_power_of_2(V))
        o = torch.empty_like(o_s)
        den = torch.empty(B, T, H, dtype=n0.dtype, device=q.device)
        nT = torch.empty_like(n0)
        _readout_fwd_kernel[(triton.cdiv(V, BV), B * H)](o_s, q, k, n0, o, den, nT, T, H, K, V, eps, C=C,
                                                         BK=_bk(K), BV=BV, DT=_DT[n0.dtype], num_stages=_stages(q))
        ctx.save_for_backward(o_s, q, k, n0, den)
        ctx.eps = eps
        ctx.set_materialize_grads(False)
        return o, nT

    @staticmethod
    def backward(ctx, do, dnT):
        o_s, q, k, n0, den = ctx.saved_tensors
        B, T, H, K = q.shape
        V = o_s.shape[-1]
        do = torch.zeros_like(o_s) if do is None else do.contiguous()
        dos, dq, dk, dn0 = torch.empty_like(o_s), torch.empty_like(q), torch.empty_like(k), torch.empty_like(n0)
        dden = torch.empty_like(den)
        _readout_bwd_kernel[(B * H,)](do, o_s, q, k, n0, den, n0 if dnT is None else dnT.contiguous(), dos, dq, dk, dn0,
                                      dden, T, H, K, V, ctx.eps, HAS_DNT=dnT is not None, C=C, BK=_bk(K),
                                      BV=min(64, triton.next_power_of_2(V)), DT=_DT[n0.dtype], num_stages=_stages(q))
        return dos, dq, dk, dn0, None


def _bk(K: int) -> int:
    return max(16, triton.next_power_of_2(K))


def _stages(x: torch.Tensor) -> int:
    """Pipeline stages of the readout's chunk loops: 32-bit tiles at 3 stages exceed an H100's shared memory."""
    return 3 if x.element_size() == 2 else 1


def prologue(q: torch.Tensor, k: torch.Tensor, u: torch.Tensor):
    """k̂, û in the state dtype (fp32; fp64 for fp64 inputs) and φ(q), k̂ in the activations' dtype.

    Args:
        q, k, u: [B, T, H, K].
    Returns:
        kh32, uh32, fq, kh, each [B, T, H, K].
    """
    return PrologueFunction.apply(q, k, u)


def readout(o_s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, n0: torch.Tensor, eps: float):
    """o_t = o_s[t] / max(φ(q_t)·n_t, eps), n_t = n_0 + Σ_{s≤t} φ(k_s).

    Args:
        o_s: [B, T, H, V] (S's output); q, k: [B, T, H, K]; n0: [B, H, K] in the state dtype.
    Returns:
        o [B, T, H, V] in o_s's dtype, n_T [B, H, K].
    """
    return ReadoutFunction.apply(o_s, q, k, n0, eps)
