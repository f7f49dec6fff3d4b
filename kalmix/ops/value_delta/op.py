"""Public entry point of the value-gated delta rule: the op under the VLA notebook's DeltaNet baseline."""
from __future__ import annotations

import torch

from kalmix.ops.common.checks import check_qkv, check_tensor
from kalmix.ops.common.gated import run_gated
from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.varlen import Offsets
from kalmix.ops.value_delta.chunk import value_delta_chunk
from kalmix.ops.value_delta.naive import value_delta_naive

_OP = "value_gated_delta_rule"
_IMPLS = {"naive": value_delta_naive, "torch": value_delta_chunk}


@no_autocast
def value_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, cu_seqlens: torch.Tensor | Offsets | None = None,
                           impl: str | None = None, check_values: bool = True):
    """S_t = S_{t−1} diag(exp(g_t)) + k_t (v_t − S_{t−1}ᵀ k_t)ᵀ, o_t = scale · S_tᵀ q_t.

    A delta rule with a unit step whose decay acts on each value channel (a column of S) and not on the error,
    which is measured against the undecayed state: the DeltaNet of the VLA authors' released notebook
    (S ← σ(W_g x) ⊙ S + (v − S k) kᵀ in its [V, K] layout). With g = 0 it is DeltaNet's rule at β = 1.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V].
        g: log decay per value channel (finite, <= 0): [B, T, H, V], in q's dtype or fp32.
        scale: readout scale, default K ** -0.5.
        initial_state: [B, H, K, V] (B = number of sequences with ``cu_seqlens``); default zeros.
        cu_seqlens: [N + 1] offsets of packed sequences (B must be 1): a tensor, checked here (one host read; the
            rule: ``kalmix.ops.common.varlen``), or ``Offsets`` checked before (no read); run one by one (one
            chunked pass per sequence).
        impl: "naive" (token loop) | "torch" (chunked) | None (= "torch" on every device: there is no Triton
            kernel, and "triton" is a ValueError).
        check_values: reject NaN/Inf in q, k, v and the state and g outside (−inf, 0] (one host synchronisation);
            False skips it, for callers whose inputs are in range by construction (the layers).
    Returns:
        o [B, T, H, V] in q's dtype, final state [B, H, K, V] (fp32, fp64 for fp64 inputs) or None.
    """
    B, T, H, K, V = check_qkv(_OP, q, k, v)
    check_tensor(_OP, "g", g, (B, T, H, V), "[B, T, H, V] like v")
    return run_gated(_OP, _IMPLS, q, k, v, g, g, scale, initial_state, output_final_state, cu_seqlens, impl,
                     check_values)
