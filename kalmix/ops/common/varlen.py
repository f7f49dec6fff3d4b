"""Packed variable-length sequences (``cu_seqlens``): the PyTorch implementations' loop over them, and the
offsets the Triton kernels take for a plain batch."""
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
