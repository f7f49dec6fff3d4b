"""Kalman linear attention, token by token: the semantic reference (DESIGN §1.1)."""
from __future__ import annotations

import torch


def kalman_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, decay: torch.Tensor,
                process_noise: torch.Tensor, lam: torch.Tensor, mu: torch.Tensor, output_variance: bool = False):
    """One predict + update step of every scalar filter; also the decoding step.

    Args:
        q, k: [B, H, N]; v, w (value precision): [B, H, D]; decay, process_noise: [H, N, D];
        lam, mu: [B, H, N, D] posterior precision and mean after the previous token.
    Returns:
        o [B, H, D], variance [B, H, D] or None, lam [B, H, N, D], mu [B, H, N, D].
    """
    phi = k[..., None] ** 2 * w[:, :, None, :]              # observation precision per lane
    r = k[..., None] * (w * v)[:, :, None, :]               # precision-weighted evidence
    prior = lam / (decay ** 2 + process_noise * lam)        # predict: precision after the OU step
    lam = prior + phi
    mu = (decay * prior * mu + r) / lam
    o = torch.einsum("bhn,bhnd->bhd", q, mu)
    var = torch.einsum("bhn,bhnd->bhd", q ** 2, 1.0 / lam) if output_variance else None
    return o, var, lam, mu


def kalman_naive(q, k, v, w, decay, process_noise, *, state, output_variance):
    """Token loop in the compute dtype of the inputs; ``state`` = (precision, mean) [B, H, N, D]."""
    lam, mu = state
    os, vs = [], []
    for t in range(q.shape[1]):
        o, var, lam, mu = kalman_step(q[:, t], k[:, t], v[:, t], w[:, t], decay, process_noise, lam, mu,
                                      output_variance)
        os.append(o)
        vs.append(var)
    o = torch.stack(os, dim=1)
    var = torch.stack(vs, dim=1) if output_variance else None
    return (o, var), (lam, mu)
