"""Drop-in mixer layers with fla's ``forward(hidden_states, attention_mask, past_key_values, use_cache)``."""
from kalmix.layers.attention import SoftmaxAttention
from kalmix.layers.baselines import FlaDeltaNet, GatedLinearAttention, LinearAttention, Mamba2, NotebookDeltaNet
from kalmix.layers.gka import GatedKalmaNet
from kalmix.layers.kaczmarz import GatedDeltaNet, KaczmarzAttention
from kalmix.layers.kalman import KalmanAttention
from kalmix.layers.vla import VariationalLinearAttention

MIXERS = {
    "attention": SoftmaxAttention,
    "gdn": GatedDeltaNet,
    "kaczmarz": KaczmarzAttention,
    "gka": GatedKalmaNet,
    "vla": VariationalLinearAttention,
    "kalman": KalmanAttention,
    "linear_attention": LinearAttention,
    "gla": GatedLinearAttention,
    "mamba2": Mamba2,
    "notebook_deltanet": NotebookDeltaNet,
}
# fla's public layers (CUDA only), which models may mix with the above
BASELINES = {"deltanet": FlaDeltaNet}
ALL_MIXERS = {**MIXERS, **BASELINES}

__all__ = ["KalmanAttention", "GatedKalmaNet", "KaczmarzAttention", "VariationalLinearAttention", "GatedDeltaNet",
           "SoftmaxAttention", "LinearAttention", "GatedLinearAttention", "Mamba2", "NotebookDeltaNet", "FlaDeltaNet",
           "MIXERS", "BASELINES", "ALL_MIXERS"]
