"""The op spec of Kaczmarz linear attention (``kaczmarz_attention``, also Gated DeltaNet's op)."""
from __future__ import annotations

import torch

from kalmix.ops.common.cost import GATED_DELTA
from kalmix.ops.common.spec import OpSpec, randn, uniform, unit
from kalmix.ops.kaczmarz.op import _IMPLS, kaczmarz_attention


def _inputs(B, T, H, K, V, dtype, gen):
    """q unit [B, T, H, K], k, v [B, T, H, V]; g in [-0.3, 0), η in [0.05, 1) [B, T, H]."""
    return [unit(gen, B, T, H, K, dtype=dtype), randn(gen, B, T, H, K, dtype=dtype),
            randn(gen, B, T, H, V, dtype=dtype), uniform(gen, -0.3, 0.0, B, T, H, dtype=dtype),
            uniform(gen, 0.05, 1.0, B, T, H, dtype=dtype)]


SPEC = OpSpec(
    name="kaczmarz",
    fn=kaczmarz_attention,
    impls=_IMPLS,
    state_shapes=lambda n, H, K, V: ((n, H, K, V),),                       # S
    default_state=lambda n, H, K, V, dtype, device, kwargs: (torch.zeros(n, H, K, V, dtype=dtype, device=device),),
    inputs=_inputs,
    random_state=lambda n, H, K, V, dtype, gen: randn(gen, n, H, K, V, dtype=dtype),
    cost=GATED_DELTA,           # the gated delta rule's: q, k, v; g, η
    combine="columns",          # S ↦ γ (I − β k kᵀ) S + β k vᵀ: affine, column by column
    step_impls=("triton",),
)
