"""Packed documents: several documents laid end to end in rows of a [B, T] batch, their boundaries as
``cu_seqlens``; no recurrent state, convolution input or attention crosses a boundary."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kalmix.layers.common import describe, is_integer


class Documents:
    """The documents of a [B, T] batch, given as ``cu_seqlens`` [N + 1]: offsets into the flattened B·T tokens,
    0 first, B·T last, strictly increasing, every row start (a multiple of T) among them. fla's layout, one row
    [1, total] with ``cu_seqlens``, is the case B = 1.

    Attributes: ``cu_seqlens`` [N + 1] (int32); ``max_len`` (int), the longest document's length; ``doc_pos`` [B, T] (int32), each token's position in its
    document; ``doc_id`` [B, T] (int64), the index of its document.
    """

    def __init__(self, name: str, cu_seqlens: torch.Tensor, B: int, T: int):
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point \
                or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"{name}: `cu_seqlens` must be a 1-D integer tensor of document offsets, got "
                             f"{cu_seqlens!r:.80}")
        bounds = cu_seqlens.tolist()                            # one host read per forward (no decode step has one)
        total = B * T
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(f"{name}: `cu_seqlens` must start at 0 and end at B·T = {total} (the flattened "
                             f"[{B}, {T}] batch), got {bounds[:3]}…{bounds[-1:]}")
        if any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
            raise ValueError(f"{name}: `cu_seqlens` must be strictly increasing (no empty documents)")
        missing = sorted(set(range(0, total, T)) - set(bounds))
        if missing:
            raise ValueError(f"{name}: `cu_seqlens` must contain every row start of the [{B}, {T}] batch (a "
                             f"document cannot span rows); missing {missing[:4]}")
        self.B, self.T = B, T
        self.max_len = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))    # the longest document (host int)
        self.cu_seqlens = cu_seqlens.to(torch.int32)
        idx = torch.arange(total, device=cu_seqlens.device, dtype=torch.int32)
        doc = torch.searchsorted(self.cu_seqlens, idx, right=True) - 1
        self.doc_id = doc.view(B, T)
        self.doc_pos = (idx - self.cu_seqlens[doc]).view(B, T)

    @classmethod
    def from_position_ids(cls, name: str, position_ids: torch.Tensor) -> "Documents":
        """position_ids [B, T]: each token's position in its document, 0 where one starts (transformers'
        padding-free convention); every row starts a document whatever its first value."""
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or not is_integer(position_ids):
            raise ValueError(f"{name}: `position_ids` must be an integer tensor [B, T], got {describe(position_ids)}")
        pos = position_ids.long()
        if not bool(((pos[:, 1:] == 0) | (pos[:, 1:] == pos[:, :-1] + 1)).all()):
            raise ValueError(f"{name}: `position_ids` must count 0, 1, 2, … within each document (0 starts one)")
        return cls(name, cu_seqlens_from_positions(pos), *pos.shape)

    @classmethod
    def of_layer_call(cls, name: str, kwargs: dict, B: int, T: int, attention_mask, past_key_values,
                      use_cache: bool) -> "Documents | None":
        """A layer's packed documents: ``kwargs``'s ``documents`` (built by the model) or ``cu_seqlens`` (both
        popped), None without them or for T = 0; an error with a cache or padding mask."""
        docs, cu_seqlens = kwargs.pop("documents", None), kwargs.pop("cu_seqlens", None)
        if docs is None and cu_seqlens is not None and T > 0:
            docs = cls(name, cu_seqlens, B, T)
        if docs is not None and (attention_mask is not None or past_key_values is not None or use_cache):
            raise ValueError(f"{name}: packed documents (`cu_seqlens`) are for calls without a cache or padding "
                             f"mask; pad rows with whole documents instead")
        return docs

    def repeat(self, n: int) -> "Documents":
        """The documents of the batch repeated n times along B: [n·B, T], copy i in rows i·B … (i + 1)·B − 1."""
        total = self.B * self.T
        shifts = torch.arange(n, device=self.cu_seqlens.device, dtype=torch.int32)[:, None] * total
        cu_seqlens = torch.cat([(self.cu_seqlens[:-1] + shifts).flatten(), self.cu_seqlens[-1:] * n])
        return Documents("Documents.repeat", cu_seqlens, n * self.B, self.T)

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


def cu_seqlens_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """positions [B, T] (each token's position in its document, 0 starting one) -> cu_seqlens int32 [N + 1] over
    the flattened B·T tokens: a document starts at every 0 and at every row start."""
    starts = positions == 0
    starts[:, :1] = True
    return F.pad(starts.flatten().nonzero()[:, 0], (0, 1), value=positions.numel()).to(torch.int32)
