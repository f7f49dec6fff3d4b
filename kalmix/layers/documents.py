"""Packed documents: several documents laid end to end in rows of a [B, T] batch, their boundaries as
``cu_seqlens``; no recurrent state, convolution input or attention crosses a boundary.

A model turns its ``cu_seqlens`` or ``position_ids`` into one ``Documents`` per forward, checked once by the rule of
``kalmix.ops.common.varlen`` with one host read; its layers and their ops take it as checked and read nothing back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kalmix.layers.common import describe, is_integer
from kalmix.ops.common.varlen import Offsets, check_offsets, offsets_from_host


class Documents:
    """The documents of a [B, T] batch, given as ``cu_seqlens`` [N + 1]: offsets into the flattened B·T tokens
    (checked by ``kalmix.ops.common.varlen.check_offsets``: an int32 or int64 tensor on the inputs' device, 0 first,
    B·T last, non-decreasing, every row start among them; equal offsets are an empty document, which holds no
    token). fla's layout, one row [1, total] with ``cu_seqlens``, is the case B = 1. ``device``: the inputs' (None:
    the offsets'). A tensor is read to the host once, here; checked ``Offsets`` are taken as they are.

    Attributes: ``offsets`` (``Offsets``: the offsets on the device and on the host, what the ops take);
    ``cu_seqlens`` [N + 1] (int32, on the device); ``max_len`` (int), the longest document's length;
    ``row_starts`` (int), the most documents starting in one row; ``doc_pos`` [B, T] (int32), each token's position
    in its document; ``doc_id`` [B, T] (int64), the index of its document.
    """

    def __init__(self, name: str, cu_seqlens: torch.Tensor | Offsets, B: int, T: int,
                 device: torch.device | None = None):
        self.B, self.T = B, T
        self.offsets = check_offsets(name, cu_seqlens, B * T, device, row=T)
        self.cu_seqlens = self.offsets.tensor
        self.max_len, self.row_starts = self.offsets.max_len, self.offsets.row_starts(T)
        idx = torch.arange(B * T, device=self.cu_seqlens.device, dtype=torch.int32)
        doc = torch.searchsorted(self.cu_seqlens, idx, right=True) - 1
        self.doc_id = doc.view(B, T)
        self.doc_pos = (idx - self.cu_seqlens[doc]).view(B, T)

    @classmethod
    def from_position_ids(cls, name: str, position_ids: torch.Tensor) -> "Documents":
        """position_ids [B, T]: each token's position in its document, 0 where one starts (transformers'
        padding-free convention); every row starts a document whatever its first value. One host read: the
        positions' check and the documents' starts come back together."""
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or not is_integer(position_ids):
            raise ValueError(f"{name}: `position_ids` must be an integer tensor [B, T], got {describe(position_ids)}")
        pos = position_ids.long()
        B, T = pos.shape
        counts = ((pos[:, 1:] == 0) | (pos[:, 1:] == pos[:, :-1] + 1)).all()
        host = torch.cat([counts.view(1), document_starts(pos).flatten()]).cpu().numpy()    # the one host read
        if not host[0]:
            raise ValueError(f"{name}: `position_ids` must count 0, 1, 2, … within each document (0 starts one)")
        bounds = [*host[1:].nonzero()[0].tolist(), B * T]
        return cls(name, offsets_from_host(name, bounds, B * T, pos.device, row=T), B, T)

    @classmethod
    def of_layer_call(cls, name: str, kwargs: dict, hidden_states: torch.Tensor, attention_mask, past_key_values,
                      use_cache: bool) -> "Documents | None":
        """A layer's packed documents: ``kwargs``'s ``documents`` (built by the model) or ``cu_seqlens`` (both
        popped) for ``hidden_states`` [B, T, ...], None without them or for T = 0; an error with a cache or padding
        mask."""
        B, T = hidden_states.shape[:2]
        docs, cu_seqlens = kwargs.pop("documents", None), kwargs.pop("cu_seqlens", None)
        if docs is None and cu_seqlens is not None and T > 0:
            docs = cls(name, cu_seqlens, B, T, hidden_states.device)
        if docs is not None and (attention_mask is not None or past_key_values is not None or use_cache):
            raise ValueError(f"{name}: packed documents (`cu_seqlens`) are for calls without a cache or padding "
                             f"mask; pad rows with whole documents instead")
        return docs

    def repeat(self, n: int) -> "Documents":
        """The documents of the batch repeated n times along B: [n·B, T], copy i in rows i·B … (i + 1)·B − 1."""
        total = self.B * self.T
        shifts = torch.arange(n, device=self.cu_seqlens.device, dtype=torch.int32)[:, None] * total
        cu_seqlens = torch.cat([(self.cu_seqlens[:-1] + shifts).flatten(), self.cu_seqlens[-1:] * n])
        bounds = [x + i * total for i in range(n) for x in self.offsets.bounds[:-1]] + [n * total]
        offsets = offsets_from_host("Documents.repeat", bounds, n * total, cu_seqlens.device, self.T, cu_seqlens)
        return Documents("Documents.repeat", offsets, n * self.B, self.T)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [1, B·T, ...], the layout the ops take with ``cu_seqlens``."""
        return x.reshape(1, self.B * self.T, *x.shape[2:])

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[1, B·T, ...] -> [B, T, ...]."""
        return x.reshape(self.B, self.T, *x.shape[2:])

    def attention_mask(self) -> torch.Tensor:
        """[B, 1, T, T] bool: causal and within one document (block-diagonal)."""
        same = self.doc_id[:, :, None] == self.doc_id[:, None, :]
        causal = torch.ones(self.T, self.T, dtype=torch.bool, device=same.device).tril()
        return (same & causal)[:, None]


def document_starts(positions: torch.Tensor) -> torch.Tensor:
    """positions [B, T] (each token's position in its document) -> [B, T] bool: the tokens that start a document,
    every 0 and every row's first token."""
    starts = positions == 0
    starts[:, :1] = True
    return starts


def cu_seqlens_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """positions [B, T] (each token's position in its document, 0 starting one) -> cu_seqlens int32 [N + 1] over
    the flattened B·T tokens: a document starts at every 0 and at every row start (``document_starts``)."""
    return F.pad(document_starts(positions).flatten().nonzero()[:, 0], (0, 1), value=positions.numel()).to(
        torch.int32)
