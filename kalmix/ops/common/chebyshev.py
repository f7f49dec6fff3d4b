"""Chebyshev iteration for (H + ridge·‖H‖_F I) x = b (Gated KalmaNet, paper Alg. 1 with ω₀ = 2; see
ops/gka/README.md)."""
from __future__ import annotations

from typing import Callable

import torch


def chebyshev_solve(matvec: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, hnorm: torch.Tensor,
                    ridge: float, num_iters: int) -> torch.Tensor:
    """``num_iters`` Chebyshev steps on the spectrum bounds μ = λ, L = ‖H‖_F + λ (λ = ridge·‖H‖_F), from
    ξ₀ = 2b/(L + μ).

    With λ proportional to ‖H‖_F the ratio ρ = (L − μ)/(L + μ) = 1/(1 + 2·ridge) is a constant, so the weights
    ω_i are plain numbers and only the step c = 2/(L + μ) varies per system.

    Args:
        matvec: x [..., K] -> H x [..., K] (H symmetric positive semi-definite).
        b: [..., K] right-hand sides; hnorm: [...] ‖H‖_F per system (>= 0).
    Returns:
        ξ [..., K] (0 where H = 0: no data to solve with), with ‖ξ − x*‖_A ≤ 2 r^n ‖x*‖_A,
        r = (√κ − 1)/(√κ + 1), κ = (1 + ridge)/ridge.
    """
    rho2 = (1.0 / (1.0 + 2.0 * ridge)) ** 2
    some = hnorm > 0                                          # 2/(L + μ), and 0 where H = 0 (x stays 0)
    c = torch.where(some, 2.0 / ((1.0 + 2.0 * ridge) * torch.where(some, hnorm, 1.0)), 0.0)[..., None]
    x_prev, x = torch.zeros_like(b), c * b
    omega = 2.0
    for _ in range(num_iters):
        omega = 4.0 / (4.0 - rho2 * omega)
        # ξ ← ξ − cω((H + λI)ξ − b) + (ω − 1)(ξ − ξ_prev); cωλ = 2ω·ridge/(1 + 2·ridge) is a number
        keep = omega * (1.0 - 2.0 * ridge / (1.0 + 2.0 * ridge))
        x_prev, x = x, torch.add(keep * x, x_prev, alpha=1.0 - omega) - (omega * c) * (matvec(x) - b)
    return x
