"""``KalmixModel`` / ``KalmixForCausalLM``: transformers causal LMs over any per-layer mix of kalmix mixers.

Blocks are pre-norm: ``x + mixer(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))`` (``config.norm``: LayerNorm;
``config.mlp_act``: a GELU MLP). ``config.position="learned"`` adds a learned absolute position embedding to the
token embeddings. Initialisation: every linear
weight ~ N(0, σ²) with σ = 1/√(3·fan_in), the variance of torch's default ``nn.Linear`` init (or σ =
``initializer_range`` when set), the token and position embeddings ~ N(0, 1/hidden_size)
(or ``initializer_range``, or ``embedding_init_std``), biases zero, norm weights one; the projections that write into the residual stream
(each mixer's output projection and the MLP's down projection) have σ / √(2 · num_hidden_layers) (GPT-2's
scaling, unless ``config.residual_init_scale`` is False); each mixer's own parameters (decays, Δ, process noise,
short convolutions, skip, gate biases) keep the initialisation of its paper that the layer sets.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from kalmix.layers import ALL_MIXERS as MIXERS
from kalmix.layers.base import MixerLayer
from kalmix.layers.cache import KalmixCache
from kalmix.layers.common import (check_mask, check_mask_values, describe, fused_kernels, is_integer, recompute, require,
                                  runs_fused, upcast)
from kalmix.layers.documents import Documents
from kalmix.models.configuration import KalmixConfig
from kalmix.models.decoding import check_sampling
from kalmix.models.loss import linear_cross_entropy

_RESIDUAL_OUT = ("o_proj", "out_proj", "down")
_MEAN_DECODING = "set config.mc_samples = 0 to decode with the posterior-mean readout"


def mc_marginal(logits: torch.Tensor, samples: int) -> torch.Tensor:
    """Logits [S·B, ..., V] of S posterior samples (sample-major) -> the log of their Monte-Carlo marginal,
    log (1/S) Σ_s softmax(logits_s), [B, ..., V] in fp32 or wider: KLA+'s readout, whose cross-entropy is Eq. 25."""
    return torch.logsumexp(F.log_softmax(upcast(logits), -1).unflatten(0, (samples, -1)), 0) - math.log(samples)
# the outputs' cache field: ``cache`` from transformers 5.24 on, ``past_key_values`` before
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) · up(x))``, gate and up as one [d, 2·hidden] projection; silu(gate) is recomputed in the
    backward rather than saved (``recompute``)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(recompute(_silu_mul, gate, up))


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class GeluMLP(nn.Module):
    """``down(GELU(up(x)))`` with biases: GPT-2's MLP (exact GELU)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose forward on CUDA is one Triton kernel each way (``kalmix.layers.fused.rms_norm``:
    computed in fp32, returned in x's dtype, keeping x and a rstd per row for the backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if runs_fused(x) and self.weight is not None and self.eps is not None:
            return fused_kernels().rms_norm(x, self.weight, None, self.eps)
        return super().forward(x)


def make_norm(config: KalmixConfig) -> nn.Module:
    """The block and final norm ``config.norm`` over hidden_size: ``RMSNorm`` or nn.LayerNorm (with bias)."""
    cls = nn.LayerNorm if config.norm == "layernorm" else RMSNorm
    return cls(config.hidden_size, eps=config.norm_eps)


class KalmixBlock(nn.Module):
    """Pre-norm residual block: mixer, then (unless ``config.mlp`` is False) an MLP (``config.mlp_act``)."""

    def __init__(self, config: KalmixConfig, layer_idx: int):
        super().__init__()
        d = config.hidden_size
        self.mixer_type = config.mixers[layer_idx]
        self.mixer_norm = make_norm(config)
        self.mixer = MIXERS[self.mixer_type](d, **config.layer_kwargs(layer_idx))
        if isinstance(self.mixer, MixerLayer):
            self.mixer.recompute = config.recompute_mixers
        self.mlp_norm = make_norm(config) if config.mlp else None
        mlp = GeluMLP if config.mlp_act == "gelu" else SwiGLU
        self.mlp = mlp(d, config.intermediate_size) if config.mlp else None
        for name in _RESIDUAL_OUT:                  # the projections that write into the residual stream
            for owner in (self.mixer, self.mlp):
                if isinstance(getattr(owner, name, None), nn.Linear):
                    getattr(owner, name)._residual_out = True

    def forward(self, x, attention_mask=None, cache=None, use_cache=False, documents=None, sample_readout=False):
        extra = {} if documents is None else {"documents": documents}
        if sample_readout and self.mixer_type == "kalman":
            extra["sample_readout"] = True
        h, _, cache = self.mixer(self.mixer_norm(x), attention_mask=attention_mask, past_key_values=cache,
                                 use_cache=use_cache, **extra)
        x = x + h
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x))
        return x, cache


class KalmixPreTrainedModel(PreTrainedModel):
    config_class = KalmixConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KalmixBlock"]
    _supports_cache_class = False
    _is_stateful = True
    context_split = None        # a sequence split across ranks (kalmix.distributed.context_parallel_model) or None

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """The model makes its own ``KalmixCache`` (recurrent states do not fit transformers' KV caches)."""
        return False

    def _init_weights(self, module: nn.Module):
        fixed = self.config.initializer_range
        if isinstance(module, nn.Linear):
            std = fixed if fixed is not None else (3 * module.in_features) ** -0.5
            if getattr(module, "_residual_out", False) and self.config.residual_init_scale:
                std = std / math.sqrt(2 * self.config.num_hidden_layers)
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            std = self.config.embedding_init_std
            if std is None:
                std = fixed if fixed is not None else module.embedding_dim ** -0.5
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (nn.RMSNorm, nn.LayerNorm)) and module.weight is not None:
            init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)


