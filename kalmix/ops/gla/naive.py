"""Gated linear attention, token by token: the semantic reference and the decoding step."""
from __future__ import annotations

import torch


def gla_step(q, k, v, g, S, *, scale: float):
    """One token: S = diag(exp(g)) S + k vᵀ, o = scale · Sᵀq.

    Args:
        q, k: [B, H, K]; v: [B, H, V]; g: [B, H, 1] (one log decay per head) or [B, H, K] (per key channel);
        S: [B, H, K, V].
    Returns:
        o [B, H, V], S [B, H, K, V].
    """
    S = g.exp()[..., None] * S + k[..., :, None] * v[..., None, :]
    return scale * torch.einsum("bhk,bhkv->bhv", q, S), S


def gla_naive(q, k, v, g, *, state, scale):
    """q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, 1 or K]; state (S [B, H, K, V],) -> ((o,), (S,))."""
    S, = state
    os = []
    for t in range(q.shape[1]):
        o, S = gla_step(q[:, t], k[:, t], v[:, t], g[:, t], S, scale=scale)
        os.append(o)
    return (torch.stack(os, dim=1),), (S,)
