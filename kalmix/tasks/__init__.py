"""Synthetic task generators: pure functions of (config, seed) returning (inputs, labels) LongTensors [N, T], the
logits at position t scored against labels[t] (−100: not scored)."""
from kalmix.tasks.mad import (CompressionConfig, FuzzyRecallConfig, InContextRecallConfig, MemorizationConfig,
                              NoisyRecallConfig, SelectiveCopyingConfig, macro_micro_accuracy)
from kalmix.tasks.mqar import MQARConfig
from kalmix.tasks.recall import CapacityMQARConfig, HardMQARConfig, NeedleConfig, PalindromeConfig, StackConfig
from kalmix.tasks.state_tracking import WordProblemConfig, sequence_accuracy, token_accuracy

__all__ = ["MQARConfig", "HardMQARConfig", "CapacityMQARConfig", "NeedleConfig", "PalindromeConfig", "StackConfig",
           "WordProblemConfig", "InContextRecallConfig", "NoisyRecallConfig", "FuzzyRecallConfig",
           "SelectiveCopyingConfig", "CompressionConfig", "MemorizationConfig", "macro_micro_accuracy",
           "sequence_accuracy", "token_accuracy"]
