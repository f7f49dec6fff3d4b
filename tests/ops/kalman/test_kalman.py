"""Kalman attention against an independent covariance-form filter, and in the realistic trained regime."""
import math

import pytest
import torch

from kalmix import ops
from kalmix.ops import SPECS
from kalmix.ops.common.testing import assert_close, rel_err
from kalmix.ops.kalman.spec import realistic_inputs


def covariance_filter(q, k, v, w, a, p, P0, m0):
    """Textbook scalar Kalman filter per lane with explicit gain, on variances (not precisions)."""
    B, T, H, N = q.shape
    P, m = P0.clone(), m0.clone()                      # [B, H, N, D]
    os, vs = [], []
    for t in range(T):
        kt = k[:, t][..., None]                         # [B, H, N, 1]
        Pp = a ** 2 * P + p                             # predicted variance
        mp = a * m                                      # predicted mean
        S = kt ** 2 * Pp + 1.0 / w[:, t][:, :, None, :]  # innovation variance
        gain = Pp * kt / S
        m = mp + gain * (v[:, t][:, :, None, :] - kt * mp)
        P = (1 - gain * kt) * Pp
        os.append(torch.einsum("bhn,bhnd->bhd", q[:, t], m))
        vs.append(torch.einsum("bhn,bhnd->bhd", q[:, t] ** 2, P))
    return torch.stack(os, 1), torch.stack(vs, 1), 1.0 / P, m


@pytest.mark.parametrize("impl", ["naive", "torch"])
def test_matches_covariance_form_filter(impl):
    gen = torch.Generator().manual_seed(3)
    args = SPECS["kalman"].inputs(2, 50, 3, 5, 6, torch.float64, gen)
    lam0, mu0 = SPECS["kalman"].random_state(2, 3, 5, 6, torch.float64, gen)
    o, var, (lam, mu) = ops.kalman_attention(*args, initial_state=(lam0, mu0), output_final_state=True,
                                             output_variance=True, impl=impl)
    ro, rv, rlam, rmu = covariance_filter(*args, 1.0 / lam0, mu0)
    for name, x, r in (("o", o, ro), ("variance", var, rv), ("precision", lam, rlam), ("mean", mu, rmu)):
        assert_close(name, x, r, 1e-10)


def test_realistic_regime_fp32_agrees_with_fp64_at_T4096():
    T = 4096
    ref = ops.kalman_attention(*realistic_inputs(T, torch.float64), output_variance=True, output_final_state=True,
                               impl="naive")
    out = ops.kalman_attention(*realistic_inputs(T, torch.float32), output_variance=True, output_final_state=True,
                               impl="torch")
    o, var, (lam, mu) = out
    assert all(torch.isfinite(x).all() for x in (o, var, lam, mu))
    assert lam.max() > 1e5, "the regime should reach large precisions"
    errs = {"o": rel_err(o, ref[0]), "variance": rel_err(var, ref[1]), "precision": rel_err(lam, ref[2][0]),
            "mean": rel_err(mu, ref[2][1])}
    print("fp32 torch vs fp64 naive at T=4096:", {k: f"{e:.1e}" for k, e in errs.items()})
    assert max(errs.values()) < 2e-5, errs


def test_realistic_regime_gradients_fp64():
    args = [x.requires_grad_() for x in realistic_inputs(300, torch.float64, seed=1, N=4, D=3)]
    grads = {}
    for impl in ("naive", "torch"):
        o, var, _ = ops.kalman_attention(*args, output_variance=True, impl=impl)
        gen = torch.Generator().manual_seed(0)
        loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (
            var * torch.randn(var.shape, generator=gen, dtype=o.dtype)).sum()
        grads[impl] = torch.autograd.grad(loss, args)
    for i, (x, r) in enumerate(zip(grads["torch"], grads["naive"])):
        assert_close(f"grad {i}", x, r, 1e-6)


def test_steady_state_precision_is_the_fixed_point():
    """Constant evidence drives λ to the Möbius fixed point λ* = φ + λ*/(a² + p λ*)."""
    T, a, p, phi = 3000, 0.95, 1e-3, 2.0
    q = torch.ones(1, T, 1, 1, dtype=torch.float64)
    k = torch.ones_like(q)
    v = torch.zeros(1, T, 1, 1, dtype=torch.float64)
    w = torch.full_like(v, phi)
    _, _, (lam, _) = ops.kalman_attention(q, k, v, w, torch.full((1, 1, 1), a, dtype=torch.float64),
                                          torch.full((1, 1, 1), p, dtype=torch.float64), output_final_state=True)
    # p λ² + (a² − 1 − pφ) λ − a² φ = 0
    bq = a * a - 1 - p * phi
    fixed = (-bq + math.sqrt(bq * bq + 4 * p * a * a * phi)) / (2 * p)
    assert abs(lam.item() - fixed) / fixed < 1e-12
