"""Kalman linear attention as fused Triton kernels: one program per (sequence, head, block of channels) runs the
filter of its [N, BD] lanes token by token in registers; only o (and the variance) reach HBM.

The kernels run the covariance form of the same filter (README.md, "Fused kernels"): per lane the state is the
posterior variance y = 1/λ and the mean μ, and a step costs one reciprocal,

    u = ā² y + p̄,   g = 1 / (1 + φ u),   y' = u g,   μ' = (ā μ + r u) g.

Every quantity is a sum or product of non-negative terms except ā μ + r u, whose rounding is that of the moment
form, so nothing cancels. The backward is the exact adjoint of this step run in reverse. It needs each step's
input state: the forward stores (y, μ) every C tokens (the checkpoints), and the backward recomputes the C
states of a chunk into registers, then walks them back. The first chunk of a sequence is the short one (its
first steps are masked off), so every later chunk is full and unrolled without masks.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# the interpreter runs programs one by one: small chunks keep its unrolled loops short
CHUNK = 4 if INTERPRET else 16                              # tokens between checkpoints (and unrolled steps)
FWD_CONFIG = (16, 1) if INTERPRET else (32, 1)              # (channels per program, warps)
BWD_CONFIG = (16, 1) if INTERPRET else (16, 1)


@triton.jit
def _all(mask, ok):
    """``mask & ok`` for a scalar ``ok`` (spelt as a select: the interpreter rejects the broadcast ``&``)."""
    return tl.where(ok, mask, False)


@triton.jit
def _load_token(q_ptr, k_ptr, v_ptr, w_ptr, tok, i_h, H, N, D, o_n, o_d, m_n, m_d, ok, ACC: tl.constexpr):
    """q, k as [1, BN, 1] and v, w as [1, 1, BD] at token ``tok`` (zeros where masked)."""
    qk = tok * H * N + i_h * N + o_n
    vw = tok * H * D + i_h * D + o_d
    q = tl.load(q_ptr + qk, mask=_all(m_n, ok), other=0.).to(ACC)
    k = tl.load(k_ptr + qk, mask=_all(m_n, ok), other=0.).to(ACC)
    v = tl.load(v_ptr + vw, mask=_all(m_d, ok), other=0.).to(ACC)
    w = tl.load(w_ptr + vw, mask=_all(m_d, ok), other=0.).to(ACC)
    return q, k, v, w


@triton.jit
def _filter_step(k, v, w, a, a2, p, y, mu):
    """One predict + update of every lane: returns φ, r, u, g and the new (y, μ)."""
    phi = k * k * w
    r = k * (w * v)
    u = a2 * y + p
    g = 1.0 / (1.0 + phi * u)
    return phi, r, u, g, u * g, (a * mu + r * u) * g


@triton.jit
def _fwd_chunk(q_ptr, k_ptr, v_ptr, w_ptr, o_ptr, var_ptr, bos, t0, L, i_h, H, N, D, o_n, o_d, m_n, m_d,
               a, a2, p, y, mu, C: tl.constexpr, MASKED: tl.constexpr, HAS_VAR: tl.constexpr,
               ACC: tl.constexpr):
    for i in tl.static_range(C):
        t = t0 + i
        ok = (t >= 0) & (t < L)
        tok = bos + tl.maximum(t, 0)
        q, k, v, w = _load_token(q_ptr, k_ptr, v_ptr, w_ptr, tok, i_h, H, N, D, o_n, o_d, m_n, m_d, ok, ACC)
        _, _, _, _, y_new, mu_new = _filter_step(k, v, w, a, a2, p, y, mu)
        if MASKED:
            y = tl.where(ok, y_new, y)
            mu = tl.where(ok, mu_new, mu)
        else:
            y, mu = y_new, mu_new
        out = tok * H * D + i_h * D + o_d
        tl.store(o_ptr + out, tl.sum(q * mu, axis=1, keep_dims=True), mask=_all(m_d, ok))
        if HAS_VAR:
            tl.store(var_ptr + out, tl.sum(q * q * y, axis=1, keep_dims=True), mask=_all(m_d, ok))
    return y, mu


@triton.jit
def _kalman_fwd_kernel(q_ptr, k_ptr, v_ptr, w_ptr, a_ptr, p_ptr, lam0_ptr, mu0_ptr, o_ptr, var_ptr,
                       lamT_ptr, muT_ptr, cky_ptr, ckmu_ptr, cu_ptr, chunk_ptr, H, N, D,
                       BN: tl.constexpr, BD: tl.constexpr, C: tl.constexpr, HAS_VAR: tl.constexpr,
                       SAVE: tl.constexpr, ACC: tl.constexpr):
    i_d, i_sh = tl.program_id(0), tl.program_id(1)
    i_s, i_h = i_sh // H, i_sh % H
    bos = tl.load(cu_ptr + i_s).to(tl.int64)
    L = tl.load(cu_ptr + i_s + 1).to(tl.int64) - bos
    o_n = tl.arange(0, BN)[None, :, None]
    o_d = (i_d * BD + tl.arange(0, BD))[None, None, :]
    m_n, m_d = o_n < N, o_d < D
    m_nd = m_n & m_d
    lane = i_h * N * D + o_n * D + o_d                      # [1, BN, BD] offsets in an [H, N, D] tensor
    a = tl.load(a_ptr + lane, mask=m_nd, other=1.).to(ACC)
    p = tl.load(p_ptr + lane, mask=m_nd, other=0.).to(ACC)
    a2 = a * a
    st = i_s * H * N * D + lane
    y = 1.0 / tl.load(lam0_ptr + st, mask=m_nd, other=1.).to(ACC)
    mu = tl.load(mu0_ptr + st, mask=m_nd, other=0.).to(ACC)
    n_chunks = tl.cdiv(L, C)
    shift = n_chunks * C - L                                # masked steps at the start of chunk 0
    c_base = tl.load(chunk_ptr + i_s).to(tl.int64)
    if SAVE:
        ck = c_base * H * N * D + lane
        tl.store(cky_ptr + ck, y, mask=_all(m_nd, n_chunks > 0))
        tl.store(ckmu_ptr + ck, mu, mask=_all(m_nd, n_chunks > 0))
    y, mu = _fwd_chunk(q_ptr, k_ptr, v_ptr, w_ptr, o_ptr, var_ptr, bos, -shift, L, i_h, H, N, D, o_n, o_d,
                       m_n, m_d, a, a2, p, y, mu, C, True, HAS_VAR, ACC)
    for c in range(1, n_chunks):
        if SAVE:
            ck = (c_base + c) * H * N * D + lane
            tl.store(cky_ptr + ck, y, mask=m_nd)
            tl.store(ckmu_ptr + ck, mu, mask=m_nd)
        y, mu = _fwd_chunk(q_ptr, k_ptr, v_ptr, w_ptr, o_ptr, var_ptr, bos, c * C - shift, L, i_h, H, N, D,
                           o_n, o_d, m_n, m_d, a, a2, p, y, mu, C, False, HAS_VAR, ACC)
    tl.store(lamT_ptr + st, 1.0 / y, mask=m_nd)
    tl.store(muT_ptr + st, mu, mask=m_nd)


@triton.jit
def _bwd_chunk(q_ptr, k_ptr, v_ptr, w_ptr, do_ptr, dvar_ptr, dq_ptr, dk_ptr, dv_ptr, dw_ptr, bos, t0, L, i_h,
               i_d, TT, H, N, D, o_n, o_d, m_n, m_d, a, a2, p, y, mu, Gy, Gmu, acc_u, acc_mu, acc_p, dlamT, last,
               BN: tl.constexpr, BD: tl.constexpr, C: tl.constexpr, MASKED: tl.constexpr,
               HAS_DVAR: tl.constexpr, ACC: tl.constexpr):
    """Adjoint of one chunk: (y, μ) is the state before it, (Gy, Gμ) the adjoint of the state after it (for
    the ``last`` chunk of the sequence, Gy is made from dλ_T once the final state is recomputed)."""
    ci = tl.arange(0, C)[:, None, None]
    ys = tl.zeros([C, BN, BD], ACC)
    mus = tl.zeros([C, BN, BD], ACC)
    for i in tl.static_range(C):                            # recompute the chunk's input states
        t = t0 + i
        ok = (t >= 0) & (t < L)
        ys = tl.where(ci == i, y, ys)
        mus = tl.where(ci == i, mu, mus)
        tok = bos + tl.maximum(t, 0)
        _, k, v, w = _load_token(q_ptr, k_ptr, v_ptr, w_ptr, tok, i_h, H, N, D, o_n, o_d, m_n, m_d, ok, ACC)
        _, _, _, _, y_new, mu_new = _filter_step(k, v, w, a, a2, p, y, mu)
        if MASKED:
            y = tl.where(ok, y_new, y)
            mu = tl.where(ok, mu_new, mu)
        else:
            y, mu = y_new, mu_new
    if last:                                                # y is now the final state: dλ_T -> dy_T
        Gy = -dlamT / (y * y)
    for j in tl.static_range(C):
        i = C - 1 - j
        t = t0 + i
        ok = (t >= 0) & (t < L)
        tok = bos + tl.maximum(t, 0)
        y_p = tl.sum(tl.where(ci == i, ys, 0.), axis=0, keep_dims=True)
        mu_p = tl.sum(tl.where(ci == i, mus, 0.), axis=0, keep_dims=True)
        q, k, v, w = _load_token(q_ptr, k_ptr, v_ptr, w_ptr, tok, i_h, H, N, D, o_n, o_d, m_n, m_d, ok, ACC)
        phi, r, u, g, y_t, mu_t = _filter_step(k, v, w, a, a2, p, y_p, mu_p)
        out = tok * H * D + i_h * D + o_d
        do = tl.load(do_ptr + out, mask=_all(m_d, ok), other=0.).to(ACC)
        Gmu_t = Gmu + q * do
        dq = tl.sum(do * mu_t, axis=2, keep_dims=True)
        if HAS_DVAR:
            dvar = tl.load(dvar_ptr + out, mask=_all(m_d, ok), other=0.).to(ACC)
            Gy_t = Gy + q * q * dvar
            dq += 2 * q * tl.sum(dvar * y_t, axis=2, keep_dims=True)
        else:
            Gy_t = Gy
        g_phi = -y_t * (Gy_t * y_t + Gmu_t * mu_t)          # ∂L/∂φ
        g_r = Gmu_t * y_t                                   # ∂L/∂r
        Gu = g * (Gy_t * g + Gmu_t * (r - mu_t * phi))      # ∂L/∂u
        g_mu_a = Gmu_t * g                                  # ∂L/∂(ā μ_{t-1})
        # φ = k² Λv and r = k Λv v
        dk = 2 * k * tl.sum(w * g_phi, axis=2, keep_dims=True) + tl.sum((w * v) * g_r, axis=2, keep_dims=True)
        kg_r = tl.sum(k * g_r, axis=1, keep_dims=True)
        dw = tl.sum(k * k * g_phi, axis=1, keep_dims=True) + v * kg_r
        part = (i_d * TT + tok) * H * N + i_h * N + o_n     # this block's share of Σ_d, summed on the host
        tl.store(dq_ptr + part, dq, mask=_all(m_n, ok))
        tl.store(dk_ptr + part, dk, mask=_all(m_n, ok))
        tl.store(dv_ptr + out, w * kg_r, mask=_all(m_d, ok))
        tl.store(dw_ptr + out, dw, mask=_all(m_d, ok))
        if MASKED:
            acc_u += tl.where(ok, Gu * y_p, 0.)
            acc_mu += tl.where(ok, g_mu_a * mu_p, 0.)
            acc_p += tl.where(ok, Gu, 0.)
            Gmu = tl.where(ok, a * g_mu_a, Gmu)
            Gy = tl.where(ok, a2 * Gu, Gy)
        else:
            acc_u += Gu * y_p
            acc_mu += g_mu_a * mu_p
            acc_p += Gu
            Gmu = a * g_mu_a
            Gy = a2 * Gu
    return Gy, Gmu, acc_u, acc_mu, acc_p


@triton.jit
def _kalman_bwd_kernel(q_ptr, k_ptr, v_ptr, w_ptr, a_ptr, p_ptr, lam0_ptr, cky_ptr, ckmu_ptr, do_ptr, dvar_ptr,
                       dlamT_ptr, dmuT_ptr, dq_ptr, dk_ptr, dv_ptr, dw_ptr, da_ptr, dp_ptr, dlam0_ptr, dmu0_ptr,
                       cu_ptr, chunk_ptr, TT, H, N, D, BN: tl.constexpr, BD: tl.constexpr, C: tl.constexpr,
                       HAS_DVAR: tl.constexpr, HAS_DFINAL: tl.constexpr, ACC: tl.constexpr):
    i_d, i_sh = tl.program_id(0), tl.program_id(1)
    i_s, i_h = i_sh // H, i_sh % H
    bos = tl.load(cu_ptr + i_s).to(tl.int64)
    L = tl.load(cu_ptr + i_s + 1).to(tl.int64) - bos
    o_n = tl.arange(0, BN)[None, :, None]
    o_d = (i_d * BD + tl.arange(0, BD))[None, None, :]
    m_n, m_d = o_n < N, o_d < D
    m_nd = m_n & m_d
    lane = i_h * N * D + o_n * D + o_d
    a = tl.load(a_ptr + lane, mask=m_nd, other=1.).to(ACC)
    p = tl.load(p_ptr + lane, mask=m_nd, other=0.).to(ACC)
    a2 = a * a
    st = i_s * H * N * D + lane
    Gy = tl.zeros([1, BN, BD], ACC)
    if HAS_DFINAL:
        Gmu = tl.load(dmuT_ptr + st, mask=m_nd, other=0.).to(ACC)
        dlamT = tl.load(dlamT_ptr + st, mask=m_nd, other=0.).to(ACC)
    else:
        Gmu = tl.zeros([1, BN, BD], ACC)
        dlamT = tl.zeros([1, BN, BD], ACC)
    acc_u = tl.zeros([1, BN, BD], ACC)
    acc_mu = tl.zeros([1, BN, BD], ACC)
    acc_p = tl.zeros([1, BN, BD], ACC)
    n_chunks = tl.cdiv(L, C)
    shift = n_chunks * C - L
    c_base = tl.load(chunk_ptr + i_s).to(tl.int64)
    if n_chunks > 1:
        ck = (c_base + n_chunks - 1) * H * N * D + lane     # the last chunk also turns dλ_T into dy_T
        y = tl.load(cky_ptr + ck, mask=m_nd, other=1.)
        mu = tl.load(ckmu_ptr + ck, mask=m_nd, other=0.)
        Gy, Gmu, acc_u, acc_mu, acc_p = _bwd_chunk(
            q_ptr, k_ptr, v_ptr, w_ptr, do_ptr, dvar_ptr, dq_ptr, dk_ptr, dv_ptr, dw_ptr, bos,
            (n_chunks - 1) * C - shift, L, i_h, i_d, TT, H, N, D, o_n, o_d, m_n, m_d, a, a2, p, y, mu, Gy, Gmu,
            acc_u, acc_mu, acc_p, dlamT, True, BN, BD, C, False, HAS_DVAR, ACC)
        for cc in range(2, n_chunks):
            c = n_chunks - cc
            ck = (c_base + c) * H * N * D + lane
            y = tl.load(cky_ptr + ck, mask=m_nd, other=1.)
            mu = tl.load(ckmu_ptr + ck, mask=m_nd, other=0.)
            Gy, Gmu, acc_u, acc_mu, acc_p = _bwd_chunk(
                q_ptr, k_ptr, v_ptr, w_ptr, do_ptr, dvar_ptr, dq_ptr, dk_ptr, dv_ptr, dw_ptr, bos, c * C - shift, L,
                i_h, i_d, TT, H, N, D, o_n, o_d, m_n, m_d, a, a2, p, y, mu, Gy, Gmu, acc_u, acc_mu, acc_p, dlamT,
                False, BN, BD, C, False, HAS_DVAR, ACC)
    lam0 = tl.load(lam0_ptr + st, mask=m_nd, other=1.).to(ACC)
    Gy, Gmu, acc_u, acc_mu, acc_p = _bwd_chunk(
        q_ptr, k_ptr, v_ptr, w_ptr, do_ptr, dvar_ptr, dq_ptr, dk_ptr, dv_ptr, dw_ptr, bos, -shift, L, i_h, i_d, TT,
        H, N, D, o_n, o_d, m_n, m_d, a, a2, p, 1.0 / lam0, tl.load(ckmu_ptr + c_base * H * N * D + lane,
                                                                   mask=_all(m_nd, n_chunks > 0), other=0.),
        Gy, Gmu, acc_u, acc_mu, acc_p, dlamT, n_chunks <= 1, BN, BD, C, True, HAS_DVAR, ACC)
    tl.store(da_ptr + st, 2 * a * acc_u + acc_mu, mask=m_nd)
    tl.store(dp_ptr + st, acc_p, mask=m_nd)
    tl.store(dlam0_ptr + st, -Gy / (lam0 * lam0), mask=m_nd)
    tl.store(dmu0_ptr + st, Gmu, mask=m_nd)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def _offsets(cu_seqlens: torch.Tensor | None, B: int, T: int, device: torch.device):
    """Sequence starts ``cu`` [S + 1], each sequence's first checkpoint [S] and the number of checkpoints."""
    if cu_seqlens is None:
        n = triton.cdiv(T, CHUNK)
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
        return cu, torch.arange(0, B * n, n, dtype=torch.int32, device=device), B * n
    n = (cu_seqlens[1:] - cu_seqlens[:-1] + CHUNK - 1) // CHUNK
    return cu_seqlens, (torch.cumsum(n, 0) - n).to(torch.int32), int(n.sum())


class KalmanFusedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, w, a, p, lam0, mu0, cu_seqlens, output_variance: bool):
        B, T, H, N = q.shape
        D = v.shape[-1]
        q, k, v, w, a, p, lam0, mu0 = (x.contiguous() for x in (q, k, v, w, a, p, lam0, mu0))
        cu, chunk_off, n_ck = _offsets(cu_seqlens, B, T, q.device)
        n_seq = cu.numel() - 1
        save = any(ctx.needs_input_grad[:8])
        o = torch.empty_like(v)
        var = torch.empty_like(v) if output_variance else None
        lamT, muT = torch.empty_like(lam0), torch.empty_like(mu0)
        cky = torch.empty((n_ck, H, N, D), dtype=lam0.dtype, device=q.device) if save else None
        ckmu = torch.empty_like(cky) if save else None
        BD, warps = FWD_CONFIG
        _kalman_fwd_kernel[(triton.cdiv(D, BD), n_seq * H)](
            q, k, v, w, a, p, lam0, mu0, o, o if var is None else var, lamT, muT,
            lamT if cky is None else cky, muT if ckmu is None else ckmu, cu, chunk_off, H, N, D,
            BN=_pow2(N), BD=BD, C=CHUNK, HAS_VAR=output_variance, SAVE=save, ACC=_acc(q), num_warps=warps)
        if save:
            ctx.save_for_backward(q, k, v, w, a, p, lam0, cky, ckmu, cu, chunk_off)
        ctx.set_materialize_grads(False)
        return o, var, lamT, muT

    @staticmethod
    def backward(ctx, do, dvar, dlamT, dmuT):
        q, k, v, w, a, p, lam0, cky, ckmu, cu, chunk_off = ctx.saved_tensors
        B, T, H, N = q.shape
        D = v.shape[-1]
        n_seq = cu.numel() - 1
        do = torch.zeros_like(v) if do is None else do.contiguous()
        has_final = dlamT is not None or dmuT is not None
        if has_final:
            dlamT = torch.zeros_like(lam0) if dlamT is None else dlamT.contiguous()
            dmuT = torch.zeros_like(lam0) if dmuT is None else dmuT.contiguous()
        BD, warps = BWD_CONFIG
        n_db = triton.cdiv(D, BD)
        part = torch.empty((2, n_db, B * T, H, N), dtype=lam0.dtype, device=q.device)   # Σ_d per block
        dv, dw = torch.empty_like(v), torch.empty_like(w)
        dadp = torch.empty((2,) + lam0.shape, dtype=lam0.dtype, device=q.device)        # per sequence
        dlam0, dmu0 = torch.empty_like(lam0), torch.empty_like(lam0)
        _kalman_bwd_kernel[(n_db, n_seq * H)](
            q, k, v, w, a, p, lam0, cky, ckmu, do, do if dvar is None else dvar.contiguous(),
            dlamT if has_final else lam0, dmuT if has_final else lam0, part[0], part[1], dv, dw, dadp[0], dadp[1],
            dlam0, dmu0, cu, chunk_off, B * T, H, N, D, BN=_pow2(N), BD=BD, C=CHUNK, HAS_DVAR=dvar is not None,
            HAS_DFINAL=has_final, ACC=_acc(q), num_warps=warps)
        dq, dk = part.sum(1).view(2, B, T, H, N).to(q.dtype)
        da, dp = dadp.sum(1)
        return dq, dk, dv, dw, da.to(a.dtype), dp.to(p.dtype), dlam0, dmu0, None, None


def _acc(x: torch.Tensor):
    """The state dtype of the kernels: fp64 for fp64 inputs, else fp32."""
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def kalman_fused(q, k, v, w, decay, process_noise, *, state, output_variance, cu_seqlens=None):
    """Fused Triton filter (packed sequences handled in the kernels); ``state`` = (precision, mean) [S, H, N, D]
    in the state dtype (fp32, fp64 for fp64 inputs). Activations keep their dtype; the math is in fp32/fp64."""
    o, var, lam, mu = KalmanFusedFunction.apply(q, k, v, w, decay, process_noise, state[0], state[1], cu_seqlens,
                                                output_variance)
    return (o, var), (lam, mu)
