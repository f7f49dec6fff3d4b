"""Softmax attention baseline (PyTorch SDPA, causal, rotary positions or none) with fla's layer signature and KV
cache."""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from kalmix.layers.cache import KalmixCache
from kalmix.layers.common import check_hidden, check_layer, check_real, context_mask, head_size
from kalmix.layers.documents import Documents
from kalmix.layers.spec import MixerSpec
from kalmix.ops.common.cost import SDPA


def rotary(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate channel pairs (first half, second half) of x [B, T, H, D] by angle pos · theta^(−2i/D)."""
    D = x.shape[-1]
    dt = torch.promote_types(x.dtype, torch.float32)
    freqs = theta ** (-torch.arange(0, D // 2, device=x.device, dtype=dt) * 2 / D)
    ang = pos.to(dt)[..., None, None] * freqs                           # [B, T, 1, D/2]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.to(dt).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


@functools.cache
def _varlen_flash():
    """torch's variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``, torch ≥ 2.10) and the
    keyword arguments that make it causal (``is_causal`` in 2.10–2.11, ``window_size`` later), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal


def flash_eligible(q: torch.Tensor) -> bool:
    """Whether softmax attention over documents, context pieces or a cached context runs q [.., D] through the
    varlen flash kernel: CUDA, fp16/bf16, D ≤ 256 and a
    multiple of 8, torch ≥ 2.10. Otherwise it runs SDPA with an explicit mask (CPU, fp32)."""
    D = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and D <= 256 and D % 8 == 0
            and _varlen_flash() is not None)


def varlen_causal(q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int) -> torch.Tensor:
    """Causal flash attention over variable-length sequences laid end to end: q [Nq, H, D], k, v [Nk, H, D];
    sequence i holds queries cu_q[i]:cu_q[i + 1] and keys cu_k[i]:cu_k[i + 1] (int32 [N + 1]), its queries the
    last ones of its keys (query t sees keys ≤ t + len_k − len_q) -> [Nq, H, D]. Needs ``flash_eligible(q)``."""
    varlen_attn, causal = _varlen_flash()
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **causal)


def rows_causal(q, k, v) -> torch.Tensor:
    """q [B, T, H, D], k, v [B, S, H, D] (S ≥ T): each row's queries the last T of its S keys, causal, through
    ``varlen_causal`` -> [B, T, H, D]. Needs ``flash_eligible(q)``."""
    (B, T, H, D), S = q.shape, k.shape[1]
    rows = torch.arange(B + 1, device=q.device, dtype=torch.int32)
    return varlen_causal(q.reshape(B * T, H, D), k.reshape(B * S, H, D), v.reshape(B * S, H, D), rows * T, rows * S,
                         T, S).reshape(B, T, H, D)


