"""Language models built from kalmix layers."""
from kalmix.models.lm import MixerLM

__all__ = ["MixerLM"]
