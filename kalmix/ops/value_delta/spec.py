"""The op spec of the value-gated delta rule (``value_gated_delta_rule``, under the VLA notebook's DeltaNet)."""
from __future__ import annotations

import torch

from kalmix.ops.common.cost import Cost, Shape, chunked
from kalmix.ops.common.spec import OpSpec, randn, uniform, unit
from kalmix.ops.value_delta.chunk import CHUNK
from kalmix.ops.value_delta.op import _IMPLS, value_gated_delta_rule


def _fwd(s: Shape) -> float:
    """2·BHT·(3KV + C(2K + V + KV/2)) at its own chunk C = min(32, T): the per-value-channel triangular solves with
    1 + K right-hand sides are the C·K·V/2."""
    C = min(CHUNK, s.T)
    return 2.0 * s.B * s.H * s.T * (3 * s.K * s.V + C * (2 * s.K + s.V + s.K * s.V / 2))


def _inputs(B, T, H, K, V, dtype, gen):
    """The notebook's regime: q [B, T, H, K] normal, k unit, v [B, T, H, V] normal; a log decay per value channel
    in [-2, 0) [B, T, H, V]."""
    return [randn(gen, B, T, H, K, dtype=dtype), unit(gen, B, T, H, K, dtype=dtype),
            randn(gen, B, T, H, V, dtype=dtype), uniform(gen, -2.0, 0.0, B, T, H, V, dtype=dtype)]


SPEC = OpSpec(
    name="value_delta",
    fn=value_gated_delta_rule,
    impls=_IMPLS,
    state_shapes=lambda n, H, K, V: ((n, H, K, V),),                       # S
    default_state=lambda n, H, K, V, dtype, device, kwargs: (torch.zeros(n, H, K, V, dtype=dtype, device=device),),
    inputs=_inputs,
    random_state=lambda n, H, K, V, dtype, gen: randn(gen, n, H, K, V, dtype=dtype),
    cost=Cost(chunked(_fwd), reads=lambda s: 2 * s.K + 2 * s.V),        # q, k; v, g
    # affine, S ↦ Σ_j P_j S e_j e_jᵀ + Q, but with one P_j [K, K] per value channel j (the decay acts on S's
    # columns), which the "columns" probe (one P for every column) does not give: relay only
    combine=None,
    timed=False,                # timed through its layer (notebook_deltanet)
)
