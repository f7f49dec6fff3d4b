"""Functional ops: ``(o, final_state)`` (Kalman: ``(o, variance, final_state)``) with ``impl=`` backends."""
from kalmix.ops.gka import op as _gka
from kalmix.ops.gka.op import gated_kalmanet
from kalmix.ops.kaczmarz import op as _kaczmarz
from kalmix.ops.kaczmarz.op import kaczmarz_attention
from kalmix.ops.kalman import op as _kalman
from kalmix.ops.kalman.op import kalman_attention
from kalmix.ops.vla import op as _vla
from kalmix.ops.vla.op import variational_linear_attention

# the impls each op has in this version (impl=None resolves to one of these or raises)
AVAILABLE_IMPLS = {m._OP: tuple(m._IMPLS) for m in (_kalman, _gka, _kaczmarz, _vla)}

__all__ = ["kalman_attention", "gated_kalmanet", "kaczmarz_attention", "variational_linear_attention",
           "AVAILABLE_IMPLS"]
