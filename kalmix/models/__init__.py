"""Hugging Face-native causal LMs over any per-layer mix of kalmix mixers, registered with the Auto classes."""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from kalmix.layers.cache import KalmixCache
from kalmix.models.configuration import KalmixConfig, layer_pattern
from kalmix.models.modeling import KalmixForCausalLM, KalmixModel, KalmixPreTrainedModel

AutoConfig.register("kalmix", KalmixConfig, exist_ok=True)
AutoModel.register(KalmixConfig, KalmixModel, exist_ok=True)
AutoModelForCausalLM.register(KalmixConfig, KalmixForCausalLM, exist_ok=True)

__all__ = ["KalmixConfig", "KalmixModel", "KalmixForCausalLM", "KalmixPreTrainedModel", "KalmixCache",
           "layer_pattern"]
