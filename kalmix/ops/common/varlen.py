"""Packed variable-length sequences (``cu_seqlens``): the PyTorch implementations' loop over them, the offsets the
Triton kernels take for a plain batch, and length buckets for kernels that take only a batch."""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch


@functools.lru_cache(maxsize=64)
def batch_offsets(B: int, T: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens [B + 1] (int32) of B sequences of T tokens, kept per shape (read only): a kernel call on a batch
    launches nothing to build it."""
    return torch.arange(0, (B + 1) * T, T, dtype=torch.int32).to(device)


def run_packed(core: Callable, cu_seqlens: torch.Tensor | None, acts: Sequence[torch.Tensor | None],
               state: tuple[torch.Tensor, ...], **kwargs):
    """Run ``core(*acts, state=state, **kwargs) -> (outs, final_state)`` per packed sequence.

    ``acts`` are ``[1, T, ...]`` activations cut at ``cu_seqlens``; ``state`` holds ``[N, ...]`` tensors,
    row i being sequence i's initial state. Outputs are concatenated back along T, final states stacked; an
    empty sequence keeps its initial state. Without ``cu_seqlens`` it is a plain call (T >= 1 is checked by the
    ops, so at least one sequence is non-empty).
    """
    if cu_seqlens is None:
        return core(*acts, state=state, **kwargs)
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for i, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        s_i = tuple(t[i:i + 1] for t in state)
        if eos == bos:
            finals.append(s_i)
            continue
        o_i, f_i = core(*[None if a is None else a[:, bos:eos] for a in acts], state=s_i, **kwargs)
        outs.append(o_i)
        finals.append(f_i)
    final = tuple(torch.cat(parts, dim=0) for parts in zip(*finals))
    out = tuple(None if parts[0] is None else torch.cat(parts, dim=1) for parts in zip(*outs))
    return out, final


class LengthBuckets:
    """Packed sequences regrouped into right-padded batches by length, for kernels that take only a batch.

    Bucket j holds the sequences of lengths in [2^(j-1), 2^j), the first one every length in [1, 2^min_bits); each
    bucket is one batch [n, L, ...] padded to its longest sequence. So there are at most ⌊log2 T⌋ + 2 − min_bits
    buckets (one at least), and beyond the first bucket padding less than doubles a sequence. Empty sequences are
    in none. Build it before queuing the call's kernels: its one host read of ``cu_seqlens`` and one copy of indices
    to the device then wait for nothing.

    Right padding is exact for a causal op whose padded tokens leave its state unchanged; the caller's padding values
    must make them so.
    """

    def __init__(self, cu_seqlens: torch.Tensor, min_bits: int = 1):
        bounds = cu_seqlens.tolist()
        lens = [e - b for b, e in zip(bounds[:-1], bounds[1:])]
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(lens):
            if n:
                groups.setdefault(max(n.bit_length(), min_bits), []).append(i)
        members = [groups[j] for j in sorted(groups)]
        self.shapes = [(len(ids), max(lens[i] for i in ids)) for ids in members]
        # per sequence: its first token's slot in the buckets' batches laid end to end, minus its offset
        shift, size = [0] * len(lens), 0
        for ids, (n, L) in zip(members, self.shapes):
            for r, i in enumerate(ids):
                shift[i] = size + r * L - bounds[i]
            size += n * L
        self.size = size
        seqs = [i for ids in members for i in ids]
        idx = torch.tensor(seqs + shift + lens).to(cu_seqlens.device)
        self.seqs, shift, lens = idx.split([len(seqs), len(lens), len(lens)])
        total = bounds[-1]
        self.slots = torch.arange(total, device=idx.device) + shift.repeat_interleave(lens, output_size=total)

    def pad(self, x: torch.Tensor, value: float = 0.0) -> list[torch.Tensor]:
        """[1, T, ...] packed → per bucket [n, L, ...], right-padded with ``value``."""
        buf = x.new_full((self.size, *x.shape[2:]), value).index_copy_(0, self.slots, x[0])
        return [b.view(n, L, *x.shape[2:]) for b, (n, L) in zip(buf.split([n * L for n, L in self.shapes]),
                                                                 self.shapes)]

    def unpad(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        """``pad``'s inverse: per bucket [n, L, ...] → [1, T, ...] (padding dropped)."""
        return torch.cat([x.flatten(0, 1) for x in xs]).index_select(0, self.slots)[None]

    def states(self, s: torch.Tensor) -> list[torch.Tensor]:
        """[N, ...] per sequence → per bucket [n, ...]."""
        return list(s.index_select(0, self.seqs).split([n for n, _ in self.shapes]))

    def finals(self, s0: torch.Tensor, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per bucket [n, ...] → [N, ...] in sequence order; an empty sequence keeps its row of ``s0``."""
        return s0.index_copy(0, self.seqs, torch.cat(xs))
