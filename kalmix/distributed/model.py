"""A whole ``KalmixModel`` / ``KalmixForCausalLM`` context-parallel: every sequence split in contiguous pieces.

    with context_parallel_model(model, group):
        out = model(input_ids=input_ids[:, start:end], labels=labels[:, start:end])    # this rank's piece
        out.loss.backward()
    # then sum the parameter gradients over the group (all_reduce SUM)

Rank r of the group feeds tokens [start_r, end_r) of every row (the pieces of ranks 0, 1, … end to end; they
may be unequal, at least one token each; the same batch size on every rank) and gets that piece's logits and
hidden states, equal to the whole sequence's. While the switch is on:

- every kalmix mixer (gdn, kaczmarz, gka, vla, kalman) runs its op through ``context_parallel`` of
  ``kalmix.distributed.context`` in the switch's ``mode``: the state relay (states from rank r to r + 1, their
  gradients back), or with ``mode="combine"`` the parallel combine of the affine ops (gdn, kaczmarz, gka and
  the linear-attention, GLA and Mamba-2 baselines; a kalman or vla layer then raises a ValueError);
- every short convolution receives the last kernel − 1 inputs before its piece from rank r − 1 (zeros on rank
  0; they pass through several ranks when pieces are shorter than that) and in the backward sends their
  gradient back;
- softmax attention all-gathers the keys and values of every rank and runs this piece's queries over them
  (rotary positions counted from the sequence's start, the causal mask offset by start_r); the backward
  reduce-scatters the keys' and values' gradients to their ranks;
- ``labels`` (this rank's piece, unshifted, as the model takes them) give ``loss`` = ``context_parallel_loss``:
  the last position of a piece predicts the first label of the next piece, and the piece's summed
  cross-entropy is divided by the number of scored targets of all ranks, so the ranks' losses add up to the
  single-device loss. Each rank backpropagates its own loss; the gradient of the total is the sum of the ranks'
  parameter gradients (DDP over the group averages them: multiply each rank's loss by the group size).

Costs per layer and rank, besides the piece's own compute: a mixer layer waits for the relay (see
``kalmix.distributed.context``: over a stack of layers the ranks overlap) or runs the combine (more compute,
one all-gather; no overlap) and exchanges B·(kernel − 1)·C
convolution inputs with each neighbour; an attention layer holds the keys and values of the whole sequence
([B, S, 2·d_model]), computes [T_r, S] scores with the later ranks' keys masked out (so the last rank does the
most work), and sends all-gather / reduce-scatter traffic of that size (after an all-gather of the pieces'
lengths, read on the host). On CUDA the attention runs SDPA with a mask (no flash kernel) and the short
convolutions torch's conv1d with the halo as their state (not kalmix's fused kernel).

Refused with a ValueError, since the pieces would not compose exactly or the ranks' messages would fall out of
step: a cache (``use_cache`` defaults to False inside the switch), padding masks (an all-ones mask is fine),
packed documents (``cu_seqlens``, ``position_ids``, ``documents``), gradient checkpointing (its recomputation
repeats the point-to-point messages), empty pieces. A model with a mixer that cannot be split (fla's
``deltanet``) raises NotImplementedError when the switch is turned on. As for any collective, every rank runs
the same calls (forward and backward) in the same order.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from kalmix.distributed.context import MODES, context_parallel
from kalmix.layers.common import upcast
from kalmix.models.modeling import KalmixBlock, KalmixModel

# p2p tags beyond those of kalmix.distributed.context: convolution halos, their gradients, the next piece's label
_TAG_HALO, _TAG_HALO_GRAD, _TAG_LABEL = 4, 5, 6


class ContextSplit:
    """A sequence split across the ranks of ``group`` (rank r holds the r-th piece): the collectives a model's
    modules call while ``context_parallel_model`` is on."""

    def __init__(self, group: dist.ProcessGroup | None = None, mode: str = "relay"):
        if mode not in MODES:
            raise ValueError(f"context_parallel_model: `mode` must be one of {MODES}, got {mode!r}")
        self.group, self.mode = group or dist.group.WORLD, mode
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.prev = dist.get_global_rank(self.group, self.rank - 1) if self.rank > 0 else None
        self.next = dist.get_global_rank(self.group, self.rank + 1) if self.rank < self.world - 1 else None

    def run(self, op, *args, **kwargs):
        """A kalmix op on this rank's piece, its state passed between the ranks (``context_parallel`` in
        ``self.mode``)."""
        return context_parallel(op, *args, group=self.group, mode=self.mode, **kwargs)

    def halo(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x [B, T, C] (this piece) -> the n inputs before it [B, n, C], zeros before the sequence's start."""
        return _Halo.apply(self, x, n)

    def gather(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """x [B, T, ...] (this piece) -> (the pieces of all ranks end to end [B, S, ...], this piece's start)."""
        lengths = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(self.world)]
        dist.all_gather(lengths, torch.tensor([x.shape[1]], device=x.device), group=self.group)
        lengths = [int(n) for n in lengths]
        return _Gather.apply(self, lengths, x), sum(lengths[:self.rank])

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        dist.send(t.contiguous(), dst, group=self.group, tag=tag)

    def recv(self, shape, like: torch.Tensor, src: int | None, tag: int) -> torch.Tensor:
        """A tensor of ``shape`` (``like``'s dtype and device) received from ``src``; zeros when src is None."""
        buf = like.new_zeros(shape)
        if src is not None:
            dist.recv(buf, src, group=self.group, tag=tag)
        return buf

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's share of the LM loss: see ``context_parallel_loss``."""
        sent = (dist.isend(labels[:, :1].contiguous(), self.prev, group=self.group, tag=_TAG_LABEL)
                if self.prev is not None else None)
        first = (self.recv(labels[:, :1].shape, labels, self.next, _TAG_LABEL) if self.next is not None
                 else torch.full_like(labels[:, :1], -100))         # the next piece's first labels, none at the end
        if sent is not None:
            sent.wait()
        targets = torch.cat([labels[:, 1:], first], 1)
        count = (targets != -100).sum()
        dist.all_reduce(count, group=self.group)
        return F.cross_entropy(upcast(logits).flatten(0, 1), targets.flatten(), ignore_index=-100,
                               reduction="sum") / count


