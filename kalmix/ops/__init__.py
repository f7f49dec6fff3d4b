"""Functional ops: ``(o, final_state)`` (Kalman: ``(o, variance, final_state)``) with ``impl=`` backends."""
import torch

from kalmix.ops.common.checks import device_refusal
from kalmix.ops.gka import op as _gka
from kalmix.ops.gka.op import gated_kalmanet
from kalmix.ops.gla import op as _gla
from kalmix.ops.gla.op import gated_linear_attention
from kalmix.ops.kaczmarz import op as _kaczmarz
from kalmix.ops.kaczmarz.op import kaczmarz_attention
from kalmix.ops.kalman import op as _kalman
from kalmix.ops.kalman.op import kalman_attention
from kalmix.ops.value_delta import op as _value_delta
from kalmix.ops.value_delta.op import value_gated_delta_rule
from kalmix.ops.vla import op as _vla
from kalmix.ops.vla.op import variational_linear_attention

# the impls each op has in this version (impl=None resolves to one of these or raises)
AVAILABLE_IMPLS = {m._OP: tuple(m._IMPLS) for m in (_kalman, _gka, _kaczmarz, _vla, _gla, _value_delta)}


def runnable_impls(op: str, device: torch.device) -> tuple[str, ...]:
    """The impls of ``op`` that run on ``device``: on CPU, "triton" only under TRITON_INTERPRET=1."""
    return tuple(i for i in AVAILABLE_IMPLS[op] if device_refusal(i, device) is None)


__all__ = ["kalman_attention", "gated_kalmanet", "kaczmarz_attention", "variational_linear_attention",
           "gated_linear_attention", "value_gated_delta_rule", "AVAILABLE_IMPLS", "runnable_impls"]
