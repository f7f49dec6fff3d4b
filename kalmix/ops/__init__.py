"""Functional ops: ``(o, final_state)`` (Kalman: ``(o, variance, final_state)``) with ``impl=`` backends."""
from kalmix.ops.gka.op import gated_kalmanet
from kalmix.ops.kaczmarz.op import kaczmarz_attention
from kalmix.ops.kalman.op import kalman_attention
from kalmix.ops.vla.op import variational_linear_attention

__all__ = ["kalman_attention", "gated_kalmanet", "kaczmarz_attention", "variational_linear_attention"]
