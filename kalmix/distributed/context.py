"""Context parallelism: one sequence split in contiguous pieces across the ranks of a process group.

Context parallelism
-------------------
Rank r of R holds tokens [start_r, start_r + T_r) of every sequence (pieces may be unequal; each rank passes its
own piece, [B, T_r, H, ·]) and calls ``context_parallel(op, ...)`` with the op's usual arguments. The ranks form
a relay: rank r receives the final state of rank r − 1 (rank 0 starts from the user's ``initial_state`` or the
op's default), runs the op on its piece from that state and sends its final state to rank r + 1. The backward
runs the relay in reverse: rank r receives the gradient of its final state from rank r + 1, backpropagates
through its piece and sends the gradient of its initial state to rank r − 1. Every tensor of a state tuple
goes across, in the op's compute dtype (fp32, fp64 for fp64 inputs). With ``cu_seqlens`` (packed sequences,
B = 1) only a sequence that crosses a piece boundary goes across it; every other sequence of a piece starts
from its own initial state.

A relay is what this module implements: rank r waits for rank r − 1 in the forward and for rank r + 1 in the
backward, so one call takes about R times as long as one piece. A rank moves on to its next layer once it has
sent its state, so over a stack of layers the ranks overlap (rank r runs layer l while rank r − 1 runs layer
l + 1), and each rank holds the activations of its piece only. Each mixer allows more than a relay: the map
from a piece's initial state to its final state composes associatively, so the ranks could summarise their
pieces in parallel, combine the R summaries by a scan and then all run from their true initial states.

- Kalman: per (head, slot, channel) the precision follows a Möbius map (a 2x2 matrix product over the piece,
  renormalised) and, given the precision path, the mean follows an affine map (gain product, offset); two
  scans of those summaries give every rank its initial (precision, mean).
- Kaczmarz (a gated delta rule): S ↦ P S + Q over a piece, with P [K, K] the product of the transitions
  γ_t (I − β_t k_t k_tᵀ) and Q [K, V]; the affine maps compose.
- Gated KalmaNet: H and U are scalar-decayed sums, so a piece's summary is (Π γ, H, U from zero); combining
  them gives the initial (H, U) exactly. Each token's solve needs the full H_t and U_t, so the outputs are
  computed only after that combination.
- Variational linear attention: the A path is Sherman–Morrison, i.e. A_t⁻¹ = A_{t−1}⁻¹ + û_t û_tᵀ, additive
  (n is additive too); given the initial A, S follows an identity-plus-low-rank delta rule, whose affine
  piece maps compose as Kaczmarz's do.

A whole model runs context-parallel under ``kalmix.distributed.model.context_parallel_model``, which sends every
mixer's op through ``context_parallel``.

Requirements, as for any collective: every rank of the group makes the same sequence of calls with the same
batch, head and feature sizes, and when gradients are wanted every rank runs the backward of every call once
(each rank backpropagates its own loss; the gradients are those of the sum of the ranks' losses).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from kalmix.ops import (gated_kalmanet, gated_linear_attention, kaczmarz_attention, kalman_attention,
                        variational_linear_attention)
from kalmix.ops.common.checks import compute_dtype

# p2p tags: a piece's start offset, the states (forward) and their gradients (backward) never match each other
_TAG_START, _TAG_STATE, _TAG_GRAD = 1, 2, 3


@dataclass(frozen=True)
class _StateSpec:
    """How an op's state looks: its tensors' shapes for n sequences, its default and the op's outputs."""
    shapes: Callable[[int, int, int, int], tuple[tuple[int, ...], ...]]    # (n, H, K, V) -> one shape per tensor
    default: Callable[..., tuple[torch.Tensor, ...]]                       # (n, H, K, V, dtype, device, kwargs)
    single: bool = False     # the state is one tensor, not a tuple (Kaczmarz)
    n_outputs: int = 1       # outputs before the state: (o,), Kalman (o, variance)


def _vla_default(n, H, K, V, dtype, device, kwargs):
    lambda0 = kwargs.get("lambda0", inspect.signature(variational_linear_attention).parameters["lambda0"].default)
    eye = torch.eye(K, dtype=dtype, device=device) / lambda0
    return (torch.zeros(n, H, K, V, dtype=dtype, device=device), eye.expand(n, H, K, K),
            torch.zeros(n, H, K, dtype=dtype, device=device))


