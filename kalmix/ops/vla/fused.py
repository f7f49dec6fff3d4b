"""impl="triton" of variational linear attention, all on kalmix's Triton kernels: the prologue (k̂, û, φ(q);
io_triton.py), the A path (write directions α̂; apath_triton.py), S's identity-plus-low-rank delta rule
S_t = (I − α̂_t k̂_tᵀ) S_{t-1} + α̂_t v_tᵀ (kalmix/ops/common/delta_triton.py: write key α̂, erase key k̂, β = 1, no
decay, operands in the activations' dtype) and the normalised readout (io_triton.py)."""
from __future__ import annotations

from kalmix.ops.common.delta_triton import chunk_delta_rule_triton
from kalmix.ops.vla.apath_triton import write_directions_triton
from kalmix.ops.vla.io_triton import prologue, readout


def vla_fused(q, k, v, u, *, state, eps, feature_key=False):
    """The op on one sequence or a batch (chunk.vla_chunk's signature); activations keep their dtype, the A path
    and the normaliser run in the state's dtype."""
    S, A, n = state
    kh32, uh32, fq, kh = prologue(q, k, u, feature_key)
    alpha, A = write_directions_triton(kh32, uh32, A)
    no_decay, unit_step = fq.new_zeros(fq.shape[:3]), fq.new_ones(fq.shape[:3])
    o, S = chunk_delta_rule_triton(fq, alpha.to(v.dtype), kh, v, no_decay, unit_step, scale=1.0, state=S)
    o, n = readout(o, q, k, n, eps)
    return (o,), (S, A, n)