class _Halo(torch.autograd.Function):
    """Receive the n inputs before this piece from the previous rank (zeros on rank 0) and send the last n inputs
    up to this piece's end, received ones included, to the next rank. The backward receives the next rank's
    gradient of the sent inputs and sends the gradient of the received ones back."""

    @staticmethod
    def forward(ctx, split: ContextSplit, x: torch.Tensor, n: int):
        B, T = x.shape[:2]
        h = split.recv((B, n, *x.shape[2:]), x, split.prev, _TAG_HALO)
        if split.next is not None:
            split.send(torch.cat([h, x], 1)[:, T:], split.next, _TAG_HALO)
        ctx.split, ctx.n, ctx.T = split, n, T
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, g_h):
        split, n, T = ctx.split, ctx.n, ctx.T
        g = torch.cat([g_h, g_h.new_zeros(g_h.shape[0], T, *g_h.shape[2:])], 1)       # of [received, x]
        g[:, T:] += split.recv(g_h.shape, g_h, split.next, _TAG_HALO_GRAD)          # of the inputs sent on
        if split.prev is not None:
            split.send(g[:, :n], split.prev, _TAG_HALO_GRAD)
        return None, g[:, n:], None


class _Gather(torch.autograd.Function):
    """All-gather the pieces x [B, T_i, ...] of every rank (padded to the longest) and lay them end to end; the
    backward sums each piece's gradient over the ranks onto its own rank (reduce-scatter)."""

    @staticmethod
    def forward(ctx, split: ContextSplit, lengths: list[int], x: torch.Tensor):
        longest = max(lengths)
        bufs = [x.new_empty(x.shape[0], longest, *x.shape[2:]) for _ in lengths]
        dist.all_gather(bufs, _padded(x, longest), group=split.group)
        ctx.split, ctx.lengths = split, lengths
        return torch.cat([b[:, :n] for b, n in zip(bufs, lengths)], 1)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        split, lengths = ctx.split, ctx.lengths
        longest = max(lengths)
        mine = g.new_empty(g.shape[0], longest, *g.shape[2:])
        dist.reduce_scatter(mine, [_padded(p, longest) for p in g.split(lengths, 1)], group=split.group)
        return None, None, mine[:, :lengths[split.rank]]


def _padded(x: torch.Tensor, length: int) -> torch.Tensor:
    """x [B, T, ...] zero-padded along dim 1 to [B, length, ...]."""
    out = x.new_zeros(x.shape[0], length, *x.shape[2:])
    out[:, :x.shape[1]] = x
    return out


def context_parallel_loss(logits: torch.Tensor, labels: torch.Tensor,
                          group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's share of the causal-LM loss of sequences split across the ranks of ``group``.

    logits [B, T_r, V] and labels [B, T_r] (−100: not scored) are this rank's pieces, labels unshifted as
    ``KalmixForCausalLM`` takes them: position t predicts the label at t + 1, the piece's last position the next
    rank's first label (the last rank's last position predicts nothing). Returns the piece's summed
    cross-entropy over the number of scored targets on all ranks, so the ranks' losses add up to the
    single-device mean cross-entropy (fp32 or wider).
    """
    return ContextSplit(group).loss(logits, labels)


@contextlib.contextmanager
def context_parallel_model(model: nn.Module, group: dist.ProcessGroup | None = None, mode: str = "relay"):
    """Run ``model`` (a ``KalmixForCausalLM`` or ``KalmixModel``, or a module holding one, e.g. its DDP wrapper)
    context-parallel over ``group`` (default: the world) while the ``with`` block lasts: each rank's forward
    takes its piece of every sequence (see the module docstring). ``mode``: how the mixers' ops pass their states,
    "relay" or "combine" (``kalmix.distributed.context``). A backward may run after the block."""
    if not any(isinstance(m, KalmixModel) for m in model.modules()):
        raise TypeError(f"context_parallel_model: expected a KalmixModel or KalmixForCausalLM (or a module "
                        f"holding one), got {type(model).__name__}")
    for block in (m for m in model.modules() if isinstance(m, KalmixBlock)):
        if not hasattr(type(block.mixer), "context_split"):
            raise NotImplementedError(f"context_parallel_model: the {block.mixer_type!r} mixer "
                                      f"({type(block.mixer).__name__}) cannot run on a sequence split across "
                                      "ranks; the kalmix mixers and softmax attention can")
    parts = [m for m in model.modules() if hasattr(type(m), "context_split")]
    if any(m.context_split is not None for m in parts):
        raise RuntimeError("context_parallel_model: the model is already context-parallel")
    split = ContextSplit(group, mode)
    for m in parts:
        m.context_split = split
    try:
        yield model
    finally:
        for m in parts:
            m.context_split = None
