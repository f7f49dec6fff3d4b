"""fla's public layers as kalmix mixers (the field's baselines beside kalmix's own)."""
from __future__ import annotations

import torch
import torch.nn as nn

from kalmix.layers.documents import Documents


class FlaDeltaNet(nn.Module):
    """fla's ``DeltaNet`` layer (ungated delta rule, short convolutions, L2-normalised q and k, output RMSNorm),
    with kalmix's layer signature; its cache entries live in the model's ``KalmixCache``.

    CUDA only: fla's Triton ops do not run on CPU, nor in Triton's interpreter. fla trains it on Hopper with
    triton 3.6 (its ungated chunk backward is not among the ones it refuses there). fla's gated layers (GLA,
    Gated DeltaNet, Mamba-2) are not offered: fla refuses their backward on Hopper with triton < 3.7.1; kalmix's
    ``gdn`` mixer is Gated DeltaNet on kalmix's own kernels.

    Args:
        d_model: width; num_heads: H (K = V = d_model / H); conv_size: short-convolution width; use_gate: fla's
        output gate.
    """

    def __init__(self, d_model: int, num_heads: int = 4, conv_size: int = 4, use_gate: bool = False,
                 layer_idx: int = 0, impl: str | None = None):
        super().__init__()
        from fla.layers import DeltaNet
        if impl not in (None, "triton"):
            raise ValueError(f"FlaDeltaNet runs fla's Triton kernels; impl must be None or 'triton', got {impl!r}")
        self.d_model, self.num_heads, self.layer_idx = d_model, num_heads, layer_idx
        self.inner = DeltaNet(hidden_size=d_model, num_heads=num_heads, conv_size=conv_size, use_gate=use_gate,
                              layer_idx=layer_idx)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, **kwargs):
        if not hidden_states.is_cuda:
            raise ValueError(f"FlaDeltaNet runs fla's Triton kernels, which need CUDA tensors; got "
                             f"{hidden_states.device}. On CPU use kalmix's mixers (e.g. 'gdn', 'kaczmarz')")
        docs = Documents.of_layer_call(type(self).__name__, kwargs, *hidden_states.shape[:2], attention_mask,
                                       past_key_values, use_cache)
        if docs is not None:                            # fla's packed layout: [1, total] with cu_seqlens
            o, _, _ = self.inner(docs.pack(hidden_states), cu_seqlens=docs.cu_seqlens.long())
            return docs.unpack(o), None, None
        return self.inner(hidden_states, attention_mask=attention_mask, past_key_values=past_key_values,
                          use_cache=use_cache)

    def state_size(self) -> int:
        """Recurrent-state elements per sequence: S [H, K, V] (conv buffers not counted)."""
        return self.d_model ** 2 // self.num_heads
