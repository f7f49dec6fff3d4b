"""Public entry point of Gated KalmaNet (DESIGN §1.2)."""
from __future__ import annotations

import torch

from kalmix.ops.common.checks import (Range, TritonImpl, check_gates, check_head_sizes, check_qkv, check_ranges,
                                      check_same, check_tensor, compute_dtype, fail, no_check, reset_range,
                                      resolve_impl)
from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.varlen import Offsets, check_packed, run_packed
from kalmix.ops.gka.chunk import gka_chunk
from kalmix.ops.gka.naive import gka_naive

gka_fused = TritonImpl("kalmix.ops.gka.fused", "gka_fused")

_OP = "gated_kalmanet"
PSD_TOL = 1e-5        # relative tolerance of the initial H's symmetry and positive semi-definiteness
_IMPLS = {"naive": gka_naive, "torch": gka_chunk, "triton": gka_fused}


@no_autocast
def gated_kalmanet(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
                   beta: torch.Tensor | None = None, alpha: torch.Tensor | None = None, *,
                   scale: float | None = None, ridge: float = 0.02, num_iters: int | None = 30,
                   initial_state: tuple[torch.Tensor, torch.Tensor] | None = None, output_final_state: bool = False,
                   cu_seqlens: torch.Tensor | Offsets | None = None, impl: str | None = None,
                   check_values: bool = True):
    """Test-time ridge regression over the decayed history, read out through an α-connected query.

    H_t = γ_t H_{t-1} + β_t k kᵀ, U_t = γ_t U_{t-1} + β_t k vᵀ, x_t ≈ (H_t + ridge·‖H_t‖_F I)^{-1} q_t,
    o_t = scale · U_tᵀ (q_t + α_t (x_t − q_t)).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V].
        g: [B, T, H] log γ (<= 0; -inf is a reset, γ = 0, computed as the token loop does by "naive" and "torch";
            "triton" rejects it), None = no decay;
            beta: [B, T, H] >= 0, None = 1; alpha: [B, T, H], None = 1; gates in q's dtype or fp32.
            Where H_t = 0 (no history yet, or a reset with β = 0) the solve has no data: x_t = 0, so
            q̃_t = (1 − α_t) q_t and o_t = scale · U_tᵀ q̃_t (0 when U_t = 0 too).
        scale: readout scale, default K ** -0.5; ridge: λ_t / ‖H_t‖_F (> 0).
        num_iters: Chebyshev iterations; None = exact solve (reference); 0 = plain gated linear attention.
        initial_state: (H [B, H, K, K] symmetric positive semi-definite, U [B, H, K, V]); default zeros.
            ``check_values`` rejects an H with ‖H − Hᵀ‖_F or −λ_min((H + Hᵀ)/2) above max(PSD_TOL, eps of H's
            dtype) · ‖H‖_F.
        cu_seqlens: [N + 1] offsets of packed sequences (B must be 1): a tensor, checked here (one host read;
            the rule: ``kalmix.ops.common.varlen``), or ``Offsets`` checked before (no read).
        impl: "naive" | "torch" | "triton" | None (triton on CUDA, torch otherwise). "triton" takes K <= 128 and
            num_iters >= 0, and differentiates the solve implicitly (the exact solve's gradient, evaluated with
            the same Chebyshev solver) where "torch" and "naive" differentiate through the iterations.
        check_values: check the values (no NaN or Inf in q, k, v and the state; no NaN in the gates; the ranges
            above; H symmetric PSD), raising a ValueError naming the argument; False skips that check and its
            one host synchronisation, for callers whose inputs are in range by construction (the layers).
    Returns:
        o [B, T, H, V], (H, U) final state (fp32, fp64 for fp64 inputs) or None.
    """
    B, T, H, K, V = check_qkv(_OP, q, k, v)
    for name, x in (("g", g), ("beta", beta), ("alpha", alpha)):
        if x is not None:
            check_tensor(_OP, name, x, (B, T, H), "[B, T, H]")
    check_same(_OP, "q", q, {"k": k, "v": v})
    check_gates(_OP, q, {"g": g, "beta": beta, "alpha": alpha})
    if not ridge > 0:
        fail(_OP, f"`ridge` must be > 0, got {ridge}")
    if num_iters is not None and (not isinstance(num_iters, int) or isinstance(num_iters, bool) or num_iters < 0):
        fail(_OP, f"`num_iters` must be None (exact solve) or an int >= 0, got {num_iters!r}")
    cu_seqlens, n_seq = check_packed(_OP, cu_seqlens, B, T, q.device)
    fn = resolve_impl(_OP, impl, q.device, _IMPLS)
    if fn is gka_fused:
        check_head_sizes(_OP, gka_fused.module.max_head_sizes(q.dtype, q.device), K=K)
    dt = compute_dtype(q)
    hints = {"initial_state_is_zero": initial_state is None} if fn is gka_chunk else {}
    ranges = [r for r in (reset_range(g, fn is gka_fused), Range("beta", beta, 0.0, None)) if r.x is not None]
    finite = {"q": q, "k": k, "v": v}
    if initial_state is None:
        initial_state = (q.new_zeros(n_seq, H, K, K, dtype=dt), q.new_zeros(n_seq, H, K, V, dtype=dt))
    else:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            fail(_OP, "`initial_state` must be an (H [B, H, K, K], U [B, H, K, V]) pair")
        check_tensor(_OP, "initial_state[0] (H)", initial_state[0], (n_seq, H, K, K), "[B, H, K, K]")
        check_tensor(_OP, "initial_state[1] (U)", initial_state[1], (n_seq, H, K, V), "[B, H, K, V]")
        check_same(_OP, "q", q, {"initial_state[0]": initial_state[0], "initial_state[1]": initial_state[1]},
                   dtype=False)
        finite.update({"initial_state[0] (H)": initial_state[0], "initial_state[1] (U)": initial_state[1]})
        if check_values:
            ranges += psd_ranges(initial_state[0], dt)
    finish = check_ranges(_OP, ranges, finite) if check_values else no_check    # raises once the kernels are queued
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


def psd_ranges(Hs: torch.Tensor, dt: torch.dtype) -> list[Range]:
    """Ranges that hold iff H [B, H, K, K] is symmetric and positive semi-definite within tol · ‖H‖_F, tol =
    max(PSD_TOL, the machine epsilon of H's dtype): rounding a PSD H to its dtype moves its eigenvalues by up to
    eps · ‖H‖_F (a bf16 state carried between chunks is PSD to that precision only)."""
    tol = max(PSD_TOL, torch.finfo(Hs.dtype).eps) if Hs.dtype.is_floating_point else PSD_TOL
    Hs = Hs.detach().to(dt).nan_to_num(0.0, 0.0, 0.0)                 # non-finite H fails its finiteness check
    norm = torch.linalg.matrix_norm(Hs).clamp_min(torch.finfo(dt).tiny)
    asym = torch.linalg.matrix_norm(Hs - Hs.mT) / norm
    low = torch.linalg.eigvalsh(0.5 * (Hs + Hs.mT))[..., 0] / norm
    return [Range("initial_state[0] (H): ‖H − Hᵀ‖_F / ‖H‖_F (H must be symmetric)", asym, None, tol),
            Range("initial_state[0] (H): smallest eigenvalue / ‖H‖_F (H must be positive semi-definite)", low,
                  -tol, None)]
