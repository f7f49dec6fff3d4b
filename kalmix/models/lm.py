"""A small causal language model: embedding, pre-RMSNorm residual blocks of [mixer, optional SwiGLU], LM head."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kalmix.layers import MIXERS


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, d_model: int, mixer: nn.Module, mlp: bool):
        super().__init__()
        self.mixer_norm, self.mixer = nn.RMSNorm(d_model, eps=1e-5), mixer
        self.mlp_norm = nn.RMSNorm(d_model, eps=1e-5) if mlp else None
        self.mlp = SwiGLU(d_model, 4 * d_model * 2 // 3) if mlp else None

    def forward(self, x, attention_mask=None, past_key_values=None, use_cache=False):
        h, _, past_key_values = self.mixer(self.mixer_norm(x), attention_mask=attention_mask,
                                           past_key_values=past_key_values, use_cache=use_cache)
        x = x + h
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x))
        return x, past_key_values


class MixerLM(nn.Module):
    """Causal LM with ``n_layers`` blocks of one mixer kind.

    Args:
        vocab_size, d_model, n_layers: sizes; mixer: a key of ``kalmix.layers.MIXERS``;
        mixer_kwargs: passed to every mixer; mlp: add a SwiGLU after each mixer; impl: the mixers' op backend.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, mixer: str, mixer_kwargs: dict | None = None,
                 mlp: bool = False, impl: str | None = None):
        super().__init__()
        if mixer not in MIXERS:
            raise ValueError(f"MixerLM: unknown mixer {mixer!r}; expected one of {sorted(MIXERS)}")
        kw = dict(mixer_kwargs or {})
        if mixer != "attention":
            kw["impl"] = impl
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, MIXERS[mixer](d_model, layer_idx=i, **kw), mlp) for i in range(n_layers))
        self.norm = nn.RMSNorm(d_model, eps=1e-5)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, past_key_values=None,
                use_cache: bool = False):
        """input_ids [B, T] -> (logits [B, T, vocab], past_key_values)."""
        x = self.embed(input_ids)
        for block in self.blocks:
            x, past_key_values = block(x, attention_mask, past_key_values, use_cache)
        return self.lm_head(self.norm(x)), past_key_values

    def state_size(self) -> int:
        """Recurrent-state elements per sequence across all layers (attention: per token of context)."""
        return sum(b.mixer.state_size() for b in self.blocks)
