"""kalmix: sequence mixers that treat attention as online least squares / Bayesian filtering.

Importing kalmix registers ``KalmixConfig`` / ``KalmixModel`` / ``KalmixForCausalLM`` with transformers'
``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM`` (model_type "kalmix")."""
from kalmix.ops import gated_kalmanet, kaczmarz_attention, kalman_attention, variational_linear_attention
from kalmix.models import KalmixConfig, KalmixForCausalLM, KalmixModel

__version__ = "0.1.0"
__all__ = ["kalman_attention", "gated_kalmanet", "kaczmarz_attention", "variational_linear_attention",
           "KalmixConfig", "KalmixModel", "KalmixForCausalLM"]
