"""Functional ops: ``(o, final_state)`` (Kalman: ``(o, variance, final_state)``) with ``impl=`` backends.

``SPECS`` maps each op's name to its ``OpSpec`` (``kalmix.ops.common.spec``): its impls, state layout, context-
parallel rule, cost model, decoding step and test inputs, declared beside its code in ``kalmix/ops/<op>/spec.py``.
"""
from kalmix.ops.common.spec import OpSpec
from kalmix.ops.gka.op import gated_kalmanet
from kalmix.ops.gka.spec import SPEC as GKA
from kalmix.ops.gla.op import gated_linear_attention
from kalmix.ops.gla.spec import SPEC as GLA
from kalmix.ops.kaczmarz.op import kaczmarz_attention
from kalmix.ops.kaczmarz.spec import SPEC as KACZMARZ
from kalmix.ops.kalman.op import kalman_attention
from kalmix.ops.kalman.spec import SPEC as KALMAN
from kalmix.ops.value_delta.op import value_gated_delta_rule
from kalmix.ops.value_delta.spec import SPEC as VALUE_DELTA
from kalmix.ops.vla.op import variational_linear_attention
from kalmix.ops.vla.spec import SPEC as VLA

SPECS: dict[str, OpSpec] = {spec.name: spec for spec in (KALMAN, GKA, KACZMARZ, VLA, GLA, VALUE_DELTA)}

__all__ = ["kalman_attention", "gated_kalmanet", "kaczmarz_attention", "variational_linear_attention",
           "gated_linear_attention", "value_gated_delta_rule", "OpSpec", "SPECS"]