class SoftmaxAttention(nn.Module):
    """Multi-head causal softmax attention with rotary position embeddings (``rope=False``: none, for a model that
    adds learned absolute positions to its tokens, ``KalmixConfig(position="learned")``).

    ``attention_mask`` [B, T] (1 = token, 0 = padding) masks padded keys; positions count real tokens only.
    With ``use_cache`` the rotated keys and the values go into a ``KalmixCache`` (one row per token written into
    buffers that grow by doubling); the mask then covers the whole context [B, S]. T = 0 gives an empty output
    [B, 0, d_model] and leaves the cache unchanged. Packed documents (``cu_seqlens`` over the flattened B·T
    tokens, every row start among them; no cache): each token attends within its own document (a block-diagonal
    causal mask) and its rotary position counts from its document's start; on CUDA in fp16/bf16 this and the
    context-split case below run torch's varlen flash kernel (``flash_eligible``), elsewhere SDPA with a mask.
    While ``context_split`` is set (a sequence split across ranks, ``kalmix.distributed.context_parallel_model``;
    no cache or mask) the call's queries attend over the keys and values all-gathered from every rank, their
    positions counted from the sequence's start, or with the model's packed documents from their document's.

    Args:
        d_model: width; num_heads: H (head size d_model / H, even with rotary embeddings); rope_theta: the rotary
        base; rope: rotate q and k (default True); bias: biases on the qkv and out projections (default False;
        the VLA notebook's attention has them, zero at init).
    """

    context_split = None        # a sequence split across ranks (kalmix.distributed.ContextSplit) or None

    def __init__(self, d_model: int, num_heads: int = 4, rope_theta: float = 10000.0, rope: bool = True,
                 bias: bool = False, layer_idx: int = 0, impl: str | None = None):
        super().__init__()
        name = type(self).__name__
        check_layer(name, d_model, layer_idx, impl)
        for arg, value in (("rope", rope), ("bias", bias)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}: `{arg}` must be True or False, got {value!r}")
        self.head_dim = head_size(name, "d_model", d_model, num_heads)
        if rope and self.head_dim % 2:
            raise ValueError(f"{name}: the head size d_model / num_heads = {d_model} / {num_heads} = {self.head_dim} "
                             f"must be even (rotary embeddings turn channel pairs; rope=False has none)")
        check_real(name, "rope_theta", rope_theta)
        self.d_model, self.num_heads = d_model, num_heads
        self.layer_idx, self.rope_theta, self.rope = layer_idx, rope_theta, rope
        self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)

    def _rotary(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, T, H, D] rotated to positions pos (``rotary``), or x itself without rotary embeddings."""
        return rotary(x, pos, self.rope_theta) if self.rope else x

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False, **kwargs):
        name = type(self).__name__
        check_hidden(name, hidden_states, self.d_model)
        context_mask(name, attention_mask, hidden_states, past_key_values, self.layer_idx)  # attends over all of it
        B, T, _ = hidden_states.shape
        if T == 0:                                          # no tokens: an empty output, the cache unchanged
            if use_cache and past_key_values is None:
                past_key_values = KalmixCache()
            return hidden_states.new_zeros(B, 0, self.d_model), None, past_key_values
        q, k, v = self.qkv_proj(hidden_states).view(B, T, 3, self.num_heads, self.head_dim).unbind(2)
        if self.context_split is not None:
            if kwargs.get("cu_seqlens") is not None:
                raise ValueError("SoftmaxAttention: under context parallelism packed documents come from the model "
                                 "(`cu_seqlens` or `position_ids` passed to it), not as a layer's `cu_seqlens`")
            return self._split(q, k, v, kwargs.get("documents")), None, None
        docs = Documents.of_layer_call(name, kwargs, hidden_states, attention_mask, past_key_values, use_cache)
        if docs is not None:
            return self._documents(q, k, v, docs), None, None
        if (past_key_values is not None and past_key_values.static and T == 1 and use_cache
                and "kv" in (past_key_values.get(self.layer_idx) or {})):
            return self._static_step(q, k, v, past_key_values), None, past_key_values
        start = past_key_values.get_seq_length(self.layer_idx) if past_key_values is not None else 0
        S = start + T
        if attention_mask is not None:
            pos = (attention_mask.long().cumsum(1) - 1).clamp_min(0)[:, -T:]
        else:
            pos = torch.arange(start, S, device=q.device).expand(B, T)
        q, k = self._rotary(q, pos), self._rotary(k, pos)
        if use_cache and past_key_values is None:
            past_key_values = KalmixCache()
        if past_key_values is not None:
            k, v = past_key_values.context_kv(self.layer_idx, k, v, store=use_cache)
        if attention_mask is None and 0 < start and T > 1 and flash_eligible(q):    # chunked prefill
            return self.o_proj(rows_causal(q, k, v).reshape(B, T, self.d_model)), None, past_key_values
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if attention_mask is None and start == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif attention_mask is None and T == 1:
            o = F.scaled_dot_product_attention(q, k, v)                  # one query sees the whole context
        else:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(start)[None, None]
            if attention_mask is not None:
                own = torch.zeros(T, S, dtype=torch.bool, device=q.device)
                own[torch.arange(T), start + torch.arange(T)] = True      # padded queries see themselves (no NaN)
                mask = (mask & attention_mask.bool()[:, None, None, :]) | own
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.d_model)), None, past_key_values

    def _documents(self, q, k, v, docs: Documents) -> torch.Tensor:
        """Attention within each packed document, rotary positions from ``docs.doc_pos``: the varlen flash kernel
        over the documents (``flash_eligible``), else SDPA with a block-diagonal causal mask [B, 1, T, T]."""
        B, T, H, D = q.shape
        q, k = self._rotary(q, docs.doc_pos), self._rotary(k, docs.doc_pos)
        if flash_eligible(q):
            flat = (B * T, H, D)
            o = varlen_causal(q.reshape(flat), k.reshape(flat), v.reshape(flat), docs.cu_seqlens, docs.cu_seqlens,
                              docs.max_len, docs.max_len)
            return self.o_proj(o.reshape(B, T, self.d_model))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=docs.attention_mask())
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.d_model))

    def _split(self, q, k, v, docs=None) -> torch.Tensor:
        """This rank's piece of a split sequence: q, k, v [B, T, H, D] of the piece; its queries over the keys and
        values of every rank up to its own (all-gathered, the later ranks' dropped: [B, S, H, D], S = start + T),
        rotary positions counted from the sequence's start and the causal mask offset by ``start``: the varlen
        flash kernel with each row's queries the last T of its S keys (``flash_eligible``), else SDPA with the
        offset mask. With packed documents ``docs`` (``kalmix.distributed.model.PieceDocuments``) each query
        sees its own document's keys only and positions count from its document's start: the kernel runs over
        the piece's document segments, each with its document's keys up to the piece's end (``docs.keys``)."""
        B, T, H, D = q.shape
        kv, start = self.context_split.gather(torch.cat([k, v], -1))
        S = start + T                                   # the later pieces' keys are never attended
        k, v = kv[:, :S].chunk(2, -1)
        if docs is None:
            q_pos, k_pos = torch.arange(start, S, device=q.device).expand(B, T), torch.arange(S, device=q.device)
        else:
            q_pos, k_pos = docs.doc_pos, docs.key_pos
        q, k = self._rotary(q, q_pos), self._rotary(k, k_pos.expand(B, S))
        if flash_eligible(q):
            if docs is None:
                o = rows_causal(q, k, v)
            else:
                k, v = k.reshape(B * S, H, D)[docs.keys], v.reshape(B * S, H, D)[docs.keys]
                o = varlen_causal(q.reshape(B * T, H, D), k, v, docs.cu_seqlens, docs.cu_keys, docs.max_len,
                                  docs.max_keys)
            return self.o_proj(o.reshape(B, T, self.d_model))
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(start)
        if docs is not None:                            # [B, 1, T, S]: within each query's document
            mask = (mask & (docs.key_doc[:, start:, None] == docs.key_doc[:, None, :]))[:, None]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.d_model))

    def _static_step(self, q, k, v, cache: KalmixCache) -> torch.Tensor:
        """One token against a static cache, with no host value: the row, the rotary position and the visible
        rows all come from the cache's device tensors, so the step can be captured in a CUDA graph and replayed
        at every position. Attends over the whole buffer with the unwritten rows masked."""
        B = q.shape[0]
        pos = (cache.position - cache.pad_count)[:, None]                # [B, 1]
        q, k = self._rotary(q, pos), self._rotary(k, pos)
        kb, vb, visible = cache.write_kv_at_position(self.layer_idx, k, v)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                           attn_mask=visible[:, None, None, :])
        return self.o_proj(o.transpose(1, 2).reshape(B, 1, self.d_model))

    def state_size(self, context: int = 1) -> int:
        """Elements carried per sequence while decoding: the KV cache, 2 · d_model per token of ``context``."""
        return 2 * self.d_model * context


MIXER_SPECS = (MixerSpec("attention", SoftmaxAttention, lambda layer: (layer.num_heads, layer.head_dim, layer.head_dim),
                         {"heads": "num_heads"}, cost=SDPA, headline=True),)
