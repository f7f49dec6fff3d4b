"""Public entry point of Gated KalmaNet (DESIGN §1.2)."""
from __future__ import annotations

import torch

from kalmix.ops.common.checks import (Range, check_cu_seqlens, check_gates, check_ranges, check_same, no_check,
                                      check_tensor, compute_dtype, fail, resolve_impl)
from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.varlen import run_packed
from kalmix.ops.gka.chunk import gka_chunk
from kalmix.ops.gka.fused import gka_fused
from kalmix.ops.gka.naive import gka_naive

_OP = "gated_kalmanet"
_IMPLS = {"naive": gka_naive, "torch": gka_chunk, "triton": gka_fused}


@no_autocast
def gated_kalmanet(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
                   beta: torch.Tensor | None = None, alpha: torch.Tensor | None = None, *,
                   scale: float | None = None, ridge: float = 0.02, num_iters: int | None = 30,
                   initial_state: tuple[torch.Tensor, torch.Tensor] | None = None, output_final_state: bool = False,
                   cu_seqlens: torch.Tensor | None = None, impl: str | None = None, check_values: bool = True):
    """Test-time ridge regression over the decayed history, read out through an α-connected query.

    H_t = γ_t H_{t-1} + β_t k kᵀ, U_t = γ_t U_{t-1} + β_t k vᵀ, x_t ≈ (H_t + ridge·‖H_t‖_F I)^{-1} q_t,
    o_t = scale · U_tᵀ (q_t + α_t (x_t − q_t)).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V].
        g: [B, T, H] log γ (<= 0), None = no decay; beta: [B, T, H] >= 0, None = 1; alpha: [B, T, H], None = 1;
            gates in q's dtype or fp32.
        scale: readout scale, default K ** -0.5; ridge: λ_t / ‖H_t‖_F (> 0).
        num_iters: Chebyshev iterations; None = exact solve (reference); 0 = plain gated linear attention.
        initial_state: (H [B, H, K, K] symmetric PSD, U [B, H, K, V]); default zeros.
        cu_seqlens: [N + 1] offsets of packed sequences (B must be 1).
        impl: "naive" | "torch" | "triton" | None (triton on CUDA, torch otherwise). "triton" takes K <= 128 and
            num_iters >= 0, and differentiates the solve implicitly (the exact solve's gradient, evaluated with
            the same Chebyshev solver) where "torch" and "naive" differentiate through the iterations.
        check_values: check the values (no NaN; the ranges above); False skips that check and its one host
            synchronisation, for callers whose inputs are in range by construction (the layers).
    Returns:
        o [B, T, H, V], (H, U) final state (fp32, fp64 for fp64 inputs) or None.
    """
    check_tensor(_OP, "q", q, (None, None, None, None), "[B, T, H, K]")
    B, T, H, K = q.shape
    check_tensor(_OP, "k", k, (B, T, H, K), "[B, T, H, K] like q")
    check_tensor(_OP, "v", v, (B, T, H, None), "[B, T, H, V]")
    V = v.shape[-1]
    for name, x in (("g", g), ("beta", beta), ("alpha", alpha)):
        if x is not None:
            check_tensor(_OP, name, x, (B, T, H), "[B, T, H]")
    check_same(_OP, "q", q, {"k": k, "v": v})
    check_gates(_OP, q, {"g": g, "beta": beta, "alpha": alpha})
    ranges = [r for r in (Range("g", g, None, 0.0), Range("beta", beta, 0.0, None)) if r.x is not None]
    finish = check_ranges(_OP, ranges) if check_values else no_check    # raises once the kernels are queued
    if not ridge > 0:
        fail(_OP, f"`ridge` must be > 0, got {ridge}")
    if num_iters is not None and (not isinstance(num_iters, int) or isinstance(num_iters, bool) or num_iters < 0):
        fail(_OP, f"`num_iters` must be None (exact solve) or an int >= 0, got {num_iters!r}")
    n_seq = check_cu_seqlens(_OP, cu_seqlens, B, T, q.device)
    fn = resolve_impl(_OP, impl, q.device, _IMPLS)
    dt = compute_dtype(q)
    hints = {"initial_state_is_zero": initial_state is None} if fn is gka_chunk else {}
    if initial_state is None:
        initial_state = (q.new_zeros(n_seq, H, K, K, dtype=dt), q.new_zeros(n_seq, H, K, V, dtype=dt))
    else:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            fail(_OP, "`initial_state` must be an (H [B, H, K, K], U [B, H, K, V]) pair")
        check_tensor(_OP, "initial_state[0] (H)", initial_state[0], (n_seq, H, K, K), "[B, H, K, K]")
        check_tensor(_OP, "initial_state[1] (U)", initial_state[1], (n_seq, H, K, V), "[B, H, K, V]")
        check_same(_OP, "q", q, {"initial_state[0]": initial_state[0], "initial_state[1]": initial_state[1]},
                   dtype=False)
    g = q.new_zeros(B, T, H) if g is None else g
    beta = q.new_ones(B, T, H) if beta is None else beta
    alpha = q.new_ones(B, T, H) if alpha is None else alpha
    scale = K ** -0.5 if scale is None else scale
    if fn is gka_fused:     # the kernels take the activations in their dtype and pack sequences themselves
        o, final = fn(q, k, v, g, beta, alpha, state=initial_state, scale=scale, ridge=ridge, num_iters=num_iters,
                      cu_seqlens=cu_seqlens)
        finish()
        return o, (final if output_final_state else None)
    (o,), final = run_packed(fn, cu_seqlens, [x.to(dt) for x in (q, k, v, g, beta, alpha)],
                             tuple(s.to(dt) for s in initial_state), scale=scale, ridge=ridge, num_iters=num_iters,
                             **hints)
    finish()
    return o.to(q.dtype), (final if output_final_state else None)
