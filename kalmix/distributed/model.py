"""A whole ``KalmixModel`` / ``KalmixForCausalLM`` context-parallel: every sequence split in contiguous pieces.

    with context_parallel_model(model, group):
        out = model(input_ids=input_ids[:, start:end], labels=labels[:, start:end])    # this rank's piece
        out.loss.backward()
    # then sum the parameter gradients over the group (all_reduce SUM)

Rank r of the group feeds tokens [start_r, end_r) of every row (the pieces of ranks 0, 1, … end to end; they
may be unequal, at least one token each; the same batch size on every rank) and gets that piece's logits and
hidden states, equal to the whole sequence's. Rows may pack documents, which may cross the pieces' boundaries:
pass either ``cu_seqlens``, the offsets of the whole batch's documents over its flattened B·S tokens (S the
rows' full length; the same on every rank), or ``position_ids``, this piece's [B, T_r] positions within their
documents (continuing across the pieces: 0 only where a document starts); every rank passes one or neither.
While the switch is on:

- every kalmix mixer (gdn, kaczmarz, gka, vla, kalman) runs its op through ``context_parallel`` of
  ``kalmix.distributed.context`` in the switch's ``mode``: the state relay (states from rank r to r + 1, their
  gradients back), or with ``mode="combine"`` the parallel combine of the affine ops (gdn, kaczmarz, gka and
  the linear-attention, GLA and Mamba-2 baselines; a kalman or vla layer then raises a ValueError); with
  packed documents one call per row (``Piece``: only a document crossing a boundary carries its state over it;
  one that starts inside a piece starts from its own initial state);
- every short convolution receives the last kernel − 1 inputs before its piece from rank r − 1 (zeros on rank
  0; they pass through several ranks when pieces are shorter than that) and in the backward sends their
  gradient back; a document starting inside the halo's reach does not see them;
- softmax attention all-gathers the keys and values of every rank and runs this piece's queries over them
  (rotary positions counted from the sequence's start, the causal mask offset by start_r); with packed
  documents the queries of document d see d's keys from d's start to the piece's end and rotary positions
  count from d's start; the backward reduce-scatters the keys' and values' gradients to their ranks;
- ``labels`` (this rank's piece, unshifted, as the model takes them) give ``loss`` = ``context_parallel_loss``:
  the last position of a piece predicts the first label of the next piece (never a document's first token),
  and the piece's summed cross-entropy is divided by the number of scored targets of all ranks, so the ranks'
  losses add up to the single-device loss. Each rank backpropagates its own loss; the gradient of the total is
  the sum of the ranks' parameter gradients (DDP over the group averages them: multiply each rank's loss by the
  group size).

Costs per layer and rank, besides the piece's own compute: a mixer layer waits for the relay (see
``kalmix.distributed.context``: over a stack of layers the ranks overlap) or runs the combine (more compute,
one all-gather; no overlap) and exchanges B·(kernel − 1)·C
convolution inputs with each neighbour; an attention layer holds the keys and values of the whole sequence
([B, S, 2·d_model]), computes [T_r, S] scores with the later ranks' keys masked out (so the last rank does the
most work), and sends all-gather / reduce-scatter traffic of that size (after an all-gather of the pieces'
lengths, read on the host). On CUDA in fp16/bf16 the attention runs torch's varlen flash kernel (each row's, or
each document's, queries the last of its keys; ``flash_eligible``), elsewhere SDPA with a mask; the short
convolutions run torch's conv1d with the halo as their state (kalmix's fused kernel with packed documents).
Packed documents cost one all-gather of the pieces' lengths per forward (of the positions with
``position_ids``) and, for the mixers, one relay per row.

Refused with a ValueError, since the pieces would not compose exactly or the ranks' messages would fall out of
step: a cache (``use_cache`` defaults to False inside the switch), padding masks (an all-ones mask is fine),
gradient checkpointing and ``KalmixConfig.recompute_mixers`` with gradients (their recomputation repeats the
point-to-point messages, after the switch may be off), empty pieces, KLA+'s
``mc_samples`` with packed documents. A model with a mixer that cannot be split (fla's
``deltanet``) raises NotImplementedError when the switch is turned on. As for any collective, every rank runs
the same calls (forward and backward) in the same order.
"""
from __future__ import annotations

