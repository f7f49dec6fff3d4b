"""Variational linear attention, token by token: the semantic reference (DESIGN §1.4)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ = elu + 1 (positive features for the normaliser)."""
    return F.elu(x) + 1.0


def vla_step(q, k, v, u, S, A, n, *, eps: float, feature_key: bool = False):
    """One token; also the decoding step.

    Args:
        q, k, u: [B, H, K]; v: [B, H, V]; S: [B, H, K, V]; A: [B, H, K, K] (symmetric); n: [B, H, K].
        feature_key: write along φ(k)/‖φ(k)‖ instead of k/‖k‖.
    Returns:
        o [B, H, V], S, A, n.
    """
    kh = F.normalize(feature_map(k) if feature_key else k, dim=-1)
    uh = F.normalize(u, dim=-1)
    z = (A @ uh[..., None])[..., 0]
    delta = 1.0 + (uh * z).sum(-1)
    A = A - z[..., :, None] * z[..., None, :] / delta[..., None, None]       # Sherman–Morrison
    alpha = F.normalize((A @ kh[..., None])[..., 0], dim=-1)
    err = v - torch.einsum("bhk,bhkv->bhv", kh, S)
    S = S + alpha[..., :, None] * err[..., None, :]
    n = n + feature_map(k)
    fq = feature_map(q)
    o = torch.einsum("bhk,bhkv->bhv", fq, S) / (fq * n).sum(-1).clamp_min(eps)[..., None]
    return o, S, A, n


def vla_naive(q, k, v, u, *, state, eps, feature_key=False):
    S, A, n = state
    os = []
    for t in range(q.shape[1]):
        o, S, A, n = vla_step(q[:, t], k[:, t], v[:, t], u[:, t], S, A, n, eps=eps, feature_key=feature_key)
        os.append(o)
    return (torch.stack(os, dim=1),), (S, A, n)
