"""Kaczmarz attention's decoding step as one Triton kernel (the token loop's step launches about a dozen).

Per (sequence, head, block of value columns): S̄ = γS, β = η / (‖k‖² + eps), S = S̄ + β k (v − S̄ᵀk)ᵀ,
o = scale · Sᵀq, in the state's dtype (fp32, or fp64 for fp64 states), as ``naive.kaczmarz_step`` computes it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kaczmarz_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, eta_ptr, s_ptr, coef_ptr, o_ptr, s_out_ptr,
                          K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)                                  # b · H + h
    cv = tl.program_id(1)
    rk, rv = tl.arange(0, BK), cv * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    m2 = mk[:, None] & mv[None, :]
    s = tl.load(s_ptr + pid * K * V + rk[:, None] * V + rv[None, :], mask=m2, other=0.0)     # [BK, BV]
    dt = s.dtype
    q = tl.load(q_ptr + pid * K + rk, mask=mk, other=0.0).to(dt)
    k = tl.load(k_ptr + pid * K + rk, mask=mk, other=0.0).to(dt)
    v = tl.load(v_ptr + pid * V + rv, mask=mv, other=0.0).to(dt)
    s = tl.exp(tl.load(g_ptr + pid).to(dt)) * s
    # coef = [eps, scale] in the state's dtype
    den = tl.sum(k * k, axis=0) + tl.load(coef_ptr)
    beta = tl.where(den > 0, tl.load(eta_ptr + pid).to(dt) / den, 0.0)  # a zero key with eps = 0 writes nothing
    err = v - tl.sum(k[:, None] * s, axis=0)                             # [BV]
    s = s + beta * k[:, None] * err[None, :]
    o = tl.load(coef_ptr + 1) * tl.sum(q[:, None] * s, axis=0)
    tl.store(s_out_ptr + pid * K * V + rk[:, None] * V + rv[None, :], s, mask=m2)
    tl.store(o_ptr + pid * V + rv, o.to(o_ptr.dtype.element_ty), mask=mv)


_COEF: dict = {}


def kaczmarz_step_fused(q, k, v, g, eta, S, *, eps: float, scale: float):
    """One token of every sequence: q, k [B, H, K], v [B, H, V], g, eta [B, H], S [B, H, K, V] in the compute
    dtype -> (o [B, H, V] in v's dtype, new S)."""
    B, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, eta, S = (x.contiguous() for x in (q, k, v, g, eta, S))
    key = (float(eps), float(scale), S.dtype, S.device)
    if key not in _COEF:                       # kept per configuration: a step copies nothing from the host
        _COEF[key] = torch.tensor([eps, scale], dtype=S.dtype, device=S.device)
    o = torch.empty(B, H, V, dtype=v.dtype, device=v.device)
    S1 = torch.empty_like(S)
    BK, BV = triton.next_power_of_2(K), min(32, triton.next_power_of_2(V))
    _kaczmarz_step_kernel[(B * H, triton.cdiv(V, BV))](q, k, v, g, eta, S, _COEF[key], o, S1, K=K, V=V, BK=BK,
                                                        BV=BV, num_warps=4)
    return o, S1