def _matrix_state() -> _StateSpec:
    """One [n, H, K, V] state starting at zero (the delta rule's, gated linear attention's)."""
    return _StateSpec(lambda n, H, K, V: ((n, H, K, V),),
                      lambda n, H, K, V, dtype, device, kw: (torch.zeros(n, H, K, V, dtype=dtype, device=device),),
                      single=True)


_SPECS = {
    kaczmarz_attention: _matrix_state(),
    gated_linear_attention: _matrix_state(),
    gated_kalmanet: _StateSpec(
        lambda n, H, K, V: ((n, H, K, K), (n, H, K, V)),
        lambda n, H, K, V, dtype, device, kw: (torch.zeros(n, H, K, K, dtype=dtype, device=device),
                                               torch.zeros(n, H, K, V, dtype=dtype, device=device))),
    variational_linear_attention: _StateSpec(
        lambda n, H, K, V: ((n, H, K, V), (n, H, K, K), (n, H, K)), _vla_default),
    kalman_attention: _StateSpec(
        lambda n, H, K, V: ((n, H, K, V), (n, H, K, V)),     # (precision, mean) [n, H, N, D]
        lambda n, H, K, V, dtype, device, kw: (torch.ones(n, H, K, V, dtype=dtype, device=device),
                                               torch.zeros(n, H, K, V, dtype=dtype, device=device)),
        n_outputs=2),
}


@dataclass(frozen=True)
class Piece:
    """One rank's share of the sequences: local state row i is global sequence ``lo + i``.

    ``cu_seqlens`` are the global offsets clipped to the piece (None for a plain batch). The first ``n_in``
    local rows continue from the previous rank's final state, the last ``n_out`` continue on the next rank;
    the rows in between start here from their own initial state and the rows before the last ``n_out`` end
    here.
    """
    lo: int
    hi: int
    n_in: int
    n_out: int
    cu_seqlens: torch.Tensor | None = None


def packed_piece(cu_seqlens: torch.Tensor, start: int, length: int, last: bool) -> Piece:
    """The piece [start, start + length) of the packed sequences at ``cu_seqlens`` [N + 1] (global offsets).

    A sequence belongs to every piece it has a token in; an empty sequence belongs to the piece holding its
    offset (the last piece for one at the very end). Its local offsets are the global ones clipped to the
    piece; only the first sequence can continue from the previous piece and only the last on the next one.
    """
    c = cu_seqlens.tolist()
    end = start + length
    if length < 1 or end > c[-1] or (last and end != c[-1]):
        raise ValueError(f"context_parallel: the piece [{start}, {end}) of a rank does not fit the packed sequences "
                         f"of {c[-1]} tokens (pieces are non-empty, contiguous and end at cu_seqlens[-1])")
    members = [i for i in range(len(c) - 1) if (c[i] < end or last) and (c[i + 1] > start or c[i] >= start)]
    lo, hi = members[0], members[-1] + 1
    local = [min(max(x - start, 0), length) for x in c[lo:hi + 1]]
    return Piece(lo, hi, int(c[lo] < start), int(c[hi] > end), torch.tensor(local, dtype=cu_seqlens.dtype,
                                                                             device=cu_seqlens.device))


