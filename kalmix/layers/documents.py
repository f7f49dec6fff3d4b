"""Packed documents: several documents laid end to end in rows of a [B, T] batch, their boundaries as
``cu_seqlens``; no recurrent state, convolution input or attention crosses a boundary."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Documents:
    """The documents of a [B, T] batch, given as ``cu_seqlens`` [N + 1]: offsets into the flattened B·T tokens,
    0 first, B·T last, strictly increasing, every row start (a multiple of T) among them. fla's layout, one row
    [1, total] with ``cu_seqlens``, is the case B = 1.

    Attributes: ``cu_seqlens`` [N + 1] (int32); ``doc_pos`` [B, T] (int32), each token's position in its
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
        self.cu_seqlens = cu_seqlens.to(torch.int32)
        idx = torch.arange(total, device=cu_seqlens.device, dtype=torch.int32)
        doc = torch.searchsorted(self.cu_seqlens, idx, right=True) - 1
        self.doc_id = doc.view(B, T)
        self.doc_pos = (idx - self.cu_seqlens[doc]).view(B, T)

    @classmethod
    def from_position_ids(cls, name: str, position_ids: torch.Tensor) -> "Documents":
        """position_ids [B, T]: each token's position in its document, 0 where one starts (transformers'
        padding-free convention); every row starts a document whatever its first value."""
        if position_ids.dim() != 2:
            raise ValueError(f"{name}: `position_ids` must be [B, T], got {list(position_ids.shape)}")
        B, T = position_ids.shape
        pos = position_ids.long()
        starts = pos == 0
        starts[:, 0] = True
        step_ok = starts[:, 1:] | (pos[:, 1:] == pos[:, :-1] + 1)
        flat = starts.flatten().nonzero()[:, 0]
        if not bool(step_ok.all()):
            raise ValueError(f"{name}: `position_ids` must count 0, 1, 2, … within each document (0 starts one)")
        cu = F.pad(flat, (0, 1), value=B * T)
        return cls(name, cu, B, T)

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
