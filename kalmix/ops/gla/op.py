"""Public entry point of gated linear attention: the op under the linear-attention, GLA and Mamba-2 baselines."""
from __future__ import annotations

import torch

from kalmix.ops.common.checks import check_qkv, check_tensor
from kalmix.ops.common.gated import run_gated
from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.varlen import Offsets
from kalmix.ops.gla.chunk import gla_chunk
from kalmix.ops.gla.naive import gla_naive

_OP = "gated_linear_attention"
_IMPLS = {"naive": gla_naive, "torch": gla_chunk}


@no_autocast
def gated_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None, *,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, cu_seqlens: torch.Tensor | Offsets | None = None,
                           impl: str | None = None, check_values: bool = True):
    """S_t = diag(exp(g_t)) S_{t−1} + k_t v_tᵀ, o_t = scale · S_tᵀ q_t.

    Linear attention is g = None, GLA a log decay per key channel, Mamba-2's SSD one per head (q = C, k = Δ·B,
    v = x, scale = 1).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V].
        g: log decay (finite, <= 0): [B, T, H] (per head), [B, T, H, K] (per key channel) or None (no decay); in
            q's dtype or fp32.
        scale: readout scale, default K ** -0.5.
        initial_state: [B, H, K, V] (B = number of sequences with ``cu_seqlens``); default zeros.
        cu_seqlens: [N + 1] offsets of packed sequences (B must be 1): a tensor, checked here (one host read; the
            rule: ``kalmix.ops.common.varlen``), or ``Offsets`` checked before (no read); "torch" runs them one by
            one (one chunked pass per sequence).
        impl: "naive" (token loop) | "torch" (chunked) | None (= "torch" on every device: there is no Triton
            kernel, and "triton" is a ValueError).
        check_values: reject NaN/Inf in q, k, v and the state and g outside (−inf, 0] (one host synchronisation);
            False skips it, for callers whose inputs are in range by construction (the layers).
    Returns:
        o [B, T, H, V] in q's dtype, final state [B, H, K, V] (fp32, fp64 for fp64 inputs) or None.
    """
    B, T, H, K, V = check_qkv(_OP, q, k, v)
    if g is not None:
        check_tensor(_OP, "g", g, (B, T, H) if g.dim() == 3 else (B, T, H, K), "[B, T, H] or [B, T, H, K]")
    g_run = q.new_zeros(B, T, H, 1) if g is None else (g[..., None] if g.dim() == 3 else g)   # [B, T, H, 1 or K]
    return run_gated(_OP, _IMPLS, q, k, v, g, g_run, scale, initial_state, output_final_state, cu_seqlens, impl,
                     check_values)
