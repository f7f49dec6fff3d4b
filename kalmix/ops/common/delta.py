"""Chunked generalised delta rule in PyTorch (WY/UT form), shared by Kaczmarz, GDN and VLA's S path.

Per head, with a write key ``w_t`` and an erase key ``e_t`` (the classic delta rule has w = e = k):

    S_t = γ_t S_{t-1} + β_t w_t (v_t − γ_t S_{t-1}ᵀ e_t)ᵀ        S: [K, V]
    o_t = scale · S_tᵀ q_t

Within a chunk with start state S_0 and Γ_t = Π_{r≤t} γ_r, the pseudo-values u_t = β_t (v_t − γ_t S_{t-1}ᵀ e_t)
solve the unit lower-triangular system (I + A) U = diag(β)(V − diag(Γ) E S_0) with
A[t, s] = β_t (Γ_t/Γ_s) e_t·w_s (s < t); then S_t = Γ_t S_0 + Σ_{s≤t} (Γ_t/Γ_s) w_s u_sᵀ.
"""
from __future__ import annotations

import torch

CHUNK = 64


def chunk_delta_rule(q, w, e, v, g=None, beta=None, *, scale: float, state: torch.Tensor, chunk_size: int = CHUNK):
    """Run the rule over [B, T, H, *] inputs chunk by chunk (a loop over chunks, none over tokens).

    Args:
        q, w, e: [B, T, H, K]; v: [B, T, H, V]; g (log γ): [B, T, H] or None; beta: [B, T, H] or None.
        state: [B, H, K, V] initial state.
    Returns:
        o [B, T, H, V], final state [B, H, K, V].
    """
    B, T, H, K = q.shape
    S = state
    outs = []
    for c0 in range(0, T, chunk_size):
        sl = slice(c0, min(c0 + chunk_size, T))
        qc, wc, ec, vc = (x[:, sl].transpose(1, 2) for x in (q, w, e, v))  # [B, H, C, *]
        C = qc.shape[2]
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        if g is None:
            G = torch.zeros(B, H, C, dtype=q.dtype, device=q.device)
        else:
            G = g[:, sl].transpose(1, 2).cumsum(-1)                       # [B, H, C] log Γ_t
        # Γ_t/Γ_s for s <= t; the mask goes in before exp so no inf is formed
        ratio = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")))
        bc = torch.ones_like(G) if beta is None else beta[:, sl].transpose(1, 2)
        A = (ec @ wc.transpose(-1, -2)) * ratio * bc[..., None]
        A = A.tril(-1) + torch.eye(C, dtype=q.dtype, device=q.device)
        rhs = bc[..., None] * (vc - G.exp()[..., None] * (ec @ S))
        U = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [B, H, C, V]
        o = G.exp()[..., None] * (qc @ S) + ((qc @ wc.transpose(-1, -2)) * ratio) @ U
        outs.append(scale * o)
        decay_to_end = torch.exp(G[..., -1:] - G)                          # Γ_C/Γ_s
        S = G[..., -1].exp()[..., None, None] * S + (wc * decay_to_end[..., None]).transpose(-1, -2) @ U
    return torch.cat(outs, dim=2).transpose(1, 2), S
