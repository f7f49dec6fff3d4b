"""Gated linear attention in chunks of 64 tokens (pure PyTorch, autograd): matmuls within a chunk, the state passed
from chunk to chunk. Every exponential has an argument <= 0 (README.md), so no gate overflows."""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
SUB = 16            # secondary chunks of per-channel decays


def _chunks(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, n, CHUNK, D], zero-padded at the end (a zero key and log decay change no state)."""
    B, T, H, D = x.shape
    return F.pad(x, (0, 0, 0, 0, 0, n * CHUNK - T)).view(B, n, CHUNK, H, D).permute(0, 3, 1, 2, 4)


def _intra(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """A[t, s] = Σ_k q_t[k] k_s[k] exp(G_t[k] − G_s[k]) for s <= t, else 0: q, k [..., C, K], G [..., C, 1 or K]
    (cumulative log decays in the chunk, non-increasing) -> [..., C, C]."""
    C = q.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if G.shape[-1] == 1:                                    # one decay per head: a [C, C] decay matrix
        return (q @ k.transpose(-1, -2)) * (G - G.transpose(-1, -2)).masked_fill(~causal, -torch.inf).exp()
    M = C // SUB
    q, k, G = (x.unflatten(-2, (M, SUB)) for x in (q, k, G))                # [..., M, SUB, K]
    r = G[..., :1, :]                                       # [..., M, 1, K]: each sub-chunk's first G
    # blocks below the diagonal (sub-chunk j < i): q scaled by exp(G_t − r_i), k by exp(r_i − G_s), both <= 1
    below = torch.ones(M, M, dtype=torch.bool, device=q.device).tril(-1)[:, :, None, None]
    kr = k[..., None, :, :, :] * (r[..., :, None, :, :] - G[..., None, :, :, :]).masked_fill(~below, -torch.inf).exp()
    A = torch.einsum("...iak,...ijbk->...iajb", q * (G - r).exp(), kr)       # [..., M, SUB, M, SUB]
    # diagonal blocks: the pairwise decays of SUB tokens
    D = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[:SUB, :SUB, None], -torch.inf).exp()
    diag = torch.einsum("...ak,...bk,...abk->...ab", q, k, D)                # [..., M, SUB, SUB]
    A = A + torch.einsum("...iab,ij->...iajb", diag, torch.eye(M, dtype=q.dtype, device=q.device))
    return A.reshape(*A.shape[:-4], C, C)


def gla_chunk(q, k, v, g, *, state, scale):
    """``gla_naive``'s arguments and returns: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, 1 or K] (<= 0);
    state (S [B, H, K, V],)."""
    S, = state
    B, T, H, _ = q.shape
    n = -(-T // CHUNK)
    q, k, v, g = (_chunks(x, n) for x in (q, k, v, g))     # [B, H, n, C, *]
    G = g.cumsum(3)
    last = G[..., -1:, :]                                   # [B, H, n, 1, 1 or K]
    U = (k * (last - G).exp()).transpose(-1, -2) @ v        # [B, H, n, K, V]: each chunk's write, decayed to its end
    starts = []
    for i in range(n):                                      # S at each chunk's start
        starts.append(S)
        S = last[:, :, i, 0, :, None].exp() * S + U[:, :, i]
    o = scale * ((q * G.exp()) @ torch.stack(starts, 2) + _intra(q, k, G) @ v)
    return (o.permute(0, 2, 3, 1, 4).reshape(B, n * CHUNK, H, -1)[:, :T],), (S,)
