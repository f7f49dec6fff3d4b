"""impl="triton" of variational linear attention, all on kalmix's Triton kernels: the prologue (k̂, û, φ(q);
io_triton.py), the A path (write directions α̂; apath_triton.py), S's identity-plus-low-rank delta rule
S_t = (I − α̂_t k̂_tᵀ) S_{t-1} + α̂_t v_tᵀ (kalmix/ops/common/delta_triton.py: write key α̂, erase key k̂, β = 1, no
decay, operands in the activations' dtype) and the normalised readout (io_triton.py).

Packed sequences: the prologue works per token and the delta rule takes ``cu_seqlens`` itself; the A path and the
readout take only a batch, so they run once per length bucket (``LengthBuckets``) on right-padded batches whose
padding leaves their states exactly unchanged: k̂ = û = 0 for the A path (û = 0 makes the Sherman–Morrison step
A − 0, k̂ = 0 gives α̂ = 0 through the norm's 1e-12 floor, as the kernels' masked rows already do), and for the
readout φ(k) = 0 (k the dtype's lowest finite value: elu(k) + 1 = exp(k) = 0), o_s = 0, q = 0. Their gradients
there are exact zeros, so the backward's sums over padded tokens add nothing.
"""
from __future__ import annotations

import torch

from kalmix.ops.common.delta_triton import chunk_delta_rule_triton, max_head_size
from kalmix.ops.common.varlen import LengthBuckets
from kalmix.ops.vla.apath_triton import C_SUB, MAX_K, write_directions_triton
from kalmix.ops.vla.io_triton import prologue, readout

# every length below 2·C_SUB shares the first bucket: it is at most two of the A path's sub-chunks and one of the
# readout's chunks of 32 tokens (whatever the padding), so splitting it further would only add calls
MIN_BITS = (2 * C_SUB - 1).bit_length()


def max_head_sizes(dtype: torch.dtype, device: torch.device) -> dict[str, tuple[int, str]]:
    """{"K": (the largest K the A path and the S path's delta-rule kernels both take for activations of ``dtype``,
    why)}; V is walked in blocks."""
    return {"K": min((MAX_K, "the A path holds A [K, K] in registers"), max_head_size(dtype), key=lambda x: x[0])}


def vla_fused(q, k, v, u, *, state, eps, feature_key=False, cu_seqlens=None):
    """The op on a batch (chunk.vla_chunk's signature) or, with ``cu_seqlens`` (checked ``Offsets``), on packed
    sequences ([1, T, ...] activations, states [N, ...]); activations keep their dtype, the A path and the
    normaliser run in the state's dtype."""
    S, A, n = state
    q, k, v, u = (x.contiguous() for x in (q, k, v, u))       # once: every stage below saves these, not its own copy
    buckets = None if cu_seqlens is None else LengthBuckets(cu_seqlens, MIN_BITS)
    kh32, uh32, fq, kh = prologue(q, k, u, feature_key)
    alpha, A = _per_bucket(write_directions_triton, buckets, (kh32, 0.0), (uh32, 0.0), state=A)
    no_decay, unit_step = fq.new_zeros(fq.shape[:3]), fq.new_ones(fq.shape[:3])
    o, S = chunk_delta_rule_triton(fq, alpha.to(v.dtype), kh, v, no_decay, unit_step, scale=1.0, state=S,
                                   cu_seqlens=cu_seqlens)
    o, n = _per_bucket(lambda *x: readout(*x, eps), buckets, (o, 0.0), (q, 0.0), (k, torch.finfo(k.dtype).min),
                       state=n)
    return (o,), (S, A, n)


def _per_bucket(fn, buckets, *acts, state):
    """``fn(*acts, state) -> (out, final)`` on the batch, or on each bucket's batch with each (activation, padding
    value) padded; the outputs come back packed, the final states [N, ...] in sequence order."""
    if buckets is None:
        return fn(*(x for x, _ in acts), state)
    res = [fn(*xs, s) for *xs, s in zip(*(buckets.pad(x, pad) for x, pad in acts), buckets.states(state))]
    return buckets.unpad([r[0] for r in res]), buckets.finals(state, [r[1] for r in res])
