"""Public entry point of Kalman linear attention (DESIGN §1.1)."""
from __future__ import annotations

import torch

from kalmix.ops.common.checks import (Range, TritonImpl, check_qkv, check_ranges, check_same, check_tensor,
                                      compute_dtype, fail, no_check, resolve_impl)
from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.varlen import Offsets, check_packed, run_packed
from kalmix.ops.kalman.chunk import kalman_chunk
from kalmix.ops.kalman.naive import kalman_naive

kalman_fused = TritonImpl("kalmix.ops.kalman.fused", "kalman_fused")

_OP = "kalman_attention"
_IMPLS = {"naive": kalman_naive, "torch": kalman_chunk, "triton": kalman_fused}


@no_autocast
def kalman_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_precision: torch.Tensor,
                     decay: torch.Tensor, process_noise: torch.Tensor, *,
                     initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
                     output_final_state: bool = False, output_variance: bool = False,
                     cu_seqlens: torch.Tensor | Offsets | None = None, impl: str | None = None,
                     check_values: bool = True):
    """Exact diagonal Kalman filter read out by ``q``: one scalar filter per (head, state slot n, channel d).

    Args:
        q, k: [B, T, H, N] readout and observation vectors.
        v: [B, T, H, D] observations; v_precision: [B, T, H, D] > 0 their precision.
        decay: [H, N, D] in (0, 1], the OU transition ā; process_noise: [H, N, D] >= 0, p̄.
        initial_state: (precision [B, H, N, D] > 0, mean [B, H, N, D]); default precision 1, mean 0.
            With ``cu_seqlens`` the leading dimension is the number of sequences.
        output_final_state: also return the final (precision, mean), in fp32 (fp64 for fp64 inputs).
        output_variance: also return the posterior variance of the readout, Σ_n q_n² / λ_n.
        cu_seqlens: [N + 1] offsets of packed sequences (B must be 1): a tensor, checked here (one host read;
            the rule: ``kalmix.ops.common.varlen``), or ``Offsets`` checked before (no read).
        impl: "naive" | "torch" | "triton" | None (triton on CUDA, torch otherwise).
        check_values: check the values (no NaN or Inf in q, k, v and the mean; no NaN elsewhere; the ranges
            above), raising a ValueError naming the argument; False skips that check and its one host
            synchronisation, for callers whose inputs are in range by construction (the layers).
    Returns:
        o [B, T, H, D], variance [B, T, H, D] or None, (precision, mean) or None.
    """
    B, T, H, N, D = check_qkv(_OP, q, k, v, key="N", value="D")
    check_tensor(_OP, "v_precision", v_precision, (B, T, H, D), "[B, T, H, D] like v")
    check_tensor(_OP, "decay", decay, (H, N, D), "[H, N, D]")
    check_tensor(_OP, "process_noise", process_noise, (H, N, D), "[H, N, D]")
    check_same(_OP, "q", q, {"k": k, "v": v, "v_precision": v_precision})
    check_same(_OP, "q", q, {"decay": decay, "process_noise": process_noise}, dtype=False)
    ranges = [Range("v_precision", v_precision, 0.0, None, lo_open=True), Range("decay", decay, 0.0, 1.0, lo_open=True),
              Range("process_noise", process_noise, 0.0, None)]
    cu_seqlens, n_seq = check_packed(_OP, cu_seqlens, B, T, q.device)
    fn = resolve_impl(_OP, impl, q.device, _IMPLS)
    dt = compute_dtype(q)
    if initial_state is None:
        initial_state = (q.new_ones(n_seq, H, N, D, dtype=dt), q.new_zeros(n_seq, H, N, D, dtype=dt))
    else:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            fail(_OP, "`initial_state` must be a (precision, mean) pair of [B, H, N, D] tensors")
        for name, s in zip(("initial_state[0] (precision)", "initial_state[1] (mean)"), initial_state):
            check_tensor(_OP, name, s, (n_seq, H, N, D), "[B, H, N, D] (B = number of sequences)")
            check_same(_OP, "q", q, {name: s}, dtype=False)
        ranges.append(Range("initial_state[0] (precision)", initial_state[0], 0.0, None, lo_open=True))
    finite = {"q": q, "k": k, "v": v, "initial_state[1] (mean)": initial_state[1]}
    finish = check_ranges(_OP, ranges, finite) if check_values else no_check    # raises once the kernels are queued
    state = tuple(s.to(dt) for s in initial_state)
    if fn is kalman_fused:      # loads any activation dtype and packs sequences itself
        (o, var), final = fn(q, k, v, v_precision, decay, process_noise, state=state,
                             output_variance=output_variance, cu_seqlens=cu_seqlens)
    else:
        acts = [x.to(dt) for x in (q, k, v, v_precision)]
        (o, var), final = run_packed(fn, cu_seqlens, acts, state, decay=decay.to(dt),
                                     process_noise=process_noise.to(dt), output_variance=output_variance)
    o = o.to(q.dtype)
    var = var.to(q.dtype) if output_variance else None
    finish()
    return o, var, (final if output_final_state else None)