class KalmixModel(KalmixPreTrainedModel):
    """Embedding (and learned positions with ``config.position="learned"``), ``num_hidden_layers`` blocks of the
    configured mixers, final norm."""

    def __init__(self, config: KalmixConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(KalmixBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: KalmixCache | None = None, past_key_values: KalmixCache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                documents: Documents | None = None, sample_readout: bool = False,
                **kwargs) -> BaseModelOutputWithPast | tuple:
        """input_ids [B, T] (or inputs_embeds [B, T, d]); attention_mask [B, T] or, with a cache, [B, S] over the
        whole context (1 = token, 0 = padding); cache: a ``KalmixCache`` to continue from (``past_key_values``
        is the same argument under transformers' older name).

        Packed documents (training on rows that hold several documents; no cache, no padding mask): either
        ``cu_seqlens`` [N + 1], document offsets into the flattened B·T tokens with every row start among them
        (fla's keyword; B = 1 is its packed layout), or ``position_ids`` [B, T], each token's position in its
        document with 0 starting one (transformers' padding-free convention). No recurrent state, convolution
        input or attention crosses a document boundary, and attention's rotary positions restart at each. Either is
        checked once per forward, with one host read on any device, into the ``Documents`` every layer shares (the
        rule: ``kalmix.ops.common.varlen``; equal offsets are an empty document, which holds no token).

        ``sample_readout``: every Kalman layer reads out one sample of its posterior instead of the mean (KLA+;
        see ``KalmanAttention`` and ``KalmixConfig.mc_samples``).

        Inside ``kalmix.distributed.context_parallel_model`` the input is this rank's piece of a sequence split
        across ranks: no cache (``use_cache`` defaults to False), padding, gradient checkpointing or
        ``recompute_mixers`` with gradients; packed
        documents as ``cu_seqlens`` of the whole batch [B, S] or ``position_ids`` of the piece (see
        ``context_parallel_model``).

        Bad inputs are ValueErrors naming the argument. Types, shapes, dtypes and devices are checked on every
        device for free (the mask is [B, T], or [B, P + T] with a cache holding P tokens). Values (ids in
        [0, vocab_size), mask values 0 and 1, finite inputs_embeds) are read on the host for CPU tensors; on CUDA
        they cost no host sync: a device-side assertion (``torch._assert_async``) each, which fails at the next
        synchronisation with a device-side assert error (the same inputs on CPU give the named error)."""
        unknown = set(kwargs) - {"cache_position", "output_attentions"}
        if unknown:
            raise TypeError(f"KalmixModel.forward got unexpected argument(s) {sorted(unknown)}")
        if kwargs.get("output_attentions"):
            raise ValueError("KalmixModel: `output_attentions` is not supported (most mixers have no attention map)")
        _, cache = self._check_inputs("KalmixModel", input_ids, inputs_embeds, attention_mask, cache, past_key_values)
        self._check_values(input_ids, inputs_embeds, attention_mask)
        if sample_readout and "kalman" not in self.config.mixers:
            raise ValueError("KalmixModel: `sample_readout` samples the readout of Kalman layers; the model has none")
        packed = position_ids is not None or cu_seqlens is not None or documents is not None
        if use_cache is None and (packed or self.context_split is not None):
            use_cache = False                   # packed documents are scored, a split sequence too: not continued
        use_cache = self.config.use_cache if use_cache is None and not self.training else bool(use_cache)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            if cache is not None:
                raise ValueError("KalmixModel: gradient checkpointing (training with gradients) recomputes each block "
                                 "without a cache; pass no `cache` / `past_key_values`, or run in eval mode or "
                                 "under torch.no_grad()")
            use_cache = False
        if use_cache and cache is None:
            cache = KalmixCache()
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        docs = self._documents(x, position_ids, cu_seqlens, documents, attention_mask, cache, use_cache)
        attn_mask, rec_mask = self._layer_masks(attention_mask, x, cache)
        if self.context_split is not None:
            refused = {"a cache": cache is not None, "padding": attn_mask is not None or rec_mask is not None,
                       "an empty piece": x.shape[1] == 0,
                       "gradient checkpointing": self.gradient_checkpointing and self.training
                       and torch.is_grad_enabled(),
                       "recompute_mixers": torch.is_grad_enabled() and any(
                           getattr(block.mixer, "recompute", False) for block in self.layers)}
            if any(refused.values()):
                raise ValueError(f"KalmixModel: a context-parallel forward (kalmix.distributed.context_parallel_model) "
                                 f"takes a plain batch of at least one token per rank and no cache; got "
                                 f"{', '.join(k for k, v in refused.items() if v)}")
        static = cache is not None and cache.static and use_cache
        if static:
            cache.advance(0, x.device, x.shape[0])
            if x.shape[1] > 1 and attention_mask is not None:
                cache.mark_padding(attention_mask[:, -x.shape[1]:], cache.get_seq_length())
        if self.config.position == "learned":
            x = x + self.embed_positions(self._positions(x, attention_mask, cache, docs))
        hidden = [] if output_hidden_states else None
        for block in self.layers:
            if hidden is not None:
                hidden.append(x)
            mask = attn_mask if block.mixer_type == "attention" else rec_mask
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x, _ = self._gradient_checkpointing_func(block.__call__, x, mask, None, False, docs, sample_readout)
            else:
                x, cache = block(x, mask, cache, use_cache, docs, sample_readout)
        if static:
            cache.advance(x.shape[1], x.device, x.shape[0])
        x = self.norm(x)
        if hidden is not None:
            hidden.append(x)
            hidden = tuple(hidden)
        out_cache = cache if use_cache else None
        if return_dict is False:
            return tuple(v for v in (x, out_cache, hidden) if v is not None)
        return BaseModelOutputWithPast(last_hidden_state=x, hidden_states=hidden, **{_CACHE_FIELD: out_cache})

    def _positions(self, x, attention_mask, cache, docs) -> torch.Tensor:
        """The learned position embedding's rows [B or 1, T] for this call's tokens, counted as attention counts
        them: within each packed document; from the piece's start under context parallelism; from the sequence's
        real tokens under a padding mask (over the whole context with a cache); from the tokens a cache has seen.
        A ValueError when they could pass ``max_position_embeddings`` (a bound known on the host: no sync)."""
        T = x.shape[1]
        if docs is not None:                        # a context piece's documents may continue from earlier pieces
            pos = docs.doc_pos
            longest = docs.start + T if hasattr(docs, "start") else docs.max_len
        elif self.context_split is not None:
            split = self.context_split
            start = sum(split.lengths(T, x.device)[:split.rank])
            pos, longest = torch.arange(start, start + T, device=x.device)[None], start + T
        elif cache is not None and cache.static and T == 1 and cache.position is not None:
            pos, longest = (cache.position - cache.pad_count)[:, None], cache.capacity
        elif attention_mask is not None:
            pos, longest = (attention_mask.long().cumsum(1) - 1).clamp_min(0)[:, -T:], attention_mask.shape[1]
        else:
            start = cache.get_seq_length() if cache is not None else 0
            pos, longest = torch.arange(start, start + T, device=x.device)[None], start + T
        rows = self.config.max_position_embeddings
        if longest > rows:
            raise ValueError(f"KalmixModel: this call can reach position {longest - 1}, but the learned position "
                             f"embedding has max_position_embeddings = {rows} rows (positions 0 to {rows - 1}); "
                             f"feed shorter sequences or build the model with more")
        return pos

    def _check_inputs(self, name: str, input_ids, inputs_embeds, attention_mask, cache, past_key_values):
        """The checks of a forward's inputs that read no tensor (types, shapes, dtypes, devices), so cost nothing
        on any device; returns (the input: input_ids or inputs_embeds, the cache: ``cache`` or ``past_key_values``
        or None). With a cache holding P tokens the mask covers the whole context, [B, P + T]."""
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError(f"{name}: `cache` and `past_key_values` name the same argument; pass one")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, KalmixCache):
            raise TypeError(f"{name}: the cache must be a KalmixCache, got {type(cache).__name__}")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError(f"{name}: pass exactly one of `input_ids` [B, T] and `inputs_embeds` [B, T, hidden_size]")
        weight = self.embed_tokens.weight
        if input_ids is not None:
            x, arg = input_ids, "input_ids"
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
                hint = " (one sequence: input_ids[None])" if isinstance(x, torch.Tensor) and x.dim() == 1 else ""
                raise ValueError(f"{name}: `input_ids` must be an int64 or int32 tensor [B, T] of token ids{hint}, "
                                 f"got {describe(x)}")
        else:
            x, arg, d = inputs_embeds, "inputs_embeds", self.config.hidden_size
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != d or not x.is_floating_point():
                raise ValueError(f"{name}: `inputs_embeds` must be a floating-point tensor [B, T, hidden_size] = "
                                 f"[B, T, {d}], got {describe(x)}")
            if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
                raise ValueError(f"{name}: `inputs_embeds` are {x.dtype} but the model's weights are {weight.dtype}; "
                                 f"cast one to the other or run under torch.autocast")
        if x.shape[0] == 0:
            raise ValueError(f"{name}: `{arg}` must hold at least one sequence (B >= 1), got {describe(x)}")
        if x.device != weight.device and weight.device.type != "meta":     # meta: offloaded, moved in by hooks
            raise ValueError(f"{name}: `{arg}` is on {x.device} but the model is on {weight.device}; move one to "
                             f"the other's device")
        if attention_mask is not None:
            check_mask(name, attention_mask, x, cache.get_seq_length() if cache is not None else 0)
        return x, cache

    def _check_values(self, input_ids, inputs_embeds, attention_mask) -> None:
        """The checks that read the inputs' values (ids in the vocabulary, a 0/1 mask, finite embeddings): on CPU
        read on the host, a ValueError naming the values; on other devices asserted on the device, with no host
        sync (``kalmix.layers.common.require``)."""
        if input_ids is not None and input_ids.numel():
            V = self.embed_tokens.num_embeddings
            lo, hi = torch.aminmax(input_ids)
            require((lo >= 0) & (hi < V), f"KalmixModel: `input_ids` must be token ids in [0, vocab_size = {V})",
                    lambda: f", got ids from {lo.item()} to {hi.item()}")
        if inputs_embeds is not None and inputs_embeds.numel():
            require(torch.isfinite(inputs_embeds).all(), "KalmixModel: `inputs_embeds` must be finite (no NaN or Inf)")
        if attention_mask is not None:
            check_mask_values("KalmixModel", attention_mask, assert_on_device=True)

    def _documents(self, x, position_ids, cu_seqlens, documents, attention_mask, cache,
                   use_cache) -> Documents | None:
        given = [a for a in (position_ids, cu_seqlens, documents) if a is not None]
        if not given:
            return None
        if len(given) > 1:
            raise ValueError("KalmixModel: pass packed documents as one of `position_ids`, `cu_seqlens` and "
                             "`documents`")
        if attention_mask is not None or cache is not None or use_cache:
            raise ValueError("KalmixModel: packed documents (`position_ids`, `cu_seqlens`) are for forward passes "
                             "without a cache or padding mask (use_cache=False)")
        if self.context_split is not None:         # this rank's piece of rows split across ranks
            return self.context_split.documents(tuple(x.shape[:2]), x.device, position_ids, cu_seqlens, documents)
        if documents is not None:
            if (documents.B, documents.T) != tuple(x.shape[:2]):
                raise ValueError(f"KalmixModel: `documents` are of a [{documents.B}, {documents.T}] batch, the "
                                 f"input is {list(x.shape[:2])}")
            return documents
        if cu_seqlens is not None:                  # checked here, once per forward: the layers and ops trust it
            return Documents("KalmixModel", cu_seqlens, *x.shape[:2], x.device)
        if isinstance(position_ids, torch.Tensor) and position_ids.device != x.device:
            raise ValueError(f"KalmixModel: `position_ids` is on {position_ids.device} but the input is on "
                             f"{x.device}; pass both on one device")
        if isinstance(position_ids, torch.Tensor) and position_ids.shape != x.shape[:2]:
            raise ValueError(f"KalmixModel: `position_ids` must be [B, T] = {list(x.shape[:2])}, got "
                             f"{list(position_ids.shape)}")
        return Documents.from_position_ids("KalmixModel", position_ids)

    @staticmethod
    def _layer_masks(attention_mask, x, cache):
        """(attention layers' mask, recurrent layers' mask): each the whole mask [B, P + T], or None where it has
        no padding to mask (attention: in the context; the recurrent layers: in this call's tokens, the last T
        columns, which they take). One host read of the mask per prefill and none per decoded token: a recurrent
        layer keeps its state through a padded step without reading the mask, and the cache remembers whether its
        context holds padding."""
        if attention_mask is None:
            return None, None
        T = x.shape[1]
        if cache is not None and T == 1 and len(cache):
            return (attention_mask if cache.has_padding else None), attention_mask
        padded = not bool(attention_mask[:, attention_mask.shape[1] - T:].all())
        if cache is not None:
            cache.has_padding = cache.has_padding or padded
            return (attention_mask if cache.has_padding else None), (attention_mask if padded else None)
        return (attention_mask if padded else None), (attention_mask if padded else None)


