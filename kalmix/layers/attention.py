"""Softmax attention baseline (PyTorch SDPA, causal, rotary positions) with fla's layer signature and KV cache."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kalmix.layers.common import check_hidden, layer_cache, new_cache


def rotary(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate channel pairs (first half, second half) of x [B, T, H, D] by angle pos · theta^(−2i/D)."""
    D = x.shape[-1]
    freqs = theta ** (-torch.arange(0, D // 2, device=x.device, dtype=torch.float32) * 2 / D)
    ang = pos.float()[..., None, None] * freqs                          # [B, T, 1, D/2]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class SoftmaxAttention(nn.Module):
    """Multi-head causal softmax attention with rotary position embeddings.

    ``attention_mask`` [B, T] (1 = token, 0 = padding) masks padded keys; positions count real tokens only.
    Decoding keeps (k, v) [B, S, H, D] in the fla ``Cache``.
    """

    def __init__(self, d_model: int, num_heads: int = 4, rope_theta: float = 10000.0, layer_idx: int = 0,
                 impl: str | None = None):
        super().__init__()
        if d_model % num_heads or (d_model // num_heads) % 2:
            raise ValueError(f"SoftmaxAttention: d_model = {d_model} must split into {num_heads} heads of even size")
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.layer_idx, self.rope_theta = layer_idx, rope_theta
        self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False, **kwargs):
        check_hidden(type(self).__name__, hidden_states, self.d_model, None)
        B, T, _ = hidden_states.shape
        q, k, v = self.qkv_proj(hidden_states).view(B, T, 3, self.num_heads, self.head_dim).unbind(2)
        last = layer_cache(past_key_values, self.layer_idx)
        past = last["attn_state"] if last else None
        start = past[0].shape[1] if past is not None else 0
        S = start + T
        if attention_mask is not None:
            if attention_mask.shape != (B, S):
                raise ValueError(f"SoftmaxAttention: `attention_mask` must cover the whole context [B, S] = "
                                 f"{[B, S]}, got {list(attention_mask.shape)}")
            pos = (attention_mask.long().cumsum(1) - 1).clamp_min(0)[:, -T:]
        else:
            pos = torch.arange(start, S, device=q.device).expand(B, T)
        q, k = rotary(q, pos, self.rope_theta), rotary(k, pos, self.rope_theta)
        if use_cache:
            if past_key_values is None:
                past_key_values = new_cache()
            past_key_values.update(attn_state=(k, v), layer_idx=self.layer_idx, offset=T)
        if past is not None:
            k, v = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1)
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(start)[None, None]
        if attention_mask is not None:
            own = torch.zeros(T, S, dtype=torch.bool, device=q.device)
            own[torch.arange(T), start + torch.arange(T)] = True          # padded queries see themselves (no NaN)
            mask = (mask & attention_mask.bool()[:, None, None, :]) | own
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.d_model)), None, past_key_values

    def state_size(self, context: int = 1) -> int:
        """Elements carried per sequence while decoding: the KV cache, 2 · d_model per token of ``context``."""
        return 2 * self.d_model * context
