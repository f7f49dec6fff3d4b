"""The op spec of variational linear attention (``variational_linear_attention``)."""
from __future__ import annotations

import inspect

import torch

from kalmix.ops.common.cost import CHUNK, Cost, Shape, chunked, delta_fwd
from kalmix.ops.common.spec import OpSpec, randn, spd, uniform
from kalmix.ops.vla.op import _IMPLS, variational_linear_attention

LAMBDA0 = inspect.signature(variational_linear_attention).parameters["lambda0"].default     # the op's default


def _fwd(s: Shape) -> float:
    """The delta rule + the A path 2·BHT·(2CK + 2K² + C²/3)."""
    bht = s.B * s.H * s.T
    return delta_fwd(s) + 2.0 * bht * (2 * CHUNK * s.K + 2 * s.K * s.K + CHUNK * CHUNK / 3)


def _inputs(B, T, H, K, V, dtype, gen):
    """q, k, v, u: normal, [B, T, H, K] (v: V)."""
    return [randn(gen, B, T, H, K, dtype=dtype), randn(gen, B, T, H, K, dtype=dtype),
            randn(gen, B, T, H, V, dtype=dtype), randn(gen, B, T, H, K, dtype=dtype)]


def _default_state(n, H, K, V, dtype, device, kwargs):
    """S = 0, A = I / lambda0 (the call's, else the op's default), n = 0."""
    eye = torch.eye(K, dtype=dtype, device=device) / kwargs.get("lambda0", LAMBDA0)
    return (torch.zeros(n, H, K, V, dtype=dtype, device=device), eye.expand(n, H, K, K),
            torch.zeros(n, H, K, dtype=dtype, device=device))


SPEC = OpSpec(
    name="vla",
    fn=variational_linear_attention,
    impls=_IMPLS,
    state_shapes=lambda n, H, K, V: ((n, H, K, V), (n, H, K, K), (n, H, K)),      # (S, A, n)
    default_state=_default_state,
    inputs=_inputs,
    random_state=lambda n, H, K, V, dtype, gen: (randn(gen, n, H, K, V, dtype=dtype), spd(gen, n, H, K, dtype, 0.5),
                                                 uniform(gen, 0.0, 2.0, n, H, K, dtype=dtype)),
    cost=Cost(chunked(_fwd), reads=lambda s: 3 * s.K + s.V),             # q, k, u; v
    combine=None,               # A follows a Sherman–Morrison map and S's depends on A: not affine (relay only)
)
