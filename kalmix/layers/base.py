"""The plumbing every kalmix layer shares: fla's forward signature, padding masks, the recurrent cache."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.profiler import record_function

from kalmix.layers.cache import KalmixCache
from kalmix.layers.common import Packer, activation_dtype, check_hidden, context_mask, keep_where
from kalmix.layers.documents import Documents
from kalmix.ops import OpSpec

MIXER_OP_RANGE = "kalmix.mixer_op"      # the profiler range of a layer's op call


class MixerLayer(nn.Module):
    """Subclasses implement ``project`` (hidden -> op inputs), ``mix`` (the op) and ``readout`` (op output -> hidden).

    ``forward(hidden_states, attention_mask=None, past_key_values=None, use_cache=False)`` returns
    ``(o [B, T, d_model], None, past_key_values)`` like fla's layers; T = 0 gives an empty o [B, 0, d_model] and
    leaves the cache unchanged. ``attention_mask`` [B, T] (1 = token,
    0 = padding; left or right padding) runs the padded batch as packed sequences, so padding never touches
    a state; with a cache holding P tokens it covers the whole context [B, P + T] (its last T columns are this
    call's), as for attention; any other shape, or values other than 0 and 1 (read on CPU), is a ValueError. With
    ``use_cache`` the final recurrent and convolution states go into a ``KalmixCache`` (created when None is
    given); a following call continues from them, and single-token calls run ``step_impl``: the op's fused step
    where its spec has one for the layer's impl (``OpSpec.step_impls``), else its recurrent step (impl="naive",
    the function the reference loops over).

    Packed documents: ``cu_seqlens`` [N + 1] (fla's keyword) gives document offsets into the flattened B·T
    tokens, every row start among them (B = 1 is fla's packed layout; the rule: ``kalmix.ops.common.varlen``),
    or the model's ``documents``; each document starts from a zero state and a zero convolution history, exactly
    as if it were its own sequence. For calls without a cache or padding mask (training, scoring).

    Context parallelism: while ``context_split`` is set (``kalmix.distributed.context_parallel_model``), the call
    holds one contiguous piece of a sequence split across ranks, and ``run_op`` runs the op on it with the state
    passed between the ranks (relayed, or combined in parallel: the switch's ``mode``).

    Mixed precision: the op's activations (its [B, T, H, *] inputs) enter in one dtype, the autocast dtype
    inside an autocast region and the hidden states' dtype otherwise; gates stay fp32; the op keeps its state
    math in fp32 with autocast off.

    Recomputation: with ``recompute`` set (``KalmixConfig(recompute_mixers=True)``), a call that trains (gradients
    on, no cache) keeps only ``project_in``'s output for the backward and runs the rest of ``project`` (short
    convolution, normalisations, gates) and the op again there (``torch.utils.checkpoint``): the same values and
    gradients, without the op's inputs and what the op saves.
    """

    d_model: int
    layer_idx: int
    impl: str | None
    op_spec: OpSpec             # the op it runs (``kalmix.ops.SPECS``)
    context_split = None        # a sequence split across ranks (kalmix.distributed.ContextSplit) or None
    recompute = False           # run project's rest and the op again in the backward (see the class docstring)

    def run_op(self, op, *args, **kwargs):
        """``op(*args, **kwargs)``, or on this rank's piece through ``context_split`` when the sequence is split.
        While torch.profiler records, the call is a ``kalmix.mixer_op`` range (``kalmix bench lm --profile``)."""
        with record_function(MIXER_OP_RANGE) if torch._C._autograd._profiler_enabled() else nullcontext():
            if self.context_split is None:
                return op(*args, **kwargs)
            return self.context_split.run(op, *args, **kwargs)

    def step_impl(self, device: torch.device) -> str:
        """The impl of single-token (decoding) calls: the layer's impl (None: triton on CUDA, torch otherwise) where
        the op has a fused step for it (one launch per token), else "naive"."""
        impl = self.impl or ("triton" if device.type == "cuda" else "torch")
        return impl if impl in self.op_spec.step_impls else "naive"

    def project_in(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d_model] -> what ``project`` starts from: the layer's input projection (its GEMM on x, which a
        recomputing layer keeps rather than runs again); x itself by default."""
        return x

    def project(self, h: torch.Tensor, conv_state, docs: Documents | None = None):
        """``project_in``'s output h [B, T, *] -> (list of op inputs [B, T, ...], readout context, new conv state);
        packed documents ``docs`` restart the short convolution at each document (``ShortConv``)."""
        raise NotImplementedError

    def mix(self, inputs, initial_state, output_final_state, cu_seqlens, impl, **kwargs):
        """Run the op: -> (o [B, T, H, V], extra output or None, final state)."""
        raise NotImplementedError

    def readout(self, o: torch.Tensor, extra, ctx, **kwargs):
        """(o, extra, ctx) -> (out [B, T, d_model], second return value)."""
        raise NotImplementedError

    def _project_mix(self, h, conv_state, docs, packer, rec_state, use_cache, act, impl, kwargs):
        """``project`` from h and the op on its inputs (packed and unpacked around the op where ``packer`` is set)
        (the op's activations in dtype ``act``) -> (o [B, T, H, V], extra, final state, readout context, new conv
        state)."""
        inputs, ctx, conv_state = self.project(h, conv_state, docs)
        inputs = [a.to(act) if a.dim() == 4 else a for a in inputs]
        cu_seqlens = None
        if packer is not None:
            inputs = [packer.pack(a) if a.dim() >= 3 else a for a in inputs]
            cu_seqlens = docs.offsets if docs is not None else packer.cu_seqlens     # checked offsets: no read
        o, extra, state = self.mix(inputs, rec_state, use_cache, cu_seqlens, impl, **kwargs)
        if packer is not None:
            o = packer.unpack(o)
            extra = None if extra is None else packer.unpack(extra)
        return o, extra, state, ctx, conv_state

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: KalmixCache | None = None, use_cache: bool = False, **kwargs):
        name = type(self).__name__
        check_hidden(name, hidden_states, self.d_model)
        B, T = hidden_states.shape[:2]
        attention_mask = context_mask(name, attention_mask, hidden_states, past_key_values, self.layer_idx)
        docs = Documents.of_layer_call(name, kwargs, hidden_states, attention_mask, past_key_values, use_cache)
        if T == 0:                                          # no tokens: nothing to mix, the cache stays as it is
            if use_cache and past_key_values is None:
                past_key_values = KalmixCache()
            return hidden_states.new_zeros(B, 0, self.d_model), None, past_key_values
        last = past_key_values.get(self.layer_idx, B) if past_key_values is not None else None
        last = last if last and last["seen"] else None          # a reset cache keeps its buffers, not its states
        conv_state = last["conv_state"] if last else None
        rec_state = last["recurrent_state"] if last else None
        x = hidden_states
        packer = keep = None
        if attention_mask is not None and T == 1 and rec_state is not None:
            keep = attention_mask.bool()[..., None]                    # [B, 1, 1]: a padded step keeps the state
            x = torch.where(keep, x, 0)                                 # (no host read: decode steps stay async)
        elif attention_mask is not None and not bool(attention_mask.all()):
            x = torch.where(attention_mask.bool()[..., None], x, 0)   # padding enters the convolutions as zeros
            packer = Packer(attention_mask)
        if docs is not None:
            packer = docs
        h = self.project_in(x)
        impl = self.step_impl(x.device) if T == 1 else self.impl
        args = (conv_state, docs, packer, rec_state, use_cache, activation_dtype(hidden_states), impl, kwargs)
        if self.recompute and torch.is_grad_enabled() and not use_cache and rec_state is None:
            o, extra, state, ctx, conv_state = torch.utils.checkpoint.checkpoint(self._project_mix, h, *args,
                                                                                 use_reentrant=False)
        else:
            o, extra, state, ctx, conv_state = self._project_mix(h, *args)
        if keep is not None:
            o = torch.where(keep[..., None], o, 0)                      # o [B, 1, H, V]; NaN-safe, unlike o · keep
            if state is not None:
                state = keep_where(keep[:, 0, 0], state, rec_state)
        if use_cache:
            if past_key_values is None:
                past_key_values = KalmixCache()
            past_key_values.update(self.layer_idx, T, recurrent_state=state, conv_state=conv_state)
        out, second = self.readout(o, extra, ctx, **kwargs)
        return out, second, past_key_values
