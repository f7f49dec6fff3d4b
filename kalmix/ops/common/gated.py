"""The entry shared by the torch-only gated ops (``gated_linear_attention``, ``value_gated_delta_rule``): one
[B, H, K, V] state per sequence, a log-decay gate in (−inf, 0], chunked PyTorch and a token loop, no Triton kernel."""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from kalmix.ops.common.checks import (Range, check_gates, check_ranges, check_same, check_tensor, compute_dtype,
                                      fail, no_check, resolve_impl)
from kalmix.ops.common.varlen import Offsets, check_packed, run_packed


def run_gated(op: str, impls: Mapping[str, Callable], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              g: torch.Tensor | None, g_run: torch.Tensor, scale: float | None, initial_state: torch.Tensor | None,
              output_final_state: bool, cu_seqlens: torch.Tensor | Offsets | None, impl: str | None,
              check_values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op after its own shape checks of q, k, v [B, T, H, K / V] and its gate ``g`` (None: no gate): devices,
    dtypes, packing, backend, initial state [N, H, K, V] and value ranges checked, then ``impls[impl]`` run on
    (q, k, v, ``g_run``: g as the backend takes it) per packed sequence -> (o [B, T, H, V] in q's dtype, final
    state or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    check_same(op, "q", q, {"k": k, "v": v})
    check_gates(op, q, {"g": g})
    cu_seqlens, n_seq = check_packed(op, cu_seqlens, B, T, q.device)
    if impl == "triton":
        fail(op, "has no Triton kernel; use impl='torch' (chunked, CPU and CUDA) or 'naive' (the token loop)")
    fn = resolve_impl(op, impl or "torch", q.device, impls)
    dt = compute_dtype(q)
    if initial_state is not None:
        check_tensor(op, "initial_state", initial_state, (n_seq, H, K, V), "[B, H, K, V] (B = number of sequences)")
        check_same(op, "q", q, {"initial_state": initial_state}, dtype=False)
    finish = no_check
    if check_values:
        ranges = [Range("g", g, float("-inf"), 0.0, lo_open=True)] if g is not None else []
        finish = check_ranges(op, ranges, {"q": q, "k": k, "v": v, "initial_state": initial_state})
    state = q.new_zeros(n_seq, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    scale = K ** -0.5 if scale is None else scale
    (o,), (S,) = run_packed(fn, cu_seqlens, [x.to(dt) for x in (q, k, v, g_run)], (state,), scale=scale)
    finish()
    return o.to(q.dtype), (S if output_final_state else None)
