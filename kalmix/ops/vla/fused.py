"""impl="triton" of variational linear attention, all on kalmix's Triton kernels: the prologue (k̂, û, φ(q);
io_triton.py), the A path (write directions α̂; apath_triton.py), S's identity-plus-low-rank delta rule
S_t = (I − α̂_t k̂_tᵀ) S_{t-1} + α̂_t v_tᵀ (kalmix/ops/common/delta_triton.py: write key α̂, erase key k̂, β = 1, no
decay, operands in the activations' dtype) and the normalised readout (io_triton.py).

Packed sequences: the prologue works per token; the A path, the delta rule and the readout take ``cu_seqlens``
themselves (chunk tables of ``kalmix.ops.common.triton_utils``: no chunk crosses a sequence, every sequence starts
from its own initial state).
"""
from __future__ import annotations

import torch

from kalmix.ops.common.delta_triton import chunk_delta_rule_triton, max_head_size
from kalmix.ops.vla.apath_triton import MAX_K, write_directions_triton
from kalmix.ops.vla.io_triton import prologue, readout


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
    kh32, uh32, fq, kh = prologue(q, k, u, feature_key)
    alpha, A = write_directions_triton(kh32, uh32, A, cu_seqlens)
    no_decay, unit_step = fq.new_zeros(fq.shape[:3]), fq.new_ones(fq.shape[:3])
    o, S = chunk_delta_rule_triton(fq, alpha.to(v.dtype), kh, v, no_decay, unit_step, scale=1.0, state=S,
                                   cu_seqlens=cu_seqlens)
    o, n = readout(o, q, k, n, eps, cu_seqlens)
    return (o,), (S, A, n)
