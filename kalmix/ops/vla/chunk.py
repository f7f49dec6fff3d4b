"""Variational linear attention in chunked PyTorch: the exact chunked Sherman–Morrison path for A and a
chunked identity-plus-low-rank delta rule for S (README.md has the derivation)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kalmix.ops.common.delta import chunk_delta_rule
from kalmix.ops.vla.naive import feature_map

CHUNK = 64


def write_directions(kh: torch.Tensor, uh: torch.Tensor, A: torch.Tensor, chunk_size: int = CHUNK):
    """α̂_t = A_t k̂_t / ‖A_t k̂_t‖ for all t, and the final A.

    Per chunk with start A_0 and rows û_t: G = I + U A_0 Uᵀ = R Rᵀ (Cholesky; R = L D^{1/2} of the LDLᵀ form),
    W = R^{-1} U A_0 (rows w_t = z_t / √δ_t), A_t = A_0 − Σ_{s≤t} w_s w_sᵀ.

    Args:
        kh, uh: [B, T, H, K] unit keys and penalty directions; A: [B, H, K, K] symmetric positive definite.
    Returns:
        alpha [B, T, H, K], A [B, H, K, K]; NaN from the chunk on for a (sequence, head) whose G has no Cholesky
        factor (NaN inputs, or an A that is not positive definite), the other sequences unaffected.
    """
    T = kh.shape[1]
    alphas = []
    for c0 in range(0, T, chunk_size):
        kc, uc = (x[:, c0:c0 + chunk_size].transpose(1, 2) for x in (kh, uh))  # [B, H, C, K]
        C = kc.shape[2]
        At = A.transpose(-1, -2)
        UA = uc @ At                                                           # rows (A_0 û_t)ᵀ
        M = uc @ UA.transpose(-1, -2)                                          # M[t, s] = û_tᵀ A_0 û_s
        # the token loop only ever reads û_tᵀ A_0 û_s with s <= t, so G is built from that triangle
        # (identical for symmetric A_0; exact in value and gradient for any A_0)
        G = torch.eye(C, dtype=kh.dtype, device=kh.device) + M.tril() + M.tril(-1).transpose(-1, -2)
        R, info = torch.linalg.cholesky_ex(G)                                  # no host sync, no raise
        R = R.masked_fill((info != 0)[..., None, None], float("nan"))          # a failed factor poisons its own head
        W = torch.linalg.solve_triangular(R, UA, upper=False)                 # [B, H, C, K]
        P = (kc @ W.transpose(-1, -2)).tril()                                  # k̂_t·w_s, s <= t
        alphas.append(F.normalize(kc @ At - P @ W, dim=-1))
        A = A - W.transpose(-1, -2) @ W
    return torch.cat(alphas, dim=2).transpose(1, 2), A


def normaliser(fq: torch.Tensor, fk: torch.Tensor, n: torch.Tensor, chunk_size: int = CHUNK):
    """den_t = φ(q_t) · (n + Σ_{s≤t} φ(k_s)) by chunks (two small matmuls per chunk instead of a [B, T, H, K]
    running sum), and the final n.

    Args:
        fq, fk: [B, T, H, K] features; n: [B, H, K] running sum before the first token.
    Returns:
        den [B, T, H], n [B, H, K].
    """
    B, T, H, K = fq.shape
    NC = -(-T // chunk_size)
    pad = NC * chunk_size - T
    fqc, fkc = (F.pad(x, (0, 0, 0, 0, 0, pad)).view(B, NC, chunk_size, H, K).transpose(2, 3) for x in (fq, fk))
    sums = fkc.sum(3)                                                         # [B, NC, H, K]
    start = n[:, None] + sums.cumsum(1) - sums                                # n before each chunk
    den = (fqc @ start[..., None])[..., 0] + (fqc @ fkc.mT).tril().sum(-1)    # [B, NC, H, C]
    return den.transpose(2, 3).reshape(B, NC * chunk_size, H)[:, :T], start[:, -1] + sums[:, -1]


def vla_chunk(q, k, v, u, *, state, eps, feature_key=False):
    """The op on one sequence or a batch, in the state's dtype; ``feature_key`` writes along φ(k)/‖φ(k)‖."""
    S, A, n = state
    q, k, u = (x.to(S.dtype) for x in (q, k, u))
    fq, fk = feature_map(q), feature_map(k)
    kh = F.normalize(fk if feature_key else k, dim=-1)
    alpha, A = write_directions(kh, F.normalize(u, dim=-1), A)
    # S_t = (I − α̂_t k̂_tᵀ) S_{t-1} + α̂_t v_tᵀ: the delta rule with write key α̂ and erase key k̂
    o, S = chunk_delta_rule(fq, alpha, kh, v, scale=1.0, state=S)
    den, n = normaliser(fq, fk, n)
    return (o / den.clamp_min(eps)[..., None],), (S, A, n)