class KalmixForCausalLM(KalmixPreTrainedModel, GenerationMixin):
    """``KalmixModel`` with an LM head (tied to the embedding when ``config.tie_word_embeddings``)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: KalmixConfig):
        super().__init__(config)
        self.model = KalmixModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: KalmixCache | None = None, past_key_values: KalmixCache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                targets: torch.LongTensor | None = None, **kwargs) -> CausalLMOutputWithPast | tuple:
        """As ``KalmixModel.forward``, plus: labels [B, T] (−100 = not scored) give the mean cross-entropy of
        position t's logits against labels[t + 1]; ``logits_to_keep`` = n > 0 projects only the last n positions
        onto the vocabulary (a 1-D tensor: those positions); 0 keeps all. With packed documents (``cu_seqlens`` or
        ``position_ids``) the prediction of each document's first token from the previous document is not
        scored. In training mode with labels and ``config.fuse_cross_entropy`` (the default) the loss is computed
        without the logits (``kalmix.models.loss.linear_cross_entropy``) and ``logits`` is None; in evaluation mode,
        without labels or with ``fuse_cross_entropy=False`` the logits are returned.

        ``targets`` [B, T] (instead of labels) are labels already shifted: the token each position predicts (−100:
        none), used as given (no document start or piece boundary is masked for them); ``loss`` is then their
        summed cross-entropy, not the mean, for callers that count the scored targets themselves (``kalmix train``
        counts its global batch's; under context parallelism a piece's last target is the next piece's first
        label, which the caller holds). The logits are computed or not as with labels.

        With ``config.mc_samples`` = S > 0 (KLA+) the batch runs S times (rows s·B … (s + 1)·B − 1 are sample s,
        also in ``hidden_states``), every Kalman layer reading out a posterior sample, and the logits [B, T, V] are
        the Monte-Carlo marginal log-probs log (1/S) Σ_s softmax(logits_s) (fp32 or wider): the loss is then
        Eq. 25's −logsumexp_s log p(o | y^(s)) + log S. No cache: ``use_cache`` / ``cache`` are refused.

        ``num_items_in_batch`` (with labels; what transformers' ``Trainer`` passes under gradient accumulation):
        the loss is the summed cross-entropy divided by it instead of the mean.
        ``sample_readout=True`` with mc_samples = 0 is one such sample: the logits of y^(s), unreduced.

        Inside ``kalmix.distributed.context_parallel_model`` input_ids and labels are this rank's pieces and
        ``loss`` is this rank's share (``kalmix.distributed.context_parallel_loss``): the ranks' losses add up to
        the loss of the whole sequence."""
        S = self.config.mc_samples
        if S and (use_cache or cache is not None or past_key_values is not None):
            raise ValueError(f"KalmixForCausalLM: mc_samples = {S} (KLA+) scores whole sequences through sampled "
                             f"readouts and has no cached decoding (`use_cache`, `cache`, `past_key_values`); "
                             f"{_MEAN_DECODING}")
        x, _ = self.model._check_inputs("KalmixForCausalLM", input_ids, inputs_embeds, attention_mask, cache,
                                        past_key_values)
        self._check_logits_to_keep(logits_to_keep, x.shape[1])
        if labels is not None and targets is not None:
            raise ValueError("KalmixForCausalLM: pass `labels` (unshifted: the mean loss) or `targets` (shifted: the "
                             "summed loss), not both")
        n_items = self._check_num_items(kwargs.pop("num_items_in_batch", None), labels)
        if labels is not None:
            self._check_labels(labels, x, logits_to_keep)
        if targets is not None:
            self._check_labels(targets, x, logits_to_keep, "targets")
        if (labels is not None or S) and (kwargs.get("cu_seqlens") is not None
                                           or kwargs.get("position_ids") is not None):
            kwargs["documents"] = self.model._documents(x, kwargs.pop("position_ids", None),
                                                        kwargs.pop("cu_seqlens", None), kwargs.get("documents"),
                                                        attention_mask, cache if cache is not None else
                                                        past_key_values, use_cache)
        docs = kwargs.get("documents")
        if S:
            use_cache, kwargs["sample_readout"] = False, True
            input_ids = None if input_ids is None else input_ids.repeat(S, 1)
            inputs_embeds = None if inputs_embeds is None else inputs_embeds.repeat(S, 1, 1)
            attention_mask = None if attention_mask is None else attention_mask.repeat(S, 1)
            if docs is not None:
                kwargs["documents"] = docs.repeat(S)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_hidden_states=output_hidden_states, return_dict=True, **kwargs)
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:] if logits_to_keep > 0 else h
        else:
            h = h[:, logits_to_keep]
        fused = (labels is not None or targets is not None) and self.training and self.config.fuse_cross_entropy
        logits = None if fused else self.lm_head(h)
        if S and not fused:
            logits = mc_marginal(logits, S)
        loss = None
        if targets is not None:
            loss = (linear_cross_entropy(h, self.lm_head.weight, targets, max(S, 1), "sum") if fused else
                    F.cross_entropy(upcast(logits).flatten(0, 1), targets.flatten(), reduction="sum"))
        elif labels is not None:
            if fused:
                loss = self._fused_loss(h, labels, docs, n_items)
            elif self.context_split is not None:
                loss = self.context_split.loss(logits, labels, None if docs is None else docs.doc_pos == 0)
            else:
                targets = labels[:, 1:]
                if docs is not None:                        # a document's first token is not predicted across
                    targets = targets.masked_fill(docs.doc_pos[:, 1:] == 0, -100)
                loss = F.cross_entropy(upcast(logits[:, :-1].flatten(0, 1)), targets.flatten(), ignore_index=-100,
                                       reduction="mean" if n_items is None else "sum")
                loss = loss if n_items is None else loss / n_items
        if return_dict is False:
            return tuple(v for v in (loss, logits, getattr(out, _CACHE_FIELD), out.hidden_states) if v is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                      **{_CACHE_FIELD: getattr(out, _CACHE_FIELD)})

    def _check_num_items(self, n_items, labels) -> int | torch.Tensor | None:
        """transformers' ``Trainer`` passes ``num_items_in_batch`` (the scored tokens of the whole accumulated
        batch) to a forward taking ``**kwargs``: with labels, the loss is then the summed cross-entropy divided by
        it instead of the mean over this call's tokens. An int >= 1 or a 0-d integer tensor; not under context
        parallelism, whose ranks share the loss by their own count."""
        if n_items is None:
            return None
        name = "KalmixForCausalLM"
        if labels is None:
            raise ValueError(f"{name}: `num_items_in_batch` divides the summed loss of `labels`; pass labels with it")
        if self.context_split is not None:
            raise ValueError(f"{name}: `num_items_in_batch` is not taken under context parallelism (the ranks share "
                             f"the loss by their own count); leave it out")
        ok = (isinstance(n_items, torch.Tensor) and n_items.dim() == 0 and is_integer(n_items)) or (
            isinstance(n_items, int) and not isinstance(n_items, bool) and n_items >= 1)
        if not ok:
            raise ValueError(f"{name}: `num_items_in_batch` must be an int >= 1 or a 0-d integer tensor (the scored "
                             f"tokens of the accumulated batch), got {describe(n_items)}")
        return n_items

    def _fused_loss(self, h: torch.Tensor, labels: torch.Tensor, docs: Documents | None,
                    n_items: int | torch.Tensor | None = None) -> torch.Tensor:
        """The loss of ``config.fuse_cross_entropy``: ``linear_cross_entropy`` of the last hidden states h
        [S·B, T, d] (no logits), with the plain loss's targets, mean (or sum / ``n_items``) and context-parallel
        share."""
        S = max(self.config.mc_samples, 1)
        starts = None if docs is None else docs.doc_pos == 0    # a document's first token is not predicted across
        if self.context_split is not None:
            targets, count = self.context_split.targets(labels, starts)
            return linear_cross_entropy(h, self.lm_head.weight, targets, S, "sum") / count
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)              # the last position predicts nothing
        if starts is not None:
            targets = targets.masked_fill(F.pad(starts[:, 1:], (0, 1)), -100)
        if n_items is not None:
            return linear_cross_entropy(h, self.lm_head.weight, targets, S, "sum") / n_items
        return linear_cross_entropy(h, self.lm_head.weight, targets, S)

    @staticmethod
    def _check_logits_to_keep(logits_to_keep, T: int) -> None:
        """An int n >= 0 or a 1-D integer tensor of positions in [-T, T) (read as ``require`` says)."""
        if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.dim() == 1 and is_integer(logits_to_keep):
            if logits_to_keep.numel():
                require(((logits_to_keep >= -T) & (logits_to_keep < T)).all(),
                        f"KalmixForCausalLM: `logits_to_keep` positions must lie in [-T, T) = [{-T}, {T})",
                        lambda: f", got {logits_to_keep.tolist()[:8]}")
        elif isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"KalmixForCausalLM: `logits_to_keep` must be an int n >= 0 (the last n positions; 0: "
                             f"all) or a 1-D integer tensor of positions, got {describe(logits_to_keep)}")

    def _check_labels(self, labels, x: torch.Tensor, logits_to_keep, arg: str = "labels") -> None:
        """labels (or ``arg`` = "targets"): an int64 tensor of the input's [B, T] on its device, of token ids or
        -100 (values read as ``require`` says); labels: T >= 2 outside a context-parallel forward; every position's
        logits kept."""
        name, B_T = "KalmixForCausalLM", list(x.shape[:2])
        if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or list(labels.shape) != B_T:
            raise ValueError(f"{name}: `{arg}` must be an int64 tensor of the input's [B, T] = {B_T} (token ids, "
                             f"-100 = not scored), got {describe(labels)}")
        if labels.device != x.device:
            raise ValueError(f"{name}: `{arg}` are on {labels.device} but the input is on {x.device}; pass both on "
                             f"one device")
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError(f"{name}: `{arg}` need the logits of every position; leave `logits_to_keep` 0")
        if arg == "labels" and self.context_split is None and x.shape[1] < 2:
            raise ValueError(f"{name}: `labels` score position t's logits against labels[t + 1], which needs T >= 2 "
                             f"tokens, got T = {x.shape[1]}")
        V = self.lm_head.out_features
        bad = (labels != -100) & ((labels < 0) | (labels >= V))
        require(~bad.any(), f"{name}: `{arg}` must be token ids in [0, vocab_size = {V}) or -100 (not scored)",
                lambda: f", got {labels[bad].unique()[:8].tolist()}")

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """``GenerationMixin.generate`` with its arguments checked first, each refused with a ValueError naming it:
        the prompts (``inputs`` / ``input_ids`` [B, T], ``attention_mask`` [B, T], as for ``forward``), and
        (given here or in ``generation_config``) max_new_tokens >= 1, temperature > 0 when sampling, top_k None or
        >= 1, top_p None or in (0, 1] (``kalmix.models.decoding.check_sampling``). Refused for a KLA+ model
        (``config.mc_samples`` > 0)."""
        name = "KalmixForCausalLM.generate"
        if self.config.mc_samples:
            raise ValueError(f"KalmixForCausalLM: `generate` with mc_samples = {self.config.mc_samples} (KLA+) is "
                             f"not supported; {_MEAN_DECODING}")
        config = generation_config if generation_config is not None else self.generation_config
        value = lambda arg: kwargs[arg] if arg in kwargs else getattr(config, arg, None)     # noqa: E731
        check_sampling(name, *(value(a) for a in ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p")),
                       length_optional=True)
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if ids is not None and kwargs.get("inputs_embeds") is None:
            self.model._check_inputs(name, ids, None, kwargs.get("attention_mask"), None, None)
        return super().generate(inputs, generation_config, **kwargs)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, cache: KalmixCache | None = None,
                                      past_key_values: KalmixCache | None = None,
                                      attention_mask: torch.Tensor | None = None,
                                      inputs_embeds: torch.Tensor | None = None, use_cache: bool = True,
                                      logits_to_keep: int | None = None, **kwargs) -> dict:
        """The next forward's inputs: the tokens the cache has not seen (all of them at the first step)."""
        cache = cache if cache is not None else past_key_values
        seen = cache.get_seq_length() if cache is not None else 0
        inputs = {"cache": cache, "attention_mask": attention_mask, "use_cache": use_cache}
        if inputs_embeds is not None and seen == 0:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = input_ids[:, seen:].contiguous()
        if logits_to_keep is not None:
            inputs["logits_to_keep"] = logits_to_keep
        return inputs

    def _reorder_cache(self, cache: KalmixCache, beam_idx: torch.LongTensor) -> KalmixCache:
        cache.reorder_cache(beam_idx)
        return cache