def context_parallel(op: Callable, *args, group: dist.ProcessGroup | None = None, **kwargs):
    """Run a kalmix op on this rank's piece of the sequence, passing states between the ranks of ``group``.

    Args:
        op: ``kalman_attention``, ``gated_kalmanet``, ``kaczmarz_attention``, ``variational_linear_attention`` or
            ``gated_linear_attention`` (the linear-attention, GLA and Mamba-2 baselines).
        *args, **kwargs: the op's arguments, with this rank's piece of every activation: [B, T_r, H, ·], the
            pieces of rank 0, 1, … laid end to end being the whole sequence. Time-invariant tensors (Kalman's
            decay and process_noise) are passed whole on every rank.
        initial_state: the op's initial state for the whole batch ([N, …] with ``cu_seqlens``), the same on
            every rank; a sequence's row is read on the rank holding its first token (rank 0 for a plain
            batch), so its gradient is there and zero on the other ranks. None: the op's default.
        output_final_state: return the final states of the sequences whose last token is on this rank, [n_r, …]
            (n_r = 0 on all but the last rank for a plain batch); concatenated over the ranks in order they
            are the op's final state.
        cu_seqlens: [N + 1] global offsets of the packed sequences (B = 1), the same on every rank; each rank
            clips them to its piece (``packed_piece``), learning its piece's start from the previous rank.
        group: the process group (default: the world); rank r of the group holds the r-th piece.
    Returns:
        what ``op`` returns on this rank's piece: (o [B, T_r, H, V], final state or None), Kalman
        (o, variance or None, final state or None); the final state as described above.

    The backward keeps each piece's graph from the forward (no recomputation) and runs the relay in reverse.
    """
    spec = _SPECS.get(op)
    if spec is None:
        name = getattr(op, "__name__", type(op).__name__)
        raise TypeError(f"context_parallel: {name!r} is not a kalmix op; expected one of "
                        f"{[f.__name__ for f in _SPECS]}")
    params = inspect.signature(op).bind(*args, **kwargs).arguments
    init = params.pop("initial_state", None)
    want_final = params.pop("output_final_state", False)
    cu = params.pop("cu_seqlens", None)
    init = () if init is None else ((init,) if spec.single else tuple(init))
    q, v = params["q"], params["v"]
    B, T, H, K = q.shape
    n_seq = B if cu is None else len(cu) - 1
    for i, s in enumerate(init):
        if s.shape[0] != n_seq:
            raise ValueError(f"context_parallel: initial_state[{i}] has {s.shape[0]} rows; the op has {n_seq} "
                             "sequences (the whole batch's initial state goes to every rank)")

    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    prev = dist.get_global_rank(group, rank - 1) if rank > 0 else None
    nxt = dist.get_global_rank(group, rank + 1) if rank < world - 1 else None
    if cu is None:
        piece = Piece(0, B, B if prev is not None else 0, B if nxt is not None else 0)
    else:
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.is_floating_point() or B != 1:
            raise ValueError("context_parallel: `cu_seqlens` must be a 1-D integer tensor [N + 1] of packed "
                             f"sequences (B = 1), got {cu!r:.80} with B = {B}")
        # the start offsets travel down the ranks ahead of the states, so a piece that continues no sequence
        # starts at once
        start = torch.zeros(1, dtype=torch.int64, device=q.device)
        if prev is not None:
            dist.recv(start, prev, group=group, tag=_TAG_START)
        sent = dist.isend(start + T, nxt, group=group, tag=_TAG_START) if nxt is not None else None
        piece = packed_piece(cu, int(start), T, last=nxt is None)
        if sent is not None:
            sent.wait()

    tensors = [x for x in params.values() if isinstance(x, torch.Tensor)]
    plan = _Plan(op, spec, params, piece, prev, nxt, group, len(tensors), want_final,
                 (H, K, v.shape[-1]), compute_dtype(q), q.device)
    out = _Relay.apply(plan, *tensors, *init)
    variance = spec.n_outputs == 2 and params.get("output_variance", False)
    final = tuple(out[1 + variance:]) if want_final else None
    if final is not None and spec.single:
        final = final[0]
    if spec.n_outputs == 2:      # Kalman: (o, variance, state)
        return out[0], (out[1] if variance else None), final
    return out[0], final


@dataclass
class _Plan:
    """What one call's relay needs besides its tensors."""
    op: Callable
    spec: _StateSpec
    params: dict
    piece: Piece
    prev: int | None
    nxt: int | None
    group: dist.ProcessGroup | None
    n_tensors: int      # the op's tensor arguments come first among the Function's inputs, the initial state after
    want_final: bool
    sizes: tuple[int, int, int]      # H, K, V
    dtype: torch.dtype
    device: torch.device

    def receive(self, n: int, src: int | None, tag: int) -> list[torch.Tensor]:
        """The n rows of every state tensor sent by ``src`` (nothing is received for n = 0)."""
        bufs = [torch.empty(s, dtype=self.dtype, device=self.device) for s in self.spec.shapes(n, *self.sizes)]
        if n:
            for b in bufs:
                dist.recv(b, src, group=self.group, tag=tag)
        return bufs

    def defaults(self, n: int) -> tuple[torch.Tensor, ...]:
        return self.spec.default(n, *self.sizes, self.dtype, self.device, self.params)


