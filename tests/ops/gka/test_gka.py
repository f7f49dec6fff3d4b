"""Gated KalmaNet against an explicit per-token ridge solve, and the Chebyshev error bound."""
import math

import pytest
import torch

from kalmix import ops
from kalmix.ops import SPECS
from kalmix.ops.common.chebyshev import chebyshev_solve
from kalmix.ops.common.testing import assert_close


def explicit_reference(q, k, v, g, beta, alpha, H0, U0, ridge, scale):
    """H_t and U_t summed from scratch at every t (no recursion), then torch.linalg.solve."""
    B, T, H, K = q.shape
    G = g.cumsum(1)                                                   # [B, T, H]
    os = []
    for t in range(T):
        wts = torch.exp(G[:, t:t + 1] - G[:, :t + 1]) * beta[:, :t + 1]  # [B, s, H]
        Ht = torch.exp(G[:, t])[..., None, None] * H0 + torch.einsum("bsh,bshi,bshj->bhij", wts, k[:, :t + 1],
                                                                       k[:, :t + 1])
        Ut = torch.exp(G[:, t])[..., None, None] * U0 + torch.einsum("bsh,bshi,bshj->bhij", wts, k[:, :t + 1],
                                                                       v[:, :t + 1])
        lam = ridge * torch.sqrt((Ht ** 2).sum((-1, -2)))
        x = torch.linalg.solve(Ht + lam[..., None, None] * torch.eye(K, dtype=q.dtype), q[:, t])
        qt = q[:, t] + alpha[:, t][..., None] * (x - q[:, t])
        os.append(scale * torch.einsum("bhk,bhkv->bhv", qt, Ut))
    return torch.stack(os, 1)


def draw(T=70, seed=0):
    gen = torch.Generator().manual_seed(seed)
    args = SPECS["gka"].inputs(2, T, 2, 5, 3, torch.float64, gen)
    state = SPECS["gka"].random_state(2, 2, 5, 3, torch.float64, gen)
    return args, state


@pytest.mark.parametrize("impl", ["naive", "torch"])
def test_exact_solve_matches_explicit_reference(impl):
    args, state = draw()
    o, _ = ops.gated_kalmanet(*args, initial_state=state, num_iters=None, ridge=0.05, impl=impl)
    assert_close("o", o, explicit_reference(*args, *state, 0.05, 5 ** -0.5), 1e-10)


@pytest.mark.parametrize("impl", ["naive", "torch"])
def test_chebyshev_converges_to_the_exact_solve(impl):
    args, state = draw()
    exact, _ = ops.gated_kalmanet(*args, initial_state=state, num_iters=None, impl=impl)
    errs = [torch.linalg.norm(ops.gated_kalmanet(*args, initial_state=state, num_iters=n, impl=impl)[0] - exact).item()
            for n in (5, 15, 30, 60)]
    assert errs[0] > errs[1] > errs[2] > errs[3]
    assert errs[2] / exact.norm().item() < 2e-3


def test_chebyshev_error_bound():
    """‖ξ_n − x*‖_A ≤ 2 r^n ‖x*‖_A with r = (√κ − 1)/(√κ + 1) on an SPD system with μ, L the true bounds."""
    gen = torch.Generator().manual_seed(0)
    K = 24
    X = torch.randn(K, K, generator=gen, dtype=torch.float64)
    H = X @ X.T
    hn = torch.linalg.matrix_norm(H)
    lam = 0.02 * hn
    A = H + lam * torch.eye(K, dtype=torch.float64)
    b = torch.randn(K, generator=gen, dtype=torch.float64)
    xs = torch.linalg.solve(A, b)
    kappa = ((hn + lam) / lam).item()
    r = (math.sqrt(kappa) - 1) / (math.sqrt(kappa) + 1)
    anorm = lambda e: torch.sqrt(e @ A @ e).item()  # noqa: E731
    for n in (1, 5, 10, 30):
        x = chebyshev_solve(lambda y: H @ y, b, hn, 0.02, n)
        assert anorm(x - xs) <= 2 * r ** n * anorm(xs) * (1 + 1e-9), n


@pytest.mark.parametrize("impl", ["naive", "torch"])
def test_zero_iterations_is_gated_linear_attention(impl):
    args, state = draw()
    q, k, v, g, beta, alpha = args
    o, _ = ops.gated_kalmanet(*args, initial_state=state, num_iters=0, impl=impl)
    ref = explicit_reference(q, k, v, g, beta, torch.zeros_like(alpha), *state, 0.02, 5 ** -0.5)
    assert_close("o", o, ref, 1e-10)


def test_bf16_inputs_long_sequence_finite():
    gen = torch.Generator().manual_seed(0)
    args = [x.to(torch.bfloat16) for x in SPECS["gka"].inputs(1, 2048, 2, 16, 16, torch.float32, gen)]
    o, (H, U) = ops.gated_kalmanet(*args, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(H).all() and torch.isfinite(U).all()
