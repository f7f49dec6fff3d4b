"""kalmix: sequence mixers that treat attention as online least squares / Bayesian filtering."""
from kalmix.ops import gated_kalmanet, kaczmarz_attention, kalman_attention, variational_linear_attention

__version__ = "0.1.0"
__all__ = ["kalman_attention", "gated_kalmanet", "kaczmarz_attention", "variational_linear_attention"]
