"""Gated KalmaNet in chunked PyTorch: chunk-start (H, U) states, every H_t applied inside the chunk without
being formed, ‖H_t‖_F from the chunk expansion (paper §4.2.1). Differentiable by autograd."""
from __future__ import annotations

import torch

from kalmix.ops.common.chebyshev import chebyshev_solve
from kalmix.ops.common.delta import chunk_decays

CHUNK = 64


def gka_chunk(q, k, v, g, beta, alpha, *, state, scale, ridge, num_iters, initial_state_is_zero: bool = False,
              chunk_size: int = CHUNK):
    Hc, Uc = state                                                     # [B, H, K, K], [B, H, K, V]
    B, T, H, K = q.shape
    start_is_zero = initial_state_is_zero                              # skip the H_c terms while H_c = 0
    outs = []
    for c0 in range(0, T, chunk_size):
        sl = slice(c0, min(c0 + chunk_size, T))
        qc, kc, vc = (x[:, sl].transpose(1, 2) for x in (q, k, v))      # [B, H, C, *]
        gc, bc, ac = (x[:, sl].transpose(1, 2) for x in (g, beta, alpha))  # [B, H, C]
        ratio, gam, to_end = chunk_decays(gc)                          # Γ_t/Γ_s, Γ_t since the chunk start, Γ_C/Γ_s
        # M[t, s] = β_s Γ_t/Γ_s for s <= t: H_t = Γ_t H_c + Σ_s M[t, s] k_s k_sᵀ (likewise U_t)
        M = ratio * bc[..., None, :]
        if num_iters == 0:
            qt = qc
        else:
            gram = kc @ kc.transpose(-1, -2)                           # [B, H, C, C]
            sq = ((M @ gram ** 2) * M).sum(-1)                         # ‖Σ_s M[t, s] k_s k_sᵀ‖_F²
            if not start_is_zero:
                kHk = ((kc @ Hc) * kc).sum(-1)                         # k_sᵀ H_c k_s
                sq = sq + gam ** 2 * (Hc ** 2).sum((-2, -1))[..., None] + 2 * gam * (M @ kHk[..., None])[..., 0]
            hnorm = sq.clamp_min(0).sqrt()                             # ‖H_t‖_F  [B, H, C]
            if num_iters is None:
                Ht = gam[..., None, None] * Hc[:, :, None] + torch.einsum("bhts,bhsi,bhsj->bhtij", M, kc, kc)
                eye = torch.eye(K, dtype=q.dtype, device=q.device)
                some = hnorm > 0                                       # x = 0 where H_t = 0 (no data)
                x = torch.linalg.solve(Ht + torch.where(some, ridge * hnorm, 1.0)[..., None, None] * eye, qc)
                x = x * some[..., None]
            else:
                def matvec(X):                                         # H_t x_t for every t at once
                    within = (M * (X @ kc.transpose(-1, -2))) @ kc
                    return within if start_is_zero else gam[..., None] * (X @ Hc.transpose(-1, -2)) + within
                x = chebyshev_solve(matvec, qc, hnorm, ridge, num_iters)
            qt = qc + ac[..., None] * (x - qc)
        outs.append(scale * (gam[..., None] * (qt @ Uc) + (M * (qt @ kc.transpose(-1, -2))) @ vc))
        w_end = (to_end * bc)[..., None] * kc                          # β_s Γ_C/Γ_s k_s
        Hc = gam[..., -1, None, None] * Hc + w_end.transpose(-1, -2) @ kc
        start_is_zero = False
        Uc = gam[..., -1, None, None] * Uc + w_end.transpose(-1, -2) @ vc
    return (torch.cat(outs, dim=2).transpose(1, 2),), (Hc, Uc)
