"""Bytes-moved and FLOP models of every timed op: the floors a measured time is compared with.

Bytes are the compulsory HBM traffic: every input read once and every output written once per pass.
Forward: inputs + outputs. Forward+backward: forward, then the inputs again, the output gradient, and one
gradient per input (``fwd + 2 * inputs + outputs``). States are not counted (none are requested).

FLOPs count multiply and add separately (2 per MAC). Chunked matrix-state rules use chunk C = 64:
  gated linear attention (simple_gla, gla):  2·BHT·(2KV + C(K + V))
  delta rules (delta, gated delta, Kaczmarz): 2·BHT·(3KV + C(K + V) + CK)        (+ the C×C triangular solve)
  Gated KalmaNet: the GLA readout + num_iters · 2·BHT·(2CK + K²) Chebyshev mat-vecs + the chunk norms 2·BHT·CK
  variational LA: the delta rule + the A path 2·BHT·(2CK + 2K² + C²/3)
  value-gated delta rule (the VLA notebook's DeltaNet, its own chunk C = 32): 2·BHT·(3KV + C(2K + V + KV/2)), the
    per-value-channel triangular solves with 1 + K right-hand sides being the C·K·V/2
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

from kalmix.ops.value_delta.chunk import CHUNK as VALUE_DELTA_CHUNK

CHUNK = 64


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
    raise ValueError(f"unknown mode {mode!r}")


def op_bytes(op: str, s: Shape, elt: int, mode: str) -> int:
    """Bytes floor of one call of ``op`` at shape ``s`` with ``elt``-byte activations."""
    btH = s.B * s.T * s.H
    gates = {"kalman": 0, "gka": 3, "kaczmarz": 2, "vla": 0, "delta": 1, "gated_delta": 2, "simple_gla": 1,
             "gla": s.K, "sdpa": 0}[op]
    n_k = 3 if op == "vla" else 2                              # q, k (and u for VLA)
    v_in = 2 if op == "kalman" else 1                          # Kalman reads v and its precision
    inputs = elt * btH * (n_k * s.K + v_in * s.V + gates)
    if op == "kalman":
        inputs += 4 * 2 * s.H * s.K * s.V                     # fp32 decay and process noise
    return io_bytes(inputs, elt * btH * s.V, mode)


def op_flops(op: str, s: Shape, mode: str, num_iters: int = 30) -> float:
    """FLOPs of one call of ``op`` at shape ``s`` (see the module docstring for the model)."""
    bht = s.B * s.H * s.T
    C, K, V = CHUNK, s.K, s.V
    if op == "kalman":
        return 2 * (9 if mode == "fwd" else 39) * bht * K * V
    if op == "sdpa":
        fwd = 2.0 * s.B * s.H * s.T * s.T * K
        return fwd if mode == "fwd" else 3.5 * fwd
    gla = 2.0 * bht * (2 * K * V + C * (K + V))
    delta = 2.0 * bht * (3 * K * V + C * (K + V) + C * K)
    fwd = {
        "simple_gla": gla,
        "gla": gla,
        "delta": delta,
        "gated_delta": delta,
        "kaczmarz": delta,
        "gka": gla + num_iters * 2.0 * bht * (2 * C * K + K * K) + 2.0 * bht * C * K,
        "vla": delta + 2.0 * bht * (2 * C * K + 2 * K * K + C * C / 3),
        "value_delta": 2.0 * bht * (3 * K * V + VALUE_DELTA_CHUNK * (2 * K + V + K * V / 2)),
    }[op]
    return fwd if mode == "fwd" else 3 * fwd


_MIXER_OPS = {"gdn": "gated_delta", "kaczmarz": "kaczmarz", "gka": "gka", "vla": "vla", "kalman": "kalman",
              "deltanet": "delta", "attention": "sdpa", "linear_attention": "simple_gla", "gla": "gla",
              "mamba2": "simple_gla", "notebook_deltanet": "value_delta"}


def lm_flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of a ``KalmixForCausalLM`` on rows of ``seq_len`` tokens:
    6 per weight of every linear layer (the LM head included, the embedding lookup not) plus each mixer's op
    from ``op_flops`` at (B = 1, T = seq_len) divided by seq_len. Attention counts the whole causal triangle of
    a row, as if it held one document."""
    import torch.nn as nn

    flops = 6.0 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    for block in model.model.layers:
        mixer, name = block.mixer, block.mixer_type
        op = _MIXER_OPS[name]
        if name == "kalman":
            s = Shape(1, seq_len, mixer.num_heads, mixer.d_state, mixer.head_dim)
        elif name == "attention":
            s = Shape(1, seq_len, mixer.num_heads, mixer.head_dim, mixer.head_dim)
        elif name in ("gka", "vla"):
            s = Shape(1, seq_len, mixer.num_heads, mixer.head_dim, mixer.head_dim)
        elif name == "deltanet":
            k = mixer.d_model // mixer.num_heads
            s = Shape(1, seq_len, mixer.num_heads, k, k)
        else:
            s = Shape(1, seq_len, mixer.num_heads, mixer.head_k_dim, mixer.head_v_dim)
        iters = (mixer.num_iters or 0) if name == "gka" else 30
        flops += op_flops(op, s, "fwdbwd", num_iters=iters) / seq_len
    return flops
