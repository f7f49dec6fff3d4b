"""The op spec of gated linear attention (``gated_linear_attention``, under the linear-attention, GLA and Mamba-2
baselines)."""
from __future__ import annotations

import torch

from kalmix.ops.common.cost import GLA
from kalmix.ops.common.spec import OpSpec, randn, uniform
from kalmix.ops.gla.op import _IMPLS, gated_linear_attention


def _inputs(B, T, H, K, V, dtype, gen):
    """GLA's regime: q, k [B, T, H, K], v [B, T, H, V] normal; a log decay per key channel in [-0.5, 0)."""
    return [randn(gen, B, T, H, K, dtype=dtype), randn(gen, B, T, H, K, dtype=dtype),
            randn(gen, B, T, H, V, dtype=dtype), uniform(gen, -0.5, 0.0, B, T, H, K, dtype=dtype)]


SPEC = OpSpec(
    name="gla",
    fn=gated_linear_attention,
    impls=_IMPLS,
    state_shapes=lambda n, H, K, V: ((n, H, K, V),),                       # S
    default_state=lambda n, H, K, V, dtype, device, kwargs: (torch.zeros(n, H, K, V, dtype=dtype, device=device),),
    inputs=_inputs,
    random_state=lambda n, H, K, V, dtype, gen: randn(gen, n, H, K, V, dtype=dtype),
    cost=GLA,                   # a gate per key channel, as in its test inputs
    combine="columns",          # S ↦ diag(exp g) S + k vᵀ: affine, column by column
    timed=False,                # timed through its layers and fla's GLA kernels
)
