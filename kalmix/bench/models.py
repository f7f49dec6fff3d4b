"""The training FLOPs of a whole model: its linear layers and each mixer's op under its cost model
(``kalmix.ops.common.cost``; the op's from its spec, SDPA's for softmax attention, the delta rule's for fla's
DeltaNet)."""
from __future__ import annotations

import torch.nn as nn

from kalmix.layers import MIXER_SPECS


def lm_flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of a ``KalmixForCausalLM`` on rows of ``seq_len`` tokens:
    6 per weight of every linear layer (the LM head included, the embedding lookup not) plus each mixer's op
    (``MixerSpec.flops``: B = 1, T = seq_len) divided by seq_len. Attention counts the whole causal triangle of
    a row, as if it held one document."""
    flops = 6.0 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    for block in model.model.layers:
        flops += MIXER_SPECS[block.mixer_type].flops(block.mixer, seq_len) / seq_len
    return flops
