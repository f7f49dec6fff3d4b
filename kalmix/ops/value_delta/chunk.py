"""The value-gated delta rule in chunks of up to 32 tokens (pure PyTorch, autograd): per value channel a unit lower-
triangular solve within each chunk, the state passed from chunk to chunk (README.md). Every exponential has an
argument <= 0, so no decay overflows."""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 32         # the longest chunk; a shorter sequence is one chunk of its length (the work grows with C)


def _chunks(x: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, n, C, D], zero-padded at the end (a zero key, value and log decay change no state)."""
    B, T, H, D = x.shape
    return F.pad(x, (0, 0, 0, 0, 0, n * C - T)).view(B, n, C, H, D).permute(0, 3, 1, 2, 4)


def _decays(x: torch.Tensor, y: torch.Tensor, strict: bool) -> torch.Tensor:
    """exp(x_t − y_s) per value channel on s < t (``strict``) or s <= t, 0 elsewhere: x, y [..., C, V] ->
    [..., V, C, C] (t, s). The upper triangle is −inf before the exponential, so nothing overflows."""
    C = x.shape[-2]
    keep = torch.ones(C, C, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)
    diff = x.transpose(-1, -2)[..., :, None] - y.transpose(-1, -2)[..., None, :]
    return diff.masked_fill(~keep, float("-inf")).exp()


def value_delta_chunk(q, k, v, g, *, state, scale):
    """``value_delta_naive``'s arguments and returns: q, k [B, T, H, K]; v, g [B, T, H, V]; state (S [B, H, K, V],)."""
    S, = state
    B, T, H, K = q.shape
    C = min(CHUNK, T)
    n = -(-T // C)
    q, k, v, g = (_chunks(x, n, C) for x in (q, k, v, g))           # [B, H, n, C, *]
    G = g.cumsum(3)                                                 # log decay from the chunk start, through t
    Gx = G - g                                                      # the same before t
    last = G[..., -1:, :]                                           # [B, H, n, 1, V]
    kk = (k @ k.transpose(-1, -2))[:, :, :, None]                   # [B, H, n, 1, C, C]
    qk = (q @ k.transpose(-1, -2))[:, :, :, None]
    # per value channel j: (I + A_j) e_j = v_j − exp(Gx_j) ⊙ (K S_0[:, j]), A_j[t, s] = exp(Gx_t − G_s) k_t·k_s
    # (s < t); solved once for [v_j | exp(Gx_j) ⊙ K], so that e_j = U_j − W_j S_0[:, j] in each chunk
    A = _decays(Gx, G, strict=True) * kk + torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat([v.transpose(-1, -2)[..., None], Gx.exp().transpose(-1, -2)[..., None] * k[:, :, :, None]], -1)
    UW = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [B, H, n, V, C, 1 + K]
    U, W = UW[..., 0], UW[..., 1:]
    D = _decays(G, G, strict=False) * qk                            # exp(G_t − G_s) q_t·k_s: [B, H, n, V, C, C]
    outs = []
    for i in range(n):
        E = U[:, :, i] - torch.einsum("bhvck,bhkv->bhvc", W[:, :, i], S)            # errors e [B, H, V, C]
        outs.append(G[:, :, i].exp() * (q[:, :, i] @ S) + torch.einsum("bhvts,bhvs->bhtv", D[:, :, i], E))
        to_end = (last[:, :, i] - G[:, :, i]).exp()                                  # [B, H, C, V]
        S = last[:, :, i].exp() * S + k[:, :, i].transpose(-1, -2) @ (E.transpose(-1, -2) * to_end)
    o = scale * torch.stack(outs, 2)                                                 # [B, H, n, C, V]
    return (o.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, -1)[:, :T],), (S,)