import contextlib
import functools
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from kalmix.distributed.context import MODES, context_parallel
from kalmix.layers.common import upcast
from kalmix.layers.documents import Documents
from kalmix.ops.common.varlen import offsets_from_host, to_device
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
        self.pieces: PieceDocuments | None = None      # the documents of the latest forward's piece

    def documents(self, shape: tuple[int, int], device: torch.device, position_ids: torch.Tensor | None,
                  cu_seqlens, documents: Documents | None) -> PieceDocuments:
        """The packed documents of this piece [B, T] (shape, on ``device``) from one of: ``cu_seqlens`` [N + 1] (a
        tensor or checked ``Offsets``), the whole batch's offsets over its flattened B·S tokens; ``position_ids``
        [B, T], this piece's positions within their documents; ``documents``, a ``PieceDocuments`` of this piece. Collective (an all-gather of the
        pieces' lengths, or of the positions); the documents are checked once with one host read (besides the
        lengths'), and the result is what the mixers' ops run on, reading nothing back."""
        name = "context_parallel_model"
        B, T = shape
        if documents is not None:
            if not isinstance(documents, PieceDocuments) or (documents.B, documents.T) != (B, T):
                raise ValueError(f"{name}: `documents` must be the PieceDocuments of this [{B}, {T}] piece; pass "
                                 f"packed documents as `cu_seqlens` (the whole batch's) or `position_ids` (the "
                                 f"piece's) instead")
            self.pieces = documents
            return documents
        if position_ids is not None:
            if position_ids.shape != (B, T):
                raise ValueError(f"{name}: `position_ids` must be this piece's [B, T] = {[B, T]}, got "
                                 f"{list(position_ids.shape)}")
            rows, start = self.gather_plain(position_ids.long())
            whole = Documents.from_position_ids(name, rows)
        else:
            lengths = self.lengths(T, device)
            start = sum(lengths[:self.rank])
            whole = Documents(name, cu_seqlens, B, sum(lengths), device)
        self.pieces = PieceDocuments(whole, start, T)
        return self.pieces

    def run(self, op, *args, cu_seqlens: torch.Tensor | None = None, **kwargs):
        """A kalmix op on this rank's piece, its state passed between the ranks (``context_parallel`` in
        ``self.mode``). With ``cu_seqlens`` (the packed piece [1, B·T, …] of ``self.pieces``, whose
        ``cu_seqlens`` they must be) one call per row, each with that row's documents."""
        if cu_seqlens is None:
            return context_parallel(op, *args, group=self.group, mode=self.mode, **kwargs)
        docs = self.pieces
        if docs is None or cu_seqlens is not docs.offsets:
            raise ValueError("context_parallel_model: a mixer's op got `cu_seqlens` that are not the model's packed "
                             "documents; pass them to the model (`cu_seqlens` or `position_ids`), not to a layer")
        if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            raise ValueError("context_parallel_model: packed documents take no initial or final states")
        n, T = docs.B * docs.T, docs.T

        def row(x, b: int):
            packed = isinstance(x, torch.Tensor) and x.dim() >= 3 and tuple(x.shape[:2]) == (1, n)
            return x[:, b * T:(b + 1) * T] if packed else x

        outs = [context_parallel(op, *[row(a, b) for a in args], cu_seqlens=c, group=self.group, mode=self.mode,
                                 **{k: row(v, b) for k, v in kwargs.items()})
                for b, c in enumerate(docs.rows)]
        return tuple(None if ys[0] is None else torch.cat(ys, 1) for ys in zip(*outs))

    def lengths(self, T: int, device: torch.device) -> list[int]:
        """The pieces' lengths of every rank (an all-gather, read on the host at once)."""
        lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world)]
        dist.all_gather(lengths, torch.tensor([T], device=device), group=self.group)
        return torch.cat(lengths).tolist()

    def gather_plain(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``gather`` without autograd, for tensors that take no gradient (positions)."""
        lengths = self.lengths(x.shape[1], x.device)
        bufs = [x.new_empty(x.shape[0], max(lengths), *x.shape[2:]) for _ in lengths]
        dist.all_gather(bufs, _padded(x, max(lengths)), group=self.group)
        return torch.cat([b[:, :n] for b, n in zip(bufs, lengths)], 1), sum(lengths[:self.rank])

    def halo(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x [B, T, C] (this piece) -> the n inputs before it [B, n, C], zeros before the sequence's start."""
        return _Halo.apply(self, x, n)

    def gather(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """x [B, T, ...] (this piece) -> (the pieces of all ranks end to end [B, S, ...], this piece's start)."""
        lengths = self.lengths(x.shape[1], x.device)
        return _Gather.apply(self, lengths, x), sum(lengths[:self.rank])

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        dist.send(t.contiguous(), dst, group=self.group, tag=tag)

    def recv(self, shape, like: torch.Tensor, src: int | None, tag: int) -> torch.Tensor:
        """A tensor of ``shape`` (``like``'s dtype and device) received from ``src``; zeros when src is None."""
        buf = like.new_zeros(shape)
        if src is not None:
            dist.recv(buf, src, group=self.group, tag=tag)
        return buf

    def targets(self, labels: torch.Tensor, starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(targets [B, T]: the label each position of this piece predicts, −100 where none; the number of targets
        on all ranks): see ``context_parallel_loss``; ``starts`` [B, T] (bool): the tokens that start a document,
        whose labels are not predicted from the token before. Collective."""
        if starts is not None:
            labels = labels.masked_fill(starts, -100)   # (a row's first label is never a target)
        sent = (dist.isend(labels[:, :1].contiguous(), self.prev, group=self.group, tag=_TAG_LABEL)
                if self.prev is not None else None)
        first = (self.recv(labels[:, :1].shape, labels, self.next, _TAG_LABEL) if self.next is not None
                 else torch.full_like(labels[:, :1], -100))         # the next piece's first labels, none at the end
        if sent is not None:
            sent.wait()
        targets = torch.cat([labels[:, 1:], first], 1)
        count = (targets != -100).sum()
        dist.all_reduce(count, group=self.group)
        return targets, count

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's share of the LM loss of ``logits`` [B, T, V]: see ``context_parallel_loss`` and
        ``targets``."""
        targets, count = self.targets(labels, starts)
        return F.cross_entropy(upcast(logits).flatten(0, 1), targets.flatten(), ignore_index=-100,
                               reduction="sum") / count


class PieceDocuments(Documents):
    """The packed documents of one rank's piece [B, T] of rows [B, S] split across ranks (tokens [start, start +
    T) of every row), built from the whole batch's ``Documents`` ``whole`` on the host: nothing is read back.

    As ``Documents`` for the piece, its rows packed to [1, B·T] by ``pack``: ``offsets`` / ``cu_seqlens`` [n + 1]
    the piece's segments, cut at every document start and every row start; ``doc_id`` [B, T] each token's segment;
    ``max_len`` the longest segment, ``row_starts`` the most segments in a row; but ``doc_pos`` [B, T] are the
    positions within the whole documents (a document continuing from the previous piece does not restart at 0).
    Besides: ``start``; ``rows``, per row its documents' ``Offsets`` within the row (the ``cu_seqlens`` the ops'
    ``context_parallel`` takes); ``key_doc`` and ``key_pos`` [B, start + T], each token's document (an index over
    the batch) and position in it, up to the piece's end; ``keys``, ``cu_keys``, ``max_keys``: the keys softmax
    attention's varlen kernel reads (see ``keys``).
    """

    def __init__(self, whole: Documents, start: int, T: int):
        name = "context_parallel_model"
        B, S = whole.B, whole.T
        end = start + T
        self.B, self.T, self.start = B, T, start
        c, device = whole.offsets.bounds, whole.cu_seqlens.device
        firsts = sorted({x for x in c if x < B * S})                # the documents' first tokens (non-empty ones)
        # each row's document holding the piece's first token starts at row position ``lead[b]``
        lead = [max(x for x in firsts if x <= b * S + start) - b * S for b in range(B)]
        cuts = {b * T for b in range(B)} | {x // S * T + x % S - start for x in firsts if start <= x % S < end}
        self.offsets = offsets_from_host(name, [*sorted(cuts), B * T], B * T, device, row=T)
        self.cu_seqlens = self.offsets.tensor
        self.max_len, self.row_starts = self.offsets.max_len, self.offsets.row_starts(T)
        self.doc_pos = whole.doc_pos[:, start:end]
        idx = torch.arange(B * T, device=device, dtype=torch.int32)
        self.doc_id = (torch.searchsorted(self.cu_seqlens, idx, right=True) - 1).view(B, T)
        self.rows = [offsets_from_host(name, [x - b * S for x in c if b * S <= x <= (b + 1) * S], S, device)
                     for b in range(B)]
        self.key_doc, self.key_pos = whole.doc_id[:, :end], whole.doc_pos[:, :end]
        # per segment: its queries and the tokens of its document before the piece (a row's first segment only)
        bounds = self.offsets.bounds
        self._key_counts = [b - a + (start - lead[a // T] if a % T == 0 else 0)
                            for a, b in zip(bounds[:-1], bounds[1:])]
        self._lead = lead

    @functools.cached_property
    def keys(self) -> torch.Tensor:
        """The keys the piece's queries attend, as indices into the flattened [B, start + T] keys (int64): each
        segment's document from its start to the piece's end, laid out segment after segment as the queries are
        (so each segment's queries are the last of its keys, the varlen kernel's causal alignment)."""
        end = self.start + self.T
        lengths = [end - lead for lead in self._lead]                   # row b: its keys [lead_b, end)
        shift = [b * end + lead - sum(lengths[:b]) for b, lead in enumerate(self._lead)]
        total = sum(lengths)
        device = self.cu_seqlens.device
        return torch.arange(total, device=device) + to_device(shift, device, torch.int64).repeat_interleave(
            to_device(lengths, device, torch.int64), output_size=total)

    @functools.cached_property
    def cu_keys(self) -> torch.Tensor:
        """[n + 1] (int32): each segment's keys within ``keys``: its queries and the tokens of its document before
        the piece."""
        return to_device([0, *itertools.accumulate(self._key_counts)], self.cu_seqlens.device)

    @functools.cached_property
    def max_keys(self) -> int:
        return max(self._key_counts)

    def repeat(self, n: int):
        raise ValueError("context_parallel_model: packed documents split across ranks cannot be repeated for "
                         "KLA+'s posterior samples (config.mc_samples > 0); set mc_samples = 0")


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


def context_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup | None = None,
                          position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's share of the causal-LM loss of sequences split across the ranks of ``group``.

    logits [B, T_r, V] and labels [B, T_r] (−100: not scored) are this rank's pieces, labels unshifted as
    ``KalmixForCausalLM`` takes them: position t predicts the label at t + 1, the piece's last position the next
    rank's first label (the last rank's last position predicts nothing). ``position_ids`` [B, T_r] (packed
    documents): each token's position within its document; a token at 0 starts one and is not predicted.
    Returns the piece's summed cross-entropy over the number of scored targets on all ranks, so the ranks'
    losses add up to the single-device mean cross-entropy (fp32 or wider).
    """
    if position_ids is not None and position_ids.shape != labels.shape:
        raise ValueError(f"context_parallel_loss: `position_ids` must be [B, T_r] like labels, "
                         f"{list(labels.shape)}; got {list(position_ids.shape)}")
    return ContextSplit(group).loss(logits, labels, None if position_ids is None else position_ids == 0)


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
