"""FLOP and byte models of one op call: the floors a measured time is compared with (``kalmix speed``, the
trainer's MFU). Each op's ``Cost`` is part of its spec; the field's kernels that kalmix is measured against (SDPA,
fla's delta rules and gated linear attention) are defined here.

Bytes are the compulsory HBM traffic: every input read once and every output written once per pass.
Forward: inputs + outputs. Forward+backward: forward, then the inputs again, the output gradient, and one
gradient per input (``fwd + 2 * inputs + outputs``). States are not counted (none are requested).

FLOPs count multiply and add separately (2 per MAC). Chunked matrix-state rules use chunk C = 64:
  gated linear attention (simple_gla, gla):  2·BHT·(2KV + C(K + V))
  delta rules (delta, gated delta, Kaczmarz): 2·BHT·(3KV + C(K + V) + CK)        (+ the C×C triangular solve)
  Gated KalmaNet: the GLA readout + num_iters · 2·BHT·(2CK + K²) Chebyshev mat-vecs + the chunk norms 2·BHT·CK
  variational LA: the delta rule + the A path 2·BHT·(2CK + 2K² + C²/3)
  value-gated delta rule (the VLA notebook's DeltaNet, its own chunk C = min(32, T)): 2·BHT·(3KV + C(2K + V + KV/2)),
    the per-value-channel triangular solves with 1 + K right-hand sides being the C·K·V/2
  Kalman: elementwise fp32 work on the CUDA cores (lanes = B·T·H·N·D), counted as FMA-equivalents: 2 per fp32
    add, multiply or FMA the filter's math needs per lane-token, so that 100% of the measured fp32 FMA rate is
    every fp32 issue slot doing it. Forward 9 (the covariance-form step u = ā²y + p̄, w·u, 1 + k²·wu, y' = u·g,
    r = k·(wv), ā·μ, ā·μ + r·u, ·g: 8; the readout's Σ_n q·μ: 1), forward+backward 9 + 30 (the step recomputed,
    8; its adjoint, 22: Gμ += q·do 1, Σ_d do·μ 1, ∂φ 3, ∂r 1, φ and ∂u 5, g·Gμ 1, Σ_d for dk 3, Σ_n for dv and
    dw 2, the carries and the dā, dp̄ sums 5). Per-slot (k², 2k) and per-channel (w·v) factors are shared across
    lanes and not counted; nor are loads, addressing, shuffles and the step's reciprocal (the SFU's, one per step).
  causal SDPA: 2·B·H·T²·D forward (QKᵀ and PV over the lower triangle); backward 2.5× that
Forward+backward FLOPs of the matrix-state rules are taken as 3× forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

CHUNK = 64
MODES = ("fwd", "fwdbwd")


@dataclass(frozen=True)
class Shape:
    """Activations [B, T, H, K] / [B, T, H, V] (Kalman: K = N state slots, V = D channels)."""
    B: int
    T: int
    H: int
    K: int
    V: int


def io_bytes(inputs: int, outputs: int, mode: str) -> int:
    """Compulsory traffic for ``inputs``/``outputs`` bytes: fwd reads and writes once; fwd+bwd adds the backward."""
    if mode == "fwd":
        return inputs + outputs
    if mode == "fwdbwd":
        return 3 * inputs + 2 * outputs
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


def _no_params(s: Shape) -> int:
    return 0


@dataclass(frozen=True)
class Cost:
    """The cost model of one op call at shape ``s``.

    ``flops(s, mode, **kw)``: FLOPs (kw: the op's keywords its cost depends on, e.g. GKA's ``num_iters``);
    ``reads(s)``: activation elements read per token and head (q, k, v, gates, ...), each ``elt`` bytes; the
    output, V per token and head, is written once; ``param_bytes(s)``: bytes of fp32 time-invariant inputs
    (Kalman's decay and process noise); ``ceiling``: the machine rate its FLOPs are measured against ("matmul":
    the tensor cores; "fp32": the CUDA cores' fp32 FMA rate, for Kalman's elementwise filter).
    """
    flops: Callable[..., float]
    reads: Callable[[Shape], int]
    param_bytes: Callable[[Shape], int] = _no_params
    ceiling: Literal["matmul", "fp32"] = "matmul"

    def bytes(self, s: Shape, elt: int, mode: str) -> int:
        """Bytes floor of one call at shape ``s`` with ``elt``-byte activations."""
        btH = s.B * s.T * s.H
        return io_bytes(elt * btH * self.reads(s) + self.param_bytes(s), elt * btH * s.V, mode)


def chunked(fwd: Callable[..., float]) -> Callable[..., float]:
    """``flops(s, mode, **kw)`` of a chunked matrix-state rule from its forward FLOPs ``fwd(s, **kw)``:
    forward+backward is 3× forward."""
    def flops(s: Shape, mode: str, **kw) -> float:
        f = fwd(s, **kw)
        return f if mode == "fwd" else 3 * f
    return flops


def gla_fwd(s: Shape) -> float:
    """Forward FLOPs of chunked gated linear attention, 2·BHT·(2KV + C(K + V))."""
    bht = s.B * s.H * s.T
    return 2.0 * bht * (2 * s.K * s.V + CHUNK * (s.K + s.V))


def delta_fwd(s: Shape) -> float:
    """Forward FLOPs of a chunked delta rule, 2·BHT·(3KV + C(K + V) + CK)."""
    bht = s.B * s.H * s.T
    return 2.0 * bht * (3 * s.K * s.V + CHUNK * (s.K + s.V) + CHUNK * s.K)


def _sdpa_flops(s: Shape, mode: str) -> float:
    fwd = 2.0 * s.B * s.H * s.T * s.T * s.K
    return fwd if mode == "fwd" else 3.5 * fwd


# the field's kernels: causal SDPA (q, k, v) and fla's chunked rules, by their gates per token and head
SDPA = Cost(_sdpa_flops, lambda s: 2 * s.K + s.V)
DELTA = Cost(chunked(delta_fwd), lambda s: 2 * s.K + s.V + 1)                    # β
GATED_DELTA = Cost(chunked(delta_fwd), lambda s: 2 * s.K + s.V + 2)              # g, β
SIMPLE_GLA = Cost(chunked(gla_fwd), lambda s: 2 * s.K + s.V + 1)                 # g per head
GLA = Cost(chunked(gla_fwd), lambda s: 2 * s.K + s.V + s.K)                      # g per key channel
