"""Public entry point of Kaczmarz linear attention (DESIGN §1.3)."""
from __future__ import annotations

import torch

from kalmix.ops.common.checks import (Range, TritonImpl, check_gates, check_head_sizes, check_qkv, check_ranges,
                                      check_same, check_tensor, compute_dtype, reset_range, resolve_impl)
from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.varlen import Offsets, check_packed, run_packed
from kalmix.ops.kaczmarz.chunk import kaczmarz_chunk
from kalmix.ops.kaczmarz.naive import kaczmarz_naive

kaczmarz_fused = TritonImpl("kalmix.ops.kaczmarz.fused", "kaczmarz_fused")

_OP = "kaczmarz_attention"
_IMPLS = {"naive": kaczmarz_naive, "torch": kaczmarz_chunk, "triton": kaczmarz_fused}


@no_autocast
def kaczmarz_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, eta: torch.Tensor, *,
                       eps: float = 1e-6, scale: float | None = None, initial_state: torch.Tensor | None = None,
                       output_final_state: bool = False, cu_seqlens: torch.Tensor | Offsets | None = None,
                       impl: str | None = None, check_values: bool = True):
    """Gated delta rule whose step is the Kaczmarz projection coefficient η / (‖k‖² + eps).

    Args:
        q, k: [B, T, H, K] (k is used raw: normalising it would make this GDN); v: [B, T, H, V].
        g: [B, T, H] log-decay (<= 0; -inf is a reset, γ = 0, computed as the token loop does by "naive" and
            "torch"; "triton" rejects it); eta: [B, T, H] relaxation in (0, 1]; both in q's dtype or fp32.
        eps: stabiliser of the step for small ‖k‖; scale: readout scale, default K ** -0.5.
        initial_state: [B, H, K, V] (B = number of sequences with ``cu_seqlens``); default zeros.
        cu_seqlens: [N + 1] offsets of packed sequences (B must be 1): a tensor, checked here (one host read;
            the rule: ``kalmix.ops.common.varlen``), or ``Offsets`` checked before (no read).
        impl: "naive" | "torch" | "triton" | None (triton on CUDA, torch otherwise). "triton" runs fla's
            chunk_gated_delta_rule, or kalmix's own chunk kernels where fla cannot (fused.py says where), and
            takes K <= 128 with 16-bit activations, 256 in fp32, 64 in fp64 (fla's: 256); a larger K is an error.
        check_values: check the values (no NaN or Inf in q, k, v and the state; no NaN in the gates; the ranges
            above), raising a ValueError naming the argument; False skips that check and its one host
            synchronisation, for callers whose inputs are in range by construction (the layers).
    Returns:
        o [B, T, H, V], final state [B, H, K, V] (fp32, fp64 for fp64 inputs) or None.
    """
    B, T, H, K, V = check_qkv(_OP, q, k, v)
    check_tensor(_OP, "g", g, (B, T, H), "[B, T, H]")
    check_tensor(_OP, "eta", eta, (B, T, H), "[B, T, H]")
    check_same(_OP, "q", q, {"k": k, "v": v})
    check_gates(_OP, q, {"g": g, "eta": eta})
    if not eps >= 0:
        raise ValueError(f"{_OP}: `eps` must be >= 0, got {eps}")
    cu_seqlens, n_seq = check_packed(_OP, cu_seqlens, B, T, q.device)
    fn = resolve_impl(_OP, impl, q.device, _IMPLS)
    if fn is kaczmarz_fused:
        check_head_sizes(_OP, kaczmarz_fused.module.max_head_sizes(q.dtype, q.device), K=K)
    ranges = [reset_range(g, fn is kaczmarz_fused), Range("eta", eta, 0.0, 1.0, lo_open=True)] if check_values else []
    dt = compute_dtype(q)
    if initial_state is not None:
        check_tensor(_OP, "initial_state", initial_state, (n_seq, H, K, V), "[B, H, K, V] (B = number of sequences)")
        check_same(_OP, "q", q, {"initial_state": initial_state}, dtype=False)
        initial_state = initial_state.to(dt)
    scale = K ** -0.5 if scale is None else scale
    finite = {"q": q, "k": k, "v": v, "initial_state": initial_state} if check_values else {}
    if fn is kaczmarz_fused:    # the kernels take the activations in their dtype and pack sequences themselves
        o, S, finish = fn(q, k, v, g, eta, state=initial_state, eps=eps, scale=scale, cu_seqlens=cu_seqlens,
                          check=ranges, finite=finite, final_state=output_final_state)   # the step's pass checks g, η
        finish()
        return o, (S if output_final_state else None)
    finish = check_ranges(_OP, ranges, finite)             # raises once the kernels are queued
    if initial_state is None:
        initial_state = q.new_zeros(n_seq, H, K, V, dtype=dt)
    (o,), (S,) = run_packed(fn, cu_seqlens, [x.to(dt) for x in (q, k, v, g, eta)], (initial_state,),
                            eps=eps, scale=scale)
    finish()
    return o.to(q.dtype), (S if output_final_state else None)
