"""Packed variable-length sequences (``cu_seqlens``): their one check, the PyTorch implementations' loop over them,
and the offsets the Triton kernels take for a plain batch.

The rule of ``cu_seqlens`` [N + 1], the offsets of N sequences laid end to end in ``total`` tokens (T of an op's
packed [1, T] call; B·T of a model's or a layer's [B, T] batch, flattened), checked once where they enter (a model,
a layer or an op given a tensor, ``context_parallel``) by ``check_offsets``:

- a 1-D int32 or int64 tensor on the inputs' device;
- at least two offsets (N >= 1 sequences): 0 first, ``total`` last;
- non-decreasing; two equal offsets are an empty sequence, which holds no token (an op returns its initial state
  as its final state);
- of a [B, T] batch: every row start (a multiple of T) among them, since a document cannot span rows.

Each breach is a ValueError naming the caller, the offsets and the rule. The check reads a tensor's offsets to the
host once and returns ``Offsets``: the offsets on the device (for the kernels) and on the host (for every loop,
table size and launch grid), which the layers and ops below take as checked, reading nothing back.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from typing import Callable, Sequence

import torch

from kalmix.ops.common.checks import fail


@dataclasses.dataclass(frozen=True, eq=False)
class Offsets:
    """Checked ``cu_seqlens`` (module docstring): ``tensor`` [N + 1] int32 on the inputs' device, ``bounds`` the
    same N + 1 offsets on the host. Made by ``check_offsets`` or ``offsets_from_host``."""
    tensor: torch.Tensor
    bounds: tuple[int, ...]

    @property
    def n(self) -> int:
        """The number of sequences N."""
        return len(self.bounds) - 1

    @property
    def lengths(self) -> list[int]:
        """Each sequence's number of tokens [N] (0 for an empty one)."""
        return [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])]

    @property
    def max_len(self) -> int:
        """The longest sequence's number of tokens."""
        return max(self.lengths)

    def row_starts(self, T: int) -> int:
        """The most sequences starting in one row of T tokens (of a [B, T] batch whose row starts are offsets)."""
        return max(Counter(x // T for x in set(self.bounds[:-1]) if x < self.bounds[-1]).values(), default=1)


def check_offsets(name: str, cu_seqlens, total: int | None, device: torch.device | None = None,
                  row: int | None = None) -> Offsets:
    """``cu_seqlens`` checked against the rule of the module docstring, for ``total`` tokens (None: any, for a
    caller that learns its total later) on ``device`` (None: the tensor's), with every multiple of ``row`` among
    them when given (the row length T of a [B, T] batch). A tensor is read to the host here, once; ``Offsets`` were
    checked where they were made: only their total and device are compared, nothing is read."""
    if isinstance(cu_seqlens, Offsets):
        if total is not None and cu_seqlens.bounds[-1] != total:
            fail(name, f"`cu_seqlens` must end at {_total(total, row)}, got offsets ending at "
                       f"{cu_seqlens.bounds[-1]}")
        if device is not None and cu_seqlens.tensor.device != device:
            fail(name, f"`cu_seqlens` is on {cu_seqlens.tensor.device} but the inputs are on {device}; pass both on "
                       f"one device")
        return cu_seqlens
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32,
                                                                                                      torch.int64):
        got = (f"a {cu_seqlens.dtype} tensor of shape {list(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
               else type(cu_seqlens).__name__)
        fail(name, f"`cu_seqlens` must be a 1-D integer tensor (int32 or int64) [N + 1] of offsets, got {got}")
    if device is not None and cu_seqlens.device != device:
        fail(name, f"`cu_seqlens` is on {cu_seqlens.device} but the inputs are on {device}; pass both on one device")
    return offsets_from_host(name, cu_seqlens.tolist(), total, cu_seqlens.device, row, tensor=cu_seqlens)


def offsets_from_host(name: str, bounds: Sequence[int], total: int | None, device: torch.device,
                      row: int | None = None, tensor: torch.Tensor | None = None) -> Offsets:
    """``Offsets`` of offsets already on the host (``bounds``), checked against the rule (``check_offsets``'s
    arguments); ``tensor``: the same offsets on the device where the caller has them, else they are copied there
    (without waiting for the device)."""
    bounds = tuple(bounds)
    if len(bounds) < 2 or bounds[0] != 0 or (total is not None and bounds[-1] != total):
        fail(name, f"`cu_seqlens` must start at 0 and end at {_total(total, row)}, got {_show(bounds)} (N + 1 >= 2 "
                   f"offsets for N sequences)")
    drop = next((i for i in range(1, len(bounds)) if bounds[i] < bounds[i - 1]), None)
    if drop is not None:
        fail(name, f"`cu_seqlens` must be non-decreasing (equal offsets are an empty sequence), got "
                   f"cu_seqlens[{drop}] = {bounds[drop]} after {bounds[drop - 1]} in {_show(bounds)}")
    if row is not None:
        missing = sorted(set(range(0, bounds[-1], row)) - set(bounds)) if row else []
        if missing:
            fail(name, f"`cu_seqlens` must contain every row start of the [{bounds[-1] // row}, {row}] batch (a "
                       f"document cannot span rows); missing {_show(missing)} in {_show(bounds)}")
    tensor = to_device(bounds, device) if tensor is None else tensor.to(torch.int32)
    return Offsets(tensor, bounds)


def check_packed(op: str, cu_seqlens, batch: int, seq_len: int | None,
                 device: torch.device) -> tuple[Offsets | None, int]:
    """An op's ``cu_seqlens`` (None, a tensor or ``Offsets``) for inputs [batch, seq_len, ...] on ``device``
    (``seq_len`` None: any total, ``check_offsets``): -> (the checked offsets or None, the number of sequences)."""
    if cu_seqlens is None:
        return None, batch
    if batch != 1:
        fail(op, f"`cu_seqlens` requires packed inputs with batch size 1, got B = {batch}")
    offsets = check_offsets(op, cu_seqlens, seq_len, device)
    return offsets, offsets.n


def to_device(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Host ints as a tensor on ``device``; on CUDA copied from pinned memory, so the host does not wait."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _total(total: int | None, row: int | None) -> str:
    if total is None:
        return "the number of tokens"
    return f"B·T = {total} (the flattened batch)" if row else f"T = {total}"


def _show(bounds: Sequence[int]) -> str:
    """Offsets for a message: all of them, or the first eight and the last."""
    return str(list(bounds)) if len(bounds) <= 9 else f"[{', '.join(map(str, bounds[:8]))}, …, {bounds[-1]}]"


@functools.lru_cache(maxsize=64)
def batch_offsets(B: int, T: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens [B + 1] (int32) of B sequences of T tokens, kept per shape (read only): a kernel call on a batch
    launches nothing to build it."""
    return torch.arange(0, (B + 1) * T, T, dtype=torch.int32).to(device)


def run_packed(core: Callable, cu_seqlens: Offsets | None, acts: Sequence[torch.Tensor | None],
               state: tuple[torch.Tensor, ...], **kwargs):
    """Run ``core(*acts, state=state, **kwargs) -> (outs, final_state)`` per packed sequence.

    ``acts`` are ``[1, T, ...]`` activations cut at ``cu_seqlens`` (checked ``Offsets``); ``state`` holds
    ``[N, ...]`` tensors, row i being sequence i's initial state. Outputs are concatenated back along T, final
    states stacked; an empty sequence keeps its initial state. Without ``cu_seqlens`` it is a plain call (T >= 1 is
    checked by the ops, so at least one sequence is non-empty).
    """
    if cu_seqlens is None:
        return core(*acts, state=state, **kwargs)
    bounds = cu_seqlens.bounds
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
