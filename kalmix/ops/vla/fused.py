"""impl="triton" of variational linear attention: the A path (write directions α̂) on kalmix's sequential Triton
kernels (apath_triton.py), and S's identity-plus-low-rank delta rule S_t = (I − α̂_t k̂_tᵀ) S_{t-1} + α̂_t v_tᵀ on
kalmix's chunked Triton kernels (kalmix/ops/common/delta_triton.py: write key α̂, erase key k̂, β = 1, no decay)."""
from __future__ import annotations

from kalmix.ops.common.delta_triton import chunk_delta_rule_triton
from kalmix.ops.vla.apath_triton import write_directions_triton
from kalmix.ops.vla.chunk import vla_chunk


def _s_path(fq, alpha, kh, v, *, scale, state):
    no_decay, unit_step = fq.new_zeros(fq.shape[:3]), fq.new_ones(fq.shape[:3])
    return chunk_delta_rule_triton(fq, alpha, kh, v, no_decay, unit_step, scale=scale, state=state)


def vla_fused(q, k, v, u, *, state, eps):
    return vla_chunk(q, k, v, u, state=state, eps=eps, a_path=write_directions_triton, s_path=_s_path)
