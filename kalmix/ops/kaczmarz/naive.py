"""Kaczmarz linear attention, token by token: the semantic reference (DESIGN §1.3)."""
from __future__ import annotations

import torch


def kaczmarz_coefficient(k: torch.Tensor, eta: torch.Tensor, eps: float) -> torch.Tensor:
    """The Kaczmarz projection coefficient β = η / (‖k‖² + eps) for k [..., K], eta [...]; 0 where ‖k‖² + eps = 0
    (a zero key with eps = 0 writes nothing, as the Triton kernels do), with finite gradients there."""
    den = (k * k).sum(-1) + eps
    some = den > 0
    return torch.where(some, eta / torch.where(some, den, torch.ones_like(den)), torch.zeros_like(eta))


def kaczmarz_step(q, k, v, g, eta, S, *, eps: float, scale: float):
    """One token; also the decoding step.

    Args:
        q, k: [B, H, K]; v: [B, H, V]; g (log decay), eta: [B, H]; S: [B, H, K, V].
    Returns:
        o [B, H, V], S [B, H, K, V].
    """
    S = g.exp()[..., None, None] * S
    step = kaczmarz_coefficient(k, eta, eps)
    err = v - torch.einsum("bhk,bhkv->bhv", k, S)
    S = S + step[..., None, None] * k[..., :, None] * err[..., None, :]
    o = scale * torch.einsum("bhk,bhkv->bhv", q, S)
    return o, S


def kaczmarz_naive(q, k, v, g, eta, *, state, eps, scale):
    S, = state
    os = []
    for t in range(q.shape[1]):
        o, S = kaczmarz_step(q[:, t], k[:, t], v[:, t], g[:, t], eta[:, t], S, eps=eps, scale=scale)
        os.append(o)
    return (torch.stack(os, dim=1),), (S,)