class _Relay(torch.autograd.Function):
    """One rank's piece: receive the initial state, run the op (keeping its graph), send the final state; the
    backward receives the final state's gradient, backpropagates through the kept graph and sends the initial
    state's gradient."""

    @staticmethod
    def forward(ctx, plan: _Plan, *inputs):
        p, spec = plan.piece, plan.spec
        tensors, init = inputs[:plan.n_tensors], inputs[plan.n_tensors:]
        needs = ctx.needs_input_grad[1:]
        grad = any(needs)
        leaves = [t.detach().requires_grad_(g) for t, g in zip(tensors, needs)]
        n = p.hi - p.lo
        state = []       # empty: the op's own default (nothing received, nothing given)
        if p.n_in or init:
            recv = plan.receive(p.n_in, plan.prev, _TAG_STATE)
            own = (tuple(s[p.lo + p.n_in:p.hi].to(plan.dtype) for s in init) if init
                   else plan.defaults(n - p.n_in))
            # the initial state's gradient is wanted for the received rows and for a given initial state
            wanted = grad and (p.n_in > 0 or any(needs[plan.n_tensors:]))
            state = [torch.cat([r, o]).requires_grad_(wanted) for r, o in zip(recv, own)]
        given = iter(leaves)
        kwargs = {m: next(given) if isinstance(x, torch.Tensor) else x for m, x in plan.params.items()}
        with torch.enable_grad() if grad else torch.no_grad():
            out = plan.op(**kwargs, initial_state=(state[0] if spec.single else state) if state else None,
                          output_final_state=True, cu_seqlens=p.cu_seqlens)
        outs = [x for x in out[:spec.n_outputs] if x is not None]
        final = (out[-1],) if spec.single else tuple(out[-1])
        if p.n_out:
            for f in final:
                dist.send(f[n - p.n_out:].detach().contiguous(), plan.nxt, group=plan.group, tag=_TAG_STATE)
        if grad:
            ctx.plan, ctx.leaves, ctx.state, ctx.outs, ctx.final = plan, leaves, state, outs, final
            ctx.init = [(s.shape, s.dtype) for s in init]
        ends = [f[:n - p.n_out].detach() for f in final] if plan.want_final else []
        return (*[o.detach() for o in outs], *ends)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        plan, p = ctx.plan, ctx.plan.piece
        n = p.hi - p.lo
        g_outs, g_ends = grads[:len(ctx.outs)], grads[len(ctx.outs):]
        if not g_ends:      # the final states were not returned, so this rank's loss does not depend on them
            g_ends = [torch.zeros_like(f[:n - p.n_out]) for f in ctx.final]
        g_next = plan.receive(p.n_out, plan.nxt, _TAG_GRAD)
        g_final = [torch.cat([e, x]) for e, x in zip(g_ends, g_next)]
        # an output that depends on no input wanting a gradient (Kalman's variance when only v does) is left out
        pairs = [(y, g) for y, g in zip([*ctx.outs, *ctx.final], [*g_outs, *g_final]) if y.requires_grad]
        wrt = [x for x in (*ctx.leaves, *ctx.state) if x.requires_grad]
        got = iter(torch.autograd.grad([y for y, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))
        g_wrt = [next(got) if x.requires_grad else None for x in (*ctx.leaves, *ctx.state)]
        g_leaves = g_wrt[:len(ctx.leaves)]
        g_state = [torch.zeros_like(s) if g is None else g for s, g in zip(ctx.state, g_wrt[len(ctx.leaves):])]
        if p.n_in:
            for g in g_state:
                dist.send(g[:p.n_in].contiguous(), plan.prev, group=plan.group, tag=_TAG_GRAD)
        # a given initial state's rows that start here get their gradient here; the other ranks give zeros
        g_init = []
        for i, (shape, dtype) in enumerate(ctx.init):
            g = None
            if ctx.needs_input_grad[1 + plan.n_tensors + i]:
                g = torch.zeros(shape, dtype=dtype, device=plan.device)
                g[p.lo + p.n_in:p.hi] = g_state[i][p.n_in:]
            g_init.append(g)
        return (None, *g_leaves, *g_init)
