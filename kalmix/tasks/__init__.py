"""Synthetic task generators: pure functions of (config, seed) returning (inputs, labels) LongTensors."""
from kalmix.tasks.mqar import MQARConfig

__all__ = ["MQARConfig"]
