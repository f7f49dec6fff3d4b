"""Public entry point of gated linear attention: the op under the linear-attention, GLA and Mamba-2 baselines."""
from __future__ import annotations

import torch

from kalmix.ops.common.checks import (Range, check_gates, check_qkv, check_ranges, check_same, check_tensor,
                                      compute_dtype, fail, no_check, resolve_impl)
from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.varlen import Offsets, check_packed, run_packed
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
    check_same(_OP, "q", q, {"k": k, "v": v})
    check_gates(_OP, q, {"g": g})
    cu_seqlens, n_seq = check_packed(_OP, cu_seqlens, B, T, q.device)
    if impl == "triton":
        fail(_OP, "has no Triton kernel; use impl='torch' (chunked, CPU and CUDA) or 'naive' (the token loop)")
    fn = resolve_impl(_OP, impl or "torch", q.device, _IMPLS)
    dt = compute_dtype(q)
    if initial_state is not None:
        check_tensor(_OP, "initial_state", initial_state, (n_seq, H, K, V), "[B, H, K, V] (B = number of sequences)")
        check_same(_OP, "q", q, {"initial_state": initial_state}, dtype=False)
    finish = no_check
    if check_values:
        ranges = [Range("g", g, float("-inf"), 0.0, lo_open=True)] if g is not None else []
        finish = check_ranges(_OP, ranges, {"q": q, "k": k, "v": v, "initial_state": initial_state})
    state = q.new_zeros(n_seq, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    g = q.new_zeros(B, T, H, 1) if g is None else (g[..., None] if g.dim() == 3 else g)   # [B, T, H, 1 or K]
    scale = K ** -0.5 if scale is None else scale
    (o,), (S,) = run_packed(fn, cu_seqlens, [x.to(dt) for x in (q, k, v, g)], (state,), scale=scale)
    finish()
    return o.to(q.dtype), (S if output_final_state else None)
