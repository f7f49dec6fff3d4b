"""Context parallelism: one sequence split in contiguous pieces across the ranks of a process group.

Context parallelism
-------------------
Rank r of R holds tokens [start_r, start_r + T_r) of every sequence (pieces may be unequal; each rank passes its
own piece, [B, T_r, H, ·]) and calls ``context_parallel(op, ..., mode=...)`` with the op's usual arguments. In
a relay, rank r receives the final state of rank r − 1 (rank 0 starts from the user's ``initial_state`` or the
op's default), runs the op on its piece from that state and sends its final state to rank r + 1. The backward
runs the relay in reverse: rank r receives the gradient of its final state from rank r + 1, backpropagates
through its piece and sends the gradient of its initial state to rank r − 1. Every tensor of a state tuple
goes across, in the op's compute dtype (fp32, fp64 for fp64 inputs). With ``cu_seqlens`` (packed sequences,
B = 1) only a sequence that crosses a piece boundary goes across it; every other sequence of a piece starts
from its own initial state.

Two modes run it (``mode=``, the same on every rank):

- "relay" (the default; every op): the state goes from rank to rank as above. Rank r waits for rank r − 1 in
  the forward and for rank r + 1 in the backward, so one call takes about R times a piece's time t. A rank
  moves on to its next layer once it has sent its state, so over a stack of L layers the ranks overlap (rank r
  runs layer l while rank r − 1 runs layer l + 1): about (L + R − 1)·t for the stack. Messages: one state per
  boundary and direction.
- "combine" (the ops whose state map over a piece is affine, S_out = P(S_in) + Q): every rank (1) summarises
  its piece's map (P_r, Q_r) in parallel with the others, (2) all-gathers the R summaries, (3) composes those
  of the ranks before it into its piece's true initial state (rank 0's Q already holds the given initial
  state) and (4) finishes its piece from it. The backward differentiates the same steps: the gradients of the
  gathered summaries are summed over the ranks onto each summary's rank (a reduce-scatter) and backpropagated,
  with the outputs' gradients, through the piece's graph (kept from the forward). Sequential depth O(1) in R,
  at more compute per rank, one all-gather in the forward and one reduce-scatter in the backward. With
  ``cu_seqlens`` only the sequence crossing a piece's start is composed; the pieces' start offsets still pass
  down the ranks as one small message each.

What each mixer allows:

- Kaczmarz (``kaczmarz_attention``, also GDN's op) and ``gated_linear_attention`` (linear attention, GLA,
  Mamba-2's SSD): relay and combine. S ↦ P S + Q over a piece, P [K, K] the product of the transitions
  γ_t (I − β_t k_t k_tᵀ) (β_t = η_t / (‖k_t‖² + eps)), or diag(exp Σ g_t) for GLA. A probe computes it: the
  op runs once on [0 | v] (K + V value columns) from [I | 0], which gives P, Q and the outputs' part linear in
  S_in, so no second call is needed (``_Columns``). GLA's diagonal P is probed as a full [K, K] matrix.
- Gated KalmaNet: relay and combine. H and U are decayed by one scalar per head and token, so P = exp(Σ g_t)
  per head and Q is the final state from zero, from a call with ``num_iters=0`` (the states do not depend on
  the solve); each token's solve needs the true H_t, so the outputs come from a second, full call from the
  composed initial state (``_DecayedSums``).
- The value-gated delta rule (the VLA notebook's DeltaNet): relay only. Its map is affine, S ↦ Σ_j P_j S e_j e_jᵀ
  + Q, but with one P_j [K, K] per value channel j (the decay acts on S's columns), which ``_Columns``' probe
  does not give; the notebook's 2-layer MQAR models do not need context parallelism.
- Kalman and variational linear attention: relay only (combine raises a ValueError). Their maps are not
  affine in the state: Kalman's precision follows a Möbius map (the mean is affine only given the precision
  path), VLA's A a Sherman–Morrison update (A⁻¹ adds up, but S's map depends on the initial A through the
  gains). A parallel scan would need two rounds of op-specific summaries (the precision or A first, then the
  mean's or S's map given it); it is not implemented.

Costs of combine per call and rank (estimates from the calls made, not measurements), t being one op call on
a piece: Kaczmarz and GLA about 2·t (the probe's K extra value columns; rank 0 runs without them, 1·t), GKA t
plus a solve-free call; an all-gather of R summaries of c·H·K·(K + V) (Kaczmarz, GLA) or c·H·(1 + K·K + K·V)
(GKA) elements (c = B, or 1 with ``cu_seqlens``), as many reduce-scattered in the backward; R − 1 small
compositions; the probe's activations K + V wide. The all-gather synchronises the ranks at every call, so
layers do not overlap: about 2·L·t for a stack of L Kaczmarz/GLA layers. When each wins: combine for a single
call on R >= 3 ranks (GKA: R >= 2), for a stack when R > L + 1, or when the ranks synchronise between mixer
layers anyway (softmax attention's all-gather in a hybrid breaks the relay's overlap); the relay for deep
stacks on few ranks (R <= L) and for memory.

A whole model runs context-parallel under ``kalmix.distributed.model.context_parallel_model``, which sends every
mixer's op through ``context_parallel`` in its ``mode``.

Requirements, as for any collective: every rank of the group makes the same sequence of calls with the same
batch, head and feature sizes, and when gradients are wanted every rank runs the backward of every call once
(each rank backpropagates its own loss; the gradients are those of the sum of the ranks' losses).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kalmix.ops import SPECS, OpSpec
from kalmix.ops.common.checks import compute_dtype
from kalmix.ops.common.varlen import Offsets, check_packed, offsets_from_host

# p2p tags: a piece's start offset, the states (forward) and their gradients (backward) never match each other
_TAG_START, _TAG_STATE, _TAG_GRAD = 1, 2, 3
MODES = ("relay", "combine")


class _Columns:
    """The combine of Kaczmarz and gated linear attention: S_t = A_t S_{t−1} + β_t k_t v_tᵀ with A_t [K, K]
    independent of S and v (Kaczmarz: γ_t (I − β_t k_t k_tᵀ); GLA: diag(exp g_t), β_t = 1) acts on each column
    of S alone, and o_t = scale · S_tᵀ q_t. One op call on [0 | v] (K zero columns before v, [B, T, H, K + V])
    from [I | 0] (the rows carried in) and [0 | S_0] (the rows starting here) yields the carried rows' P [K, K]
    (S ↦ P S + Q) and every row's Q [K, V] (its final state from zero, or from S_0), and per token
    o_probe = scale · P_tᵀ q_t [K] beside o_zero [V]; once S_in is known, o = o_zero + S_inᵀ o_probe and
    S_T = P S_in + Q, with no second call. Without carried rows (rank 0) the probe columns are left out.
    A summary: M = [P | Q] [c, H, K, K + V] (P = 0 for a row starting here). o_probe comes back in the
    activations' dtype (bf16: one more rounding of o than in the relay); the composition runs in the compute
    dtype."""

    @staticmethod
    def shapes(c, H, K, V):
        """The shapes of a summary of c rows."""
        return ((c, H, K, K + V),)

    @staticmethod
    def summarise(plan, kwargs, own):
        """The op's arguments (this rank's leaves) and the initial state of the rows starting here (``own``) ->
        (the summary of the rows carried on to the next rank, None if none is; what ``finish`` needs)."""
        p, (H, K, V) = plan.piece, plan.sizes
        w = K if p.n_in else 0          # probe columns, for the carried rows only
        state = F.pad(own[0], (w, 0))
        if p.n_in:
            eye = torch.eye(K, dtype=plan.dtype, device=plan.device).expand(p.n_in, H, K, K)
            state = torch.cat([F.pad(eye, (0, V)), state])
        o, S = plan.call({**kwargs, "v": F.pad(kwargs["v"], (w, 0))}, [state])
        n = p.hi - p.lo
        summary = [F.pad(S[n - p.n_out:], (K - w, 0))] if p.n_out else None
        return summary, (o, S, w)

    @staticmethod
    def compose(m, s):
        """The state s (the spec's tensors, c rows) after the piece summarised by m."""
        (m,), (s,) = m, s
        K = s.shape[-2]
        return [m[..., :K] @ s + m[..., K:]]

    @staticmethod
    def finish(plan, kwargs, own, s_in, cache):
        """-> ([o [B, T, H, V]], the final state's tensors [n, …]) from the carried rows' initial state ``s_in``
        (None without carried rows)."""
        o, S, w = cache
        o_zero, P, Q = o[..., w:], S[..., :w], S[..., w:]
        if s_in is None:
            return [o_zero], [Q]
        (s,), n_in = s_in, plan.piece.n_in
        o = (o_zero.to(s.dtype) + torch.einsum("bthk,bhkv->bthv", o[..., :w].to(s.dtype), s)).to(o.dtype)
        return [o], [torch.cat([Q[:n_in] + P[:n_in] @ s, Q[n_in:]])]


class _DecayedSums:
    """The combine of Gated KalmaNet: H and U are sums decayed by one γ_t per head, so a carried row maps
    (H, U) ↦ (d H + H_Q, d U + U_Q) with d = Π γ_t = exp(Σ g_t) over the piece [H] and (H_Q, U_Q) its final state
    from zero; the summary call runs with ``num_iters=0`` (the states do not depend on the solve). Each token's
    solve needs the true H_t, so the outputs come from a second call, from the combined initial state.
    A summary: (d [c, H], H_Q [c, H, K, K], U_Q [c, H, K, V]) (d = 0 for a row starting here). The methods are
    ``_Columns``'s."""

    @staticmethod
    def shapes(c, H, K, V):
        return (c, H), (c, H, K, K), (c, H, K, V)

    @staticmethod
    def summarise(plan, kwargs, own):
        p, n = plan.piece, plan.piece.hi - plan.piece.lo
        if not p.n_out:
            return None, None
        state = [torch.cat([z, o]) for z, o in zip(plan.defaults(p.n_in), own)] if plan.given else None
        _, (Hq, Uq) = plan.call({**kwargs, "num_iters": 0}, state)
        g = kwargs.get("g")
        d = Hq.new_zeros(p.n_out, plan.sizes[0])
        if p.n_in and n - p.n_out < p.n_in:      # the row carried on came in: the piece's tokens are all its own
            d = Hq.new_ones(d.shape) if g is None else g.to(d.dtype).sum(1).exp()
        return [d, Hq[n - p.n_out:], Uq[n - p.n_out:]], None

    @staticmethod
    def compose(m, s):
        d, Hq, Uq = m
        d = d[..., None, None]
        return [d * s[0] + Hq, d * s[1] + Uq]

    @staticmethod
    def finish(plan, kwargs, own, s_in, cache):
        state = [torch.cat([r, o]) for r, o in zip(s_in, own)] if s_in is not None else (own if plan.given else None)
        o, final = plan.call(kwargs, state)
        return [o], list(final)


# the combine rule an op's spec names (OpSpec.combine); every other op runs the relay only
COMBINE_RULES = {"columns": _Columns, "decayed_sums": _DecayedSums}
_SPEC_OF = {spec.fn: spec for spec in SPECS.values()}


@dataclass(frozen=True)
class Piece:
    """One rank's share of the sequences: local state row i is global sequence ``lo + i``.

    ``cu_seqlens`` are the global offsets clipped to the piece (checked ``Offsets``; None for a plain batch). The
    first ``n_in`` local rows continue from the previous rank's final state, the last ``n_out`` continue on the
    next rank; the rows in between start here from their own initial state and the rows before the last
    ``n_out`` end here.
    """
    lo: int
    hi: int
    n_in: int
    n_out: int
    cu_seqlens: Offsets | None = None


def packed_piece(cu_seqlens: Offsets, start: int, length: int, last: bool) -> Piece:
    """The piece [start, start + length) of the packed sequences at ``cu_seqlens`` (checked global offsets).

    A sequence belongs to every piece it has a token in; an empty sequence belongs to the piece holding its
    offset (the last piece for one at the very end). Its local offsets are the global ones clipped to the
    piece; only the first sequence can continue from the previous piece and only the last on the next one.
    """
    c = cu_seqlens.bounds
    end = start + length
    if length < 1 or end > c[-1] or (last and end != c[-1]):
        raise ValueError(f"context_parallel: the piece [{start}, {end}) of a rank does not fit the packed sequences "
                         f"of {c[-1]} tokens (pieces are non-empty, contiguous and end at cu_seqlens[-1])")
    members = [i for i in range(len(c) - 1) if (c[i] < end or last) and (c[i + 1] > start or c[i] >= start)]
    lo, hi = members[0], members[-1] + 1
    local = [min(max(x - start, 0), length) for x in c[lo:hi + 1]]
    return Piece(lo, hi, int(c[lo] < start), int(c[hi] > end),
                 offsets_from_host("context_parallel", local, length, cu_seqlens.tensor.device))


def context_parallel(op: Callable, *args, group: dist.ProcessGroup | None = None, mode: str = "relay", **kwargs):
    """Run a kalmix op on this rank's piece of the sequence, passing states between the ranks of ``group``.

    Args:
        op: ``kalman_attention``, ``gated_kalmanet``, ``kaczmarz_attention``, ``variational_linear_attention``,
            ``gated_linear_attention`` (the linear-attention, GLA and Mamba-2 baselines) or
            ``value_gated_delta_rule`` (the VLA notebook's DeltaNet).
        *args, **kwargs: the op's arguments, with this rank's piece of every activation: [B, T_r, H, ·], the
            pieces of rank 0, 1, … laid end to end being the whole sequence. Time-invariant tensors (Kalman's
            decay and process_noise) are passed whole on every rank.
        initial_state: the op's initial state for the whole batch ([N, …] with ``cu_seqlens``), the same on
            every rank; a sequence's row is read on the rank holding its first token (rank 0 for a plain
            batch), so its gradient is there and zero on the other ranks. None: the op's default.
        output_final_state: return the final states of the sequences whose last token is on this rank, [n_r, …]
            (n_r = 0 on all but the last rank for a plain batch); concatenated over the ranks in order they
            are the op's final state.
        cu_seqlens: [N + 1] global offsets of the packed sequences (B = 1), the same on every rank (checked as
            an op's, ``kalmix.ops.common.varlen``, but for their end, which only the last rank knows); each rank
            clips them to its piece (``packed_piece``), learning its piece's start from the previous rank.
        group: the process group (default: the world); rank r of the group holds the r-th piece.
        mode: "relay" (any op: the state goes from rank to rank) or "combine" (``kaczmarz_attention``,
            ``gated_linear_attention``, ``gated_kalmanet``: the ranks summarise their pieces' affine state maps
            in parallel, all-gather them and compose the maps before them); see the module docstring. The same
            on every rank.
    Returns:
        what ``op`` returns on this rank's piece: (o [B, T_r, H, V], final state or None), Kalman
        (o, variance or None, final state or None); the final state as described above.

    The backward keeps each piece's graph from the forward (no recomputation) and runs the relay in reverse, or
    reduce-scatters the gradients of the gathered summaries to their ranks (combine).
    """
    spec = _SPEC_OF.get(op)
    name = getattr(op, "__name__", type(op).__name__)
    if spec is None:
        raise TypeError(f"context_parallel: {name!r} is not a kalmix op; expected one of "
                        f"{[f.__name__ for f in _SPEC_OF]}")
    if mode not in MODES:
        raise ValueError(f"context_parallel: `mode` must be one of {MODES}, got {mode!r}")
    if mode == "combine" and spec.combine is None:
        raise ValueError(f"context_parallel: mode='combine' needs an op whose state map over a piece is affine "
                         f"({[f.__name__ for f, sp in _SPEC_OF.items() if sp.combine]}); {name} has no combine rule "
                         "(Kalman's precision follows a Möbius map, VLA's A a Sherman–Morrison one, the value-gated "
                         "delta rule decays each value channel apart): use mode='relay'")
    params = inspect.signature(op).bind(*args, **kwargs).arguments
    init = params.pop("initial_state", None)
    want_final = params.pop("output_final_state", False)
    cu = params.pop("cu_seqlens", None)
    init = () if init is None else ((init,) if spec.single_state else tuple(init))
    q, v = params["q"], params["v"]
    B, T, H, K = q.shape
    cu, n_seq = check_packed("context_parallel", cu, B, None, q.device)     # the end: ``packed_piece``
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
    plan = _Plan(op, spec, params, piece, prev, nxt, group, len(tensors), want_final, bool(init),
                 (H, K, v.shape[-1]), compute_dtype(q), q.device)
    out = (_Relay if mode == "relay" else _Combine).apply(plan, *tensors, *init)
    got = iter(out)             # the outputs requested (o, and Kalman's variance if asked for), the final states
    outs = [next(got) if flag is None or params.get(flag, False) else None for flag in spec.outputs]
    final = tuple(got) if want_final else None
    if final is not None and spec.single_state:
        final = final[0]
    return (*outs, final)


@dataclass
class _Plan:
    """What one call needs besides its tensors."""
    op: Callable
    spec: OpSpec
    params: dict
    piece: Piece
    prev: int | None
    nxt: int | None
    group: dist.ProcessGroup | None
    n_tensors: int      # the op's tensor arguments come first among the Function's inputs, the initial state after
    want_final: bool
    given: bool         # an initial state was given
    sizes: tuple[int, int, int]      # H, K, V
    dtype: torch.dtype
    device: torch.device

    def receive(self, n: int, src: int | None, tag: int) -> list[torch.Tensor]:
        """The n rows of every state tensor sent by ``src`` (nothing is received for n = 0)."""
        bufs = [torch.empty(s, dtype=self.dtype, device=self.device) for s in self.spec.state_shapes(n, *self.sizes)]
        if n:
            for b in bufs:
                dist.recv(b, src, group=self.group, tag=tag)
        return bufs

    def defaults(self, n: int) -> tuple[torch.Tensor, ...]:
        return self.spec.default_state(n, *self.sizes, self.dtype, self.device, self.params)

    def kwargs(self, leaves: list[torch.Tensor]) -> dict:
        """The op's arguments with ``leaves`` in place of its tensors."""
        given = iter(leaves)
        return {m: next(given) if isinstance(x, torch.Tensor) else x for m, x in self.params.items()}

    def call(self, kwargs: dict, state: list[torch.Tensor] | None):
        """The op on this piece from ``state`` ([n, …] tensors; None: the op's default), its final state returned."""
        if state is not None and self.spec.single_state:
            state = state[0]
        return self.op(**kwargs, initial_state=state, output_final_state=True, cu_seqlens=self.piece.cu_seqlens)

    def init_grads(self, needs: tuple[bool, ...], init: list, g_own: list[torch.Tensor]) -> list:
        """The gradient of each given initial-state tensor ((shape, dtype) in ``init``; None where ``needs`` says it
        wants none): ``g_own`` in the rows of the sequences starting on this rank, zeros elsewhere."""
        p, out = self.piece, []
        for (shape, dtype), want, g_rows in zip(init, needs, g_own):
            g = None
            if want:
                g = torch.zeros(shape, dtype=dtype, device=self.device)
                g[p.lo + p.n_in:p.hi] = g_rows
            out.append(g)
        return out


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
        state = None     # the op's own default (nothing received, nothing given)
        if p.n_in or init:
            recv = plan.receive(p.n_in, plan.prev, _TAG_STATE)
            own = (tuple(s[p.lo + p.n_in:p.hi].to(plan.dtype) for s in init) if init
                   else plan.defaults(n - p.n_in))
            # the initial state's gradient is wanted for the received rows and for a given initial state
            wanted = grad and (p.n_in > 0 or any(needs[plan.n_tensors:]))
            state = [torch.cat([r, o]).requires_grad_(wanted) for r, o in zip(recv, own)]
        with torch.enable_grad() if grad else torch.no_grad():
            out = plan.call(plan.kwargs(leaves), state)
        outs = [x for x in out[:spec.n_outputs] if x is not None]
        final = (out[-1],) if spec.single_state else tuple(out[-1])
        if p.n_out:
            for f in final:
                dist.send(f[n - p.n_out:].detach().contiguous(), plan.nxt, group=plan.group, tag=_TAG_STATE)
        if grad:
            ctx.plan, ctx.leaves, ctx.state, ctx.outs, ctx.final = plan, leaves, state or [], outs, final
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
        g_init = plan.init_grads(ctx.needs_input_grad[1 + plan.n_tensors:], ctx.init, [g[p.n_in:] for g in g_state])
        return (None, *g_leaves, *g_init)


class _Combine(torch.autograd.Function):
    """One rank's piece in parallel with the others: summarise the piece's affine state map (the spec's rule),
    all-gather the R summaries [R, N], compose those of the ranks before this one into this piece's initial state
    and finish the piece from it. The backward takes the gradient of the gathered summaries through the
    composition, sums each rank's over the group onto that rank (reduce-scatter) and backpropagates it, with the
    outputs' gradients, through this piece's graph in one pass."""

    @staticmethod
    def forward(ctx, plan: _Plan, *inputs):
        p, rule = plan.piece, COMBINE_RULES[plan.spec.combine]
        tensors, init = inputs[:plan.n_tensors], inputs[plan.n_tensors:]
        needs = ctx.needs_input_grad[1:]
        grad = any(needs)
        leaves = [t.detach().requires_grad_(g) for t, g in zip(tensors, needs)]
        wanted = grad and any(needs[plan.n_tensors:])
        own = ([s[p.lo + p.n_in:p.hi].detach().to(plan.dtype).requires_grad_(wanted) for s in init] if init
               else list(plan.defaults(p.hi - p.lo - p.n_in)))
        # a summary's tensors: for the B rows of a plain batch, or the one sequence a packed piece carries on
        shapes = rule.shapes(p.hi - p.lo if p.cu_seqlens is None else 1, *plan.sizes)
        sizes = [math.prod(s) for s in shapes]
        kwargs = plan.kwargs(leaves)
        with torch.enable_grad() if grad else torch.no_grad():
            summary, cache = rule.summarise(plan, kwargs, own)
            flat = (torch.cat([x.flatten() for x in summary]) if summary is not None
                    else torch.zeros(sum(sizes), dtype=plan.dtype, device=plan.device))
            gathered = flat.new_empty(dist.get_world_size(plan.group), flat.numel())
            dist.all_gather(list(gathered.unbind(0)), flat.detach(), group=plan.group)
            s_in = None
            if p.n_in:
                gathered.requires_grad_(grad)
                s_in = [torch.zeros(s, dtype=plan.dtype, device=plan.device)
                        for s in plan.spec.state_shapes(p.n_in, *plan.sizes)]
                for link in gathered[:dist.get_rank(plan.group)]:
                    s_in = rule.compose([x.view(s) for x, s in zip(link.split(sizes), shapes)], s_in)
            outs, final = rule.finish(plan, kwargs, own, s_in, cache)
            ends = [f[:p.hi - p.lo - p.n_out] for f in final] if plan.want_final else []
        if grad:
            ctx.plan, ctx.leaves, ctx.own, ctx.flat, ctx.gathered = plan, leaves, own, flat, gathered
            ctx.ys = [*outs, *ends]
            ctx.init = [(s.shape, s.dtype) for s in init]
        return (*[x.detach() for x in outs], *[f.detach() for f in ends])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        plan = ctx.plan
        pairs = [(y, g) for y, g in zip(ctx.ys, grads) if y.requires_grad]
        ys, gs = [y for y, _ in pairs], [g for _, g in pairs]
        g_gathered = None
        if ctx.gathered.requires_grad:
            g_gathered, = torch.autograd.grad(ys, ctx.gathered, gs, retain_graph=True, allow_unused=True)
        if g_gathered is None:
            g_gathered = torch.zeros_like(ctx.gathered)
        g_flat = torch.empty_like(ctx.flat)
        dist.reduce_scatter(g_flat, list(g_gathered.contiguous().unbind(0)), group=plan.group)
        if ctx.flat.requires_grad:
            ys, gs = [*ys, ctx.flat], [*gs, g_flat]
        wrt = [x for x in (*ctx.leaves, *ctx.own) if x.requires_grad]
        got = iter(torch.autograd.grad(ys, wrt, gs, allow_unused=True))
        g_wrt = [next(got) if x.requires_grad else None for x in (*ctx.leaves, *ctx.own)]
        g_own = [torch.zeros_like(s) if g is None else g for s, g in zip(ctx.own, g_wrt[len(ctx.leaves):])]
        return (None, *g_wrt[:len(ctx.leaves)], *plan.init_grads(ctx.needs_input_grad[1 + plan.n_tensors:],
                                                                  ctx.init, g_own))
