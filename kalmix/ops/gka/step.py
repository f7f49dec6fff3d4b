"""Gated KalmaNet's decoding step as one Triton kernel: state update, Chebyshev solve and readout per (b, h).

The token loop's step (``naive.gka_step``) launches about five small kernels per Chebyshev iteration, 150 at
the default 30: a decode step is then launch-bound however small the work. Here one program per (sequence,
head) holds H [K, K] and U [K, V] in registers, updates them, runs the iterations on H and reads out, in one
launch; the arithmetic is the reference's, in the state's dtype (fp32, or fp64 for fp64 states).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _gka_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, a_ptr, h_ptr, u_ptr, coef_ptr, o_ptr, h_out_ptr, u_out_ptr,
                     K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     N_ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)                                  # b · H + h
    rk, rv = tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    h0 = tl.load(h_ptr + pid * K * K + rk[:, None] * K + rk[None, :], mask=mk[:, None] & mk[None, :], other=0.0)
    u0 = tl.load(u_ptr + pid * K * V + rk[:, None] * V + rv[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
    dt = h0.dtype
    q = tl.load(q_ptr + pid * K + rk, mask=mk, other=0.0).to(dt)           # [BK]
    k = tl.load(k_ptr + pid * K + rk, mask=mk, other=0.0).to(dt)
    v = tl.load(v_ptr + pid * V + rv, mask=mv, other=0.0).to(dt)           # [BV]
    gamma = tl.exp(tl.load(g_ptr + pid).to(dt))
    beta = tl.load(b_ptr + pid).to(dt)
    alpha = tl.load(a_ptr + pid).to(dt)
    hs = gamma * h0 + beta * k[:, None] * k[None, :]                       # [BK, BK]
    us = gamma * u0 + beta * k[:, None] * v[None, :]                       # [BK, BV]
    tl.store(h_out_ptr + pid * K * K + rk[:, None] * K + rk[None, :], hs, mask=mk[:, None] & mk[None, :])
    tl.store(u_out_ptr + pid * K * V + rk[:, None] * V + rv[None, :], us, mask=mk[:, None] & mv[None, :])
    # coef = [scale, 1 + 2·ridge, ω_1..ω_n, keep_1..keep_n]: the reference's Python scalars, in the state's dtype
    qt = q
    if N_ITERS > 0:
        hnorm = tl.sqrt(tl.sum(tl.sum(hs * hs, axis=1), axis=0))
        c = tl.where(hnorm > 0, 2.0 / (tl.load(coef_ptr + 1) * hnorm), 0.0)   # 2/(L + μ); x = 0 where H = 0
        x_prev = tl.zeros([BK], dtype=dt)
        x = c * q
        for i in tl.static_range(N_ITERS):
            omega = tl.load(coef_ptr + 2 + i)
            keep = tl.load(coef_ptr + 2 + N_ITERS + i)
            hx = tl.sum(hs * x[None, :], axis=1)                           # H ξ (H symmetric)
            x_new = keep * x + (1.0 - omega) * x_prev - (omega * c) * (hx - q)
            x_prev = x
            x = x_new
        qt = q + alpha * (x - q)                                           # α-connection
    o = tl.load(coef_ptr) * tl.sum(us * qt[:, None], axis=0)                           # [BV]
    tl.store(o_ptr + pid * V + rv, o.to(o_ptr.dtype.element_ty), mask=mv)


@functools.lru_cache(maxsize=64)
def _coefficients(scale: float, ridge: float, num_iters: int, dtype, device) -> torch.Tensor:
    """[scale, 1 + 2·ridge, ω_1..ω_n, keep_1..keep_n] of ``chebyshev_solve``, computed as it computes them; kept
    per configuration (read only), so a step copies nothing from the host (and can be captured in a graph)."""
    rho2 = (1.0 / (1.0 + 2.0 * ridge)) ** 2
    omegas, keeps, omega = [], [], 2.0
    for _ in range(num_iters):
        omega = 4.0 / (4.0 - rho2 * omega)
        omegas.append(omega)
        keeps.append(omega * (1.0 - 2.0 * ridge / (1.0 + 2.0 * ridge)))
    return torch.tensor([scale, 1.0 + 2.0 * ridge, *omegas, *keeps], dtype=dtype, device=device)


def gka_step_fused(q, k, v, g, beta, alpha, h0, u0, *, scale: float, ridge: float, num_iters: int):
    """One token of every sequence.

    Args:
        q, k: [B, H, K] (K <= 128); v: [B, H, V]; g, beta, alpha: [B, H]; h0 [B, H, K, K], u0 [B, H, K, V]
        in the compute dtype (fp32, or fp64).
    Returns:
        o [B, H, V] in v's dtype, H [B, H, K, K], U [B, H, K, V] (new tensors).
    """
    B, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta, alpha = (x.contiguous() for x in (q, k, v, g, beta, alpha))
    h0, u0 = h0.contiguous(), u0.contiguous()
    o = torch.empty(B, H, V, dtype=v.dtype, device=v.device)
    h1, u1 = torch.empty_like(h0), torch.empty_like(u0)
    coef = _coefficients(float(scale), float(ridge), int(num_iters), h0.dtype, h0.device)
    BK, BV = triton.next_power_of_2(K), triton.next_power_of_2(V)
    _gka_step_kernel[(B * H,)](q, k, v, g, beta, alpha, h0, u0, coef, o, h1, u1, K=K, V=V, BK=BK, BV=BV,
                               N_ITERS=num_iters, num_warps=16 if BK * max(BK, BV) >= 128 * 128 else 4)
    return o, h1, u1
