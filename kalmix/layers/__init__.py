"""Drop-in mixer layers with fla's ``forward(hidden_states, attention_mask, past_key_values, use_cache)``.

``MIXER_SPECS`` maps each mixer's name to its ``MixerSpec`` (``kalmix.layers.spec``), declared beside its layer
class; ``MIXERS`` (kalmix's own), ``BASELINES`` (fla's, CUDA only) and ``ALL_MIXERS`` map the names to the classes.
"""
from kalmix.layers import attention, baselines, gka, kaczmarz, kalman, vla
from kalmix.layers.attention import SoftmaxAttention
from kalmix.layers.baselines import FlaDeltaNet, GatedLinearAttention, LinearAttention, Mamba2, NotebookDeltaNet
from kalmix.layers.gka import GatedKalmaNet
from kalmix.layers.kaczmarz import GatedDeltaNet, KaczmarzAttention
from kalmix.layers.kalman import KalmanAttention
from kalmix.layers.spec import MixerSpec
from kalmix.layers.vla import VariationalLinearAttention

MIXER_SPECS: dict[str, MixerSpec] = {spec.name: spec for module in (attention, kaczmarz, gka, vla, kalman, baselines)
                                     for spec in module.MIXER_SPECS}
MIXERS = {name: spec.layer for name, spec in MIXER_SPECS.items() if spec.requires is None}
# fla's public layers (CUDA only), which models may mix with the above
BASELINES = {name: spec.layer for name, spec in MIXER_SPECS.items() if spec.requires is not None}
ALL_MIXERS = {name: spec.layer for name, spec in MIXER_SPECS.items()}

__all__ = ["KalmanAttention", "GatedKalmaNet", "KaczmarzAttention", "VariationalLinearAttention", "GatedDeltaNet",
           "SoftmaxAttention", "LinearAttention", "GatedLinearAttention", "Mamba2", "NotebookDeltaNet", "FlaDeltaNet",
           "MixerSpec", "MIXER_SPECS", "MIXERS", "BASELINES", "ALL_MIXERS"]
