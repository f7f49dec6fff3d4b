"""Kalman linear attention in parallel PyTorch: a Möbius scan for the precision, an affine scan for the mean,
and the exact adjoint (itself two reverse affine scans) as the backward. See README.md for the derivation."""
from __future__ import annotations

import torch

from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.scan import affine_scan, mobius_scan


def _filter(q, k, v, w, a, p, lam0, mu0):
    """Every lane's precision λ, mean μ and predict quantities (λ_{t-1}, s, prior, gain), all [B, T, H, N, D]."""
    kk = k[..., None]                                       # [B, T, H, N, 1]
    phi = kk ** 2 * w[:, :, :, None, :]
    a2 = (a * a).expand_as(phi)
    # λ_t = ((1 + p φ) λ + a² φ) / (p λ + a²)
    lam = mobius_scan(1 + p * phi, a2 * phi, p.expand_as(phi), a2, lam0)
    lam_prev = torch.cat([lam0[:, None], lam[:, :-1]], dim=1)
    s = a * a + p * lam_prev
    prior = lam_prev / s                                    # never λ_t − φ_t: that cancels when φ ≫ prior
    gain = a * prior / lam                                  # mean gain in [0, a]
    mu = affine_scan(gain, kk * (w * v)[:, :, :, None, :] / lam, mu0)
    return lam, mu, (lam_prev, s, prior, gain)


class KalmanScanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, w, a, p, lam0, mu0, output_variance: bool):
        lam, mu, gains = _filter(q, k, v, w, a, p, lam0, mu0)
        o = torch.einsum("bthn,bthnd->bthd", q, mu)
        var = torch.einsum("bthn,bthnd->bthd", q * q, 1.0 / lam) if output_variance else None
        ctx.save_for_backward(q, k, v, w, a, p, lam0, mu0, lam, mu, *gains)
        return o, var, lam[:, -1], mu[:, -1]

    @staticmethod
    @no_autocast
    def backward(ctx, do, dvar, dlam_T, dmu_T):          # unused outputs arrive as zeros (dvar: None if not computed)
        q, k, v, w, a, p, lam0, mu0, lam, mu, lam_prev, s, prior, gain = ctx.saved_tensors
        mu_prev = torch.cat([mu0[:, None], mu[:, :-1]], dim=1)
        qq = q[..., None]
        g_mu = qq * do[:, :, :, None, :]
        inv_lam = 1.0 / lam
        g_lam = -(qq ** 2) * dvar[:, :, :, None, :] * inv_lam ** 2 if dvar is not None else torch.zeros_like(lam)
        g_mu[:, -1] += dmu_T
        g_lam[:, -1] += dlam_T
        # Jacobian of (λ, μ)_{t-1} -> (λ, μ)_t: ∂λ/∂λ = ā²/s², ∂μ/∂μ = gain, ∂μ/∂λ = ā²(ā μ_{t-1} − μ_t)/(s² λ_t);
        # the entries of step t+1 act on step t
        a2_inv_s2 = a * a / s ** 2
        dmu = a * mu_prev - mu
        nxt = lambda x: torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)  # noqa: E731
        G_mu = affine_scan(nxt(gain), g_mu, reverse=True)
        g_r = G_mu * inv_lam                                # ∂L/∂r
        cross = a2_inv_s2 * dmu * g_r                       # (∂μ_t/∂λ_{t-1}) Gμ_t
        G_lam = affine_scan(nxt(a2_inv_s2), g_lam + nxt(cross), reverse=True)
        dlam0 = a2_inv_s2[:, 0] * G_lam[:, 0] + cross[:, 0]
        dmu0 = gain[:, 0] * G_mu[:, 0]
        g_phi = G_lam - g_r * mu                            # ∂L/∂φ
        # ā and p̄ enter only through the prior ℓ = λ_{t-1}/s (and ā μ_{t-1} in the mean)
        dprior_da = -2 * a * lam_prev / s ** 2
        through_prior = G_lam + g_r * dmu
        da = (dprior_da * through_prior + g_r * prior * mu_prev).sum((0, 1))
        dp = (dprior_da * lam_prev * through_prior).sum((0, 1)) / (2 * a)   # ∂ℓ/∂p̄ = ∂ℓ/∂ā · λ_{t-1}/(2ā)
        # φ = k² Λv, r = k Λv v: reduce over the lane axis with einsum instead of materialising products
        dk = 2 * k * torch.einsum("bthnd,bthd->bthn", g_phi, w) + torch.einsum("bthnd,bthd->bthn", g_r, w * v)
        g_r_k = torch.einsum("bthnd,bthn->bthd", g_r, k)
        dw = torch.einsum("bthnd,bthn->bthd", g_phi, k * k) + v * g_r_k
        dv = w * g_r_k
        dq = torch.einsum("bthd,bthnd->bthn", do, mu)
        if dvar is not None:
            dq = dq + 2 * q * torch.einsum("bthd,bthnd->bthn", dvar, inv_lam)
        return dq, dk, dv, dw, da, dp, dlam0, dmu0, None


def kalman_chunk(q, k, v, w, decay, process_noise, *, state, output_variance):
    """Parallel-scan forward with the exact adjoint backward; ``state`` = (precision, mean) [B, H, N, D]."""
    o, var, lam, mu = KalmanScanFunction.apply(q, k, v, w, decay, process_noise, state[0], state[1],
                                               output_variance)
    return (o, var), (lam, mu)
