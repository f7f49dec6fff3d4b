"""Public entry point of variational linear attention (DESIGN §1.4)."""
from __future__ import annotations

import torch

from kalmix.ops.common.checks import (Range, TritonImpl, check_head_sizes, check_qkv, check_ranges, check_same,
                                      check_tensor, compute_dtype, fail, no_check, resolve_impl)
from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.varlen import Offsets, check_packed, run_packed
from kalmix.ops.vla.chunk import vla_chunk
from kalmix.ops.vla.naive import vla_naive

vla_fused = TritonImpl("kalmix.ops.vla.fused", "vla_fused")

_OP = "variational_linear_attention"
SYM_TOL = 1e-5        # relative tolerance of the initial A's symmetry
_IMPLS = {"naive": vla_naive, "torch": vla_chunk, "triton": vla_fused}
WRITE_KEYS = ("raw", "feature")


@no_autocast
def variational_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, u: torch.Tensor, *,
                                 lambda0: float = 0.1, eps: float = 1e-4, write_key: str = "raw",
                                 initial_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                                 output_final_state: bool = False, cu_seqlens: torch.Tensor | Offsets | None = None,
                                 impl: str | None = None, check_values: bool = True):
    """Recursive least squares with a Sherman–Morrison-maintained inverse penalty A.

    Args:
        q, k, u: [B, T, H, K] (u: penalty directions); v: [B, T, H, V].
        lambda0: A_0 = I / lambda0 (> 0) when no initial state is given; eps: floor of the normaliser.
        write_key: the key S is written and erased along: "raw", k̂ = k/‖k‖ (the paper's equations (7), (10));
            "feature", k̂ = φ(k)/‖φ(k)‖ (the paper's Alg. 1 and the authors' code). The normaliser sums φ(k)
            either way.
        initial_state: (S [B, H, K, V], A [B, H, K, K] symmetric positive definite, n [B, H, K]);
            default (0, I / lambda0, 0). The op reads A as (A + Aᵀ)/2, so A's gradient is symmetric.
        cu_seqlens: [N + 1] offsets of packed sequences (B must be 1; the states' leading dimension is then N): a
            tensor, checked here (one host read; the rule: ``kalmix.ops.common.varlen``), or ``Offsets`` checked
            before (no read).
            "naive" and "torch" run them one at a time, "triton" all in the kernel calls of one batch (README.md).
        impl: "naive" | "torch" | "triton" | None (triton on CUDA, torch otherwise). "triton" takes K <= 128
            (64 with fp64 activations); a larger K is an error.
        check_values: check that q, k, v, u and the state have no NaN or Inf and that the initial A is symmetric
            (within SYM_TOL · max|A|) and positive definite (a Cholesky factorisation), raising a ValueError
            naming the argument (one host synchronisation); False skips it, for callers whose inputs come from
            the op itself or are finite by construction (the layers, decoding). Unchecked NaN inputs give NaN
            outputs for the affected sequences only; the others are computed as usual (no error is raised).
    Returns:
        o [B, T, H, V], (S, A, n) final state (fp32, fp64 for fp64 inputs) or None.
    """
    B, T, H, K, V = check_qkv(_OP, q, k, v)
    check_tensor(_OP, "u", u, (B, T, H, K), "[B, T, H, K] like q")
    check_same(_OP, "q", q, {"k": k, "v": v, "u": u})
    if not lambda0 > 0:
        fail(_OP, f"`lambda0` must be > 0, got {lambda0}")
    if not eps > 0:
        fail(_OP, f"`eps` must be > 0, got {eps}")
    if write_key not in WRITE_KEYS:
        fail(_OP, f"`write_key` must be one of {WRITE_KEYS}, got {write_key!r}")
    cu_seqlens, n_seq = check_packed(_OP, cu_seqlens, B, T, q.device)
    fn = resolve_impl(_OP, impl, q.device, _IMPLS)
    if fn is vla_fused:
        check_head_sizes(_OP, vla_fused.module.max_head_sizes(q.dtype, q.device), K=K)
    dt = compute_dtype(q)
    ranges, finite = [], {"q": q, "k": k, "v": v, "u": u}
    if initial_state is None:
        eye = torch.eye(K, dtype=dt, device=q.device)
        initial_state = (q.new_zeros(n_seq, H, K, V, dtype=dt), (eye / lambda0).expand(n_seq, H, K, K),
                         q.new_zeros(n_seq, H, K, dtype=dt))
    else:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 3:
            fail(_OP, "`initial_state` must be an (S [B, H, K, V], A [B, H, K, K], n [B, H, K]) triple")
        names = ("initial_state[0] (S)", "initial_state[1] (A)", "initial_state[2] (n)")
        for name, s, shape, desc in zip(names, initial_state, ((n_seq, H, K, V), (n_seq, H, K, K), (n_seq, H, K)),
                                        ("[B, H, K, V]", "[B, H, K, K]", "[B, H, K]")):
            check_tensor(_OP, name, s, shape, desc)
            check_same(_OP, "q", q, {name: s}, dtype=False)
        finite.update(zip(names, initial_state))
        if check_values:
            ranges += spd_ranges(initial_state[1], dt)
    finish = check_ranges(_OP, ranges, finite) if check_values else no_check    # raises once the kernels are queued
    # the triton impl takes 16-bit activations as they are (its S path multiplies 16-bit operands, the rest is fp32)
    acts = [x if fn is vla_fused else x.to(dt) for x in (q, k, v, u)]
    S, A, n = (s.to(dt) for s in initial_state)
    # A is symmetric: every impl runs on (A + Aᵀ)/2, so dA is symmetric and the same whatever an impl's formulas
    state, kw = (S, 0.5 * (A + A.mT), n), dict(eps=eps, feature_key=write_key == "feature")
    if fn is vla_fused:     # its kernels take the packed sequences themselves (README.md)
        (o,), final = fn(*acts, state=state, cu_seqlens=cu_seqlens, **kw)
    else:
        (o,), final = run_packed(fn, cu_seqlens, acts, state, **kw)
    finish()
    return o.to(q.dtype), (final if output_final_state else None)


def spd_ranges(A: torch.Tensor, dt: torch.dtype) -> list[Range]:
    """Ranges that hold iff A [B, H, K, K] is symmetric within SYM_TOL · max|A| and (A + Aᵀ)/2 has a Cholesky
    factor (positive definite)."""
    A = A.detach().to(dt).nan_to_num(0.0, 0.0, 0.0)                   # non-finite A fails its finiteness check
    asym = (A - A.mT).abs().amax((-2, -1)) / A.abs().amax((-2, -1)).clamp_min(torch.finfo(dt).tiny)
    info = torch.linalg.cholesky_ex(0.5 * (A + A.mT)).info.to(dt)
    return [Range("initial_state[1] (A): max|A − Aᵀ| / max|A| (A must be symmetric)", asym, None, SYM_TOL),
            Range("initial_state[1] (A): failed Cholesky factorisations (A must be positive definite)", info,
                  None, 0.0)]
