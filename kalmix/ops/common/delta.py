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


def chunk_decays(g: torch.Tensor):
    """Decay factors of one chunk from its log-decays g [..., C], where g = -inf is a reset (γ = 0).

    Returns ratio [..., C, C] = Γ_t/Γ_s on s <= t (0 above the diagonal), start [..., C] = Γ_t (decay since the
    chunk start) and to_end [..., C] = Γ_C/Γ_s. The cumulative sum skips resets and a factor spanning one is set
    to 0, so no -inf - (-inf) = NaN is formed and the segments keep the precision of their own sums.
    """
    reset = torch.isneginf(g)
    G = torch.where(reset, torch.zeros_like(g), g).cumsum(-1)
    seg = reset.cumsum(-1)                                                 # resets up to and including t
    C = g.shape[-1]
    lower = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    same = lower & (seg[..., :, None] == seg[..., None, :])
    # masks go in before exp, so no inf is formed
    ratio = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~same, float("-inf")))
    start = torch.exp(G.masked_fill(seg > 0, float("-inf")))
    to_end = torch.exp((G[..., -1:] - G).masked_fill(seg != seg[..., -1:], float("-inf")))
    return ratio, start, to_end


def chunk_delta_rule(q, w, e, v, g=None, beta=None, *, scale: float, state: torch.Tensor, chunk_size: int = CHUNK):
    """Run the rule over [B, T, H, *] inputs chunk by chunk (a loop over chunks, none over tokens).

    Args:
        q, w, e: [B, T, H, K]; v: [B, T, H, V]; g (log γ, -inf = reset): [B, T, H] or None; beta: [B, T, H] or
            None.
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
        gc = q.new_zeros(B, H, C) if g is None else g[:, sl].transpose(1, 2)   # [B, H, C] log γ_t
        ratio, gam, decay_to_end = chunk_decays(gc)                      # Γ_t/Γ_s, Γ_t, Γ_C/Γ_s
        bc = torch.ones_like(gam) if beta is None else beta[:, sl].transpose(1, 2)
        A = (ec @ wc.transpose(-1, -2)) * ratio * bc[..., None]
        A = A.tril(-1) + torch.eye(C, dtype=q.dtype, device=q.device)
        rhs = bc[..., None] * (vc - gam[..., None] * (ec @ S))
        U = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [B, H, C, V]
        o = gam[..., None] * (qc @ S) + ((qc @ wc.transpose(-1, -2)) * ratio) @ U
        outs.append(scale * o)
        S = gam[..., -1, None, None] * S + (wc * decay_to_end[..., None]).transpose(-1, -2) @ U
    return torch.cat(outs, dim=2).transpose(1, 2), S
