"""Gated KalmaNet, token by token: the semantic reference (DESIGN §1.2)."""
from __future__ import annotations

import torch

from kalmix.ops.common.chebyshev import chebyshev_solve


def ridge_solve(Hs: torch.Tensor, q: torch.Tensor, ridge: float, num_iters: int | None) -> torch.Tensor:
    """x = (H + ridge·‖H‖_F I)^{-1} q for H [..., K, K], q [..., K]: exact (None) or Chebyshev; x = 0 where H = 0."""
    hnorm = torch.linalg.matrix_norm(Hs)
    if num_iters is None:
        eye = torch.eye(Hs.shape[-1], dtype=Hs.dtype, device=Hs.device)
        some = hnorm > 0
        x = torch.linalg.solve(Hs + torch.where(some, ridge * hnorm, 1.0)[..., None, None] * eye, q)
        return x * some[..., None]
    return chebyshev_solve(lambda x: (Hs @ x[..., None])[..., 0], q, hnorm, ridge, num_iters)


def gka_step(q, k, v, g, beta, alpha, Hs, Us, *, scale: float, ridge: float, num_iters: int | None):
    """One token; also the decoding step.

    Args:
        q, k: [B, H, K]; v: [B, H, V]; g, beta, alpha: [B, H]; Hs: [B, H, K, K]; Us: [B, H, K, V].
    Returns:
        o [B, H, V], Hs, Us.
    """
    gamma = g.exp()[..., None, None]
    b = beta[..., None, None]
    Hs = gamma * Hs + b * k[..., :, None] * k[..., None, :]
    Us = gamma * Us + b * k[..., :, None] * v[..., None, :]
    if num_iters == 0:
        qt = q                                                   # plain gated linear attention
    else:
        x = ridge_solve(Hs, q, ridge, num_iters)
        qt = q + alpha[..., None] * (x - q)                       # α-connection
    o = scale * torch.einsum("bhk,bhkv->bhv", qt, Us)
    return o, Hs, Us


def gka_naive(q, k, v, g, beta, alpha, *, state, scale, ridge, num_iters):
    Hs, Us = state
    os = []
    for t in range(q.shape[1]):
        o, Hs, Us = gka_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], alpha[:, t], Hs, Us, scale=scale,
                             ridge=ridge, num_iters=num_iters)
        os.append(o)
    return (torch.stack(os, dim=1),), (Hs, Us)
