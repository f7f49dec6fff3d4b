"""Chebyshev iteration for (H + λI) x = b (Gated KalmaNet, paper Alg. 1 with ω₀ = 2, see ops/gka/README.md)."""
from __future__ import annotations

from typing import Callable

import torch


def chebyshev_solve(matvec: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, lam: torch.Tensor,
                    hnorm: torch.Tensor, num_iters: int) -> torch.Tensor:
    """``num_iters`` Chebyshev steps on the spectrum bounds μ = λ, L = ‖H‖_F + λ, from ξ₀ = 2b/(L + μ).

    Args:
        matvec: x [..., K] -> H x [..., K] (H symmetric positive semi-definite).
        b: [..., K] right-hand sides; lam, hnorm: [...] ridge λ and ‖H‖_F per system.
    Returns:
        ξ [..., K], with ‖ξ − x*‖ ≤ 2 r^n ‖x*‖ in the A-norm sense, r = (√κ − 1)/(√κ + 1), κ = L/μ.
    """
    lo, hi = lam, hnorm + lam
    rho2 = ((hi - lo) / (hi + lo))[..., None] ** 2
    c = (2.0 / (hi + lo))[..., None]
    lam = lam[..., None]
    x_prev, x = torch.zeros_like(b), c * b
    omega = torch.full_like(rho2, 2.0)
    for _ in range(num_iters):
        omega = 4.0 / (4.0 - rho2 * omega)
        # ξ ← ξ − cω((H + λI)ξ − b) + (ω − 1)(ξ − ξ_prev), per-token coefficients folded first
        step = c * omega
        x_prev, x = x, (omega - step * lam) * x - step * (matvec(x) - b) - (omega - 1.0) * x_prev
    return x
