"""The value-gated delta rule, token by token: the semantic reference and the decoding step."""
from __future__ import annotations

import torch


def value_delta_step(q, k, v, g, S, *, scale: float):
    """One token: e = v − Sᵀk (the error on the undecayed state), S = S diag(exp(g)) + k eᵀ, o = scale · Sᵀq.

    Args:
        q, k: [B, H, K]; v, g: [B, H, V] (g: log decay per value channel); S: [B, H, K, V].
    Returns:
        o [B, H, V], S [B, H, K, V].
    """
    err = v - torch.einsum("bhk,bhkv->bhv", k, S)
    S = S * g.exp()[..., None, :] + k[..., :, None] * err[..., None, :]
    return scale * torch.einsum("bhk,bhkv->bhv", q, S), S


def value_delta_naive(q, k, v, g, *, state, scale):
    """q, k [B, T, H, K]; v, g [B, T, H, V]; state (S [B, H, K, V],) -> ((o,), (S,))."""
    S, = state
    os = []
    for t in range(q.shape[1]):
        o, S = value_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], S, scale=scale)
        os.append(o)
    return (torch.stack(os, dim=1),), (S,)
