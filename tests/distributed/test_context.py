"""Context parallelism (kalmix.distributed.context) on 2 and 4 gloo ranks (CPU, fp64, impl="torch").

One process group per world size runs every case (op × plain batch or packed sequences × variant × mode: the
relay for every op, the combine for the affine ones); rank 0 gathers the pieces' outputs, final states and
gradients, compares them with the single-device op and reports "ok" or what differs, per case."""
from __future__ import annotations

import functools
import inspect
import itertools

import pytest
import torch
import torch.distributed as dist

from kalmix.distributed import context_parallel, packed_piece
from kalmix.distributed.context import COMBINE_RULES, Piece, _Plan
from kalmix.ops import SPECS
from kalmix.ops.common import spec as op_spec
from kalmix.ops.common.varlen import check_offsets
from tests.distributed.gloo import run_cases

H, K, V, T = 2, 4, 3, 13
LENGTHS = {2: [5, 8], 4: [3, 4, 1, 5]}      # unequal pieces of T tokens; on 4 ranks one of length 1
# packed: empty sequences at the start, at a piece boundary (3) and at the end; [3, 9) crosses both boundaries of
# the length-1 piece on 4 ranks, so a rank with no sequence of its own passes it on
CU = [0, 0, 3, 3, 9, 13, 13]
OPS, LAYOUTS = tuple(SPECS), ("batch", "packed")
COMBINE_OPS = tuple(n for n, s in SPECS.items() if s.combine)    # mode="combine": the ops whose spec names a rule
RELAY_ONLY = tuple(n for n, s in SPECS.items() if not s.combine)
# initial state given or default, final state returned (and in the loss) or not, optional outputs (Kalman's
# variance) or not
VARIANTS = {"given": (True, True, True), "default": (False, True, False), "no-final": (True, False, True)}
EXTRA = {"vla": {"lambda0": 0.5}}           # a default A_0 other than the op's
TOL = 1e-10


def _case(rank: int, world: int, name: str, layout: str, variant: str, mode: str) -> str:
    """Run one case on this rank; on rank 0 returns "ok" or what differs from the single-device op."""
    case, packed = SPECS[name], layout == "packed"
    gen = torch.Generator().manual_seed(list(SPECS).index(name))
    B, n_seq = (1, len(CU) - 1) if packed else (2, 2)
    cu = torch.tensor(CU) if packed else None
    args = case.inputs(B, T, H, K, V, torch.float64, gen)
    given, want_final, variance = VARIANTS[variant]
    state = case.random_state(n_seq, H, K, V, torch.float64, gen) if given else None
    state = (state,) if torch.is_tensor(state) else state
    kw = dict(EXTRA.get(name, {}), impl="torch", output_final_state=want_final, cu_seqlens=cu)
    kw.update({flag: variance for flag in case.outputs if flag is not None})
    n_seq_args = len(args) - case.n_params      # the time-invariant arguments (Kalman's decay, noise) are not split

    def run(fn, xs, s0):
        s0 = None if s0 is None else (s0[0] if len(s0) == 1 else s0)
        out = fn(*xs, initial_state=s0, **kw)
        final = out[-1] if want_final else ()
        return [y for y in out[:-1] if y is not None], [final] if torch.is_tensor(final) else list(final)

    def leaves(xs):
        return [x.clone().requires_grad_() for x in xs]

    # the single-device op, every rank (cheap); the loss weights every output and final state at random
    ref_args, ref_s0 = leaves(args), None if state is None else leaves(state)
    ref_outs, ref_finals = run(case.fn, ref_args, ref_s0)
    w_outs = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in ref_outs]
    w_finals = [torch.randn(f.shape, generator=gen, dtype=torch.float64) for f in ref_finals]
    loss = sum((y * w).sum() for y, w in zip([*ref_outs, *ref_finals], [*w_outs, *w_finals]))
    ref_grads = torch.autograd.grad(loss, [*ref_args, *(ref_s0 or [])])

    # this rank's piece
    start, length = sum(LENGTHS[world][:rank]), LENGTHS[world][rank]
    cut = slice(start, start + length)
    cp_args = leaves([x[:, cut] for x in args[:n_seq_args]] + args[n_seq_args:])
    cp_s0 = None if state is None else leaves(state)
    outs, finals = run(functools.partial(context_parallel, case.fn, mode=mode), cp_args, cp_s0)
    counts = [None] * world
    dist.all_gather_object(counts, finals[0].shape[0] if finals else 0)
    rows = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
    loss = sum((y * w[:, cut]).sum() for y, w in zip(outs, w_outs)) + sum(
        (f * w[rows]).sum() for f, w in zip(finals, w_finals))
    loss.backward()

    def grad(x):
        return torch.zeros_like(x) if x.grad is None else x.grad

    mine = {"outs": [y.detach() for y in outs], "finals": [f.detach() for f in finals],
            "g_seq": [grad(x) for x in cp_args[:n_seq_args]], "g_par": [grad(x) for x in cp_args[n_seq_args:]],
            "g_s0": [grad(s) for s in cp_s0 or []]}
    got = [None] * world if rank == 0 else None
    dist.gather_object(mine, got, dst=0)
    if rank != 0:
        return ""

    # pieces laid end to end along T, final-state rows in rank order, the replicated inputs' gradients summed
    def joined(key, how):
        return [how(parts) for parts in zip(*(g[key] for g in got))]

    cat_t, cat_rows, add = functools.partial(torch.cat, dim=1), torch.cat, lambda parts: sum(parts)
    pairs = {"output": (joined("outs", cat_t), ref_outs),
             "final state": (joined("finals", cat_rows), ref_finals),
             "gradient of the activations": (joined("g_seq", cat_t), ref_grads[:n_seq_args]),
             "gradient of the parameters": (joined("g_par", add), ref_grads[n_seq_args:len(args)]),
             "gradient of the initial state": (joined("g_s0", add), ref_grads[len(args):])}
    for what, (xs, refs) in pairs.items():
        assert len(xs) == len(refs), f"{what}: {len(xs)} tensors, the op gives {len(refs)}"
        for i, (x, r) in enumerate(zip(xs, refs)):
            try:
                torch.testing.assert_close(x, r, rtol=TOL, atol=TOL)
            except AssertionError as e:
                return f"{what} [{i}]: {e}"
    return "ok"


def _cases() -> dict:
    keys = [*itertools.product(OPS, LAYOUTS, VARIANTS, ["relay"]),
            *itertools.product(COMBINE_OPS, LAYOUTS, VARIANTS, ["combine"])]
    return {"-".join(key): functools.partial(_key_case, key=key) for key in keys}


def _key_case(rank: int, world: int, key: tuple) -> str:
    return _case(rank, world, *key)


@functools.cache
def _results(world: int) -> dict:
    return run_cases(world, _cases)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_device(world, op, layout, variant):
    """Outputs, final states and the gradients of every input and of the initial state equal the op's."""
    assert _results(world)[f"{op}-{layout}-{variant}-relay"] == "ok"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", COMBINE_OPS)
@pytest.mark.parametrize("world", [2, 4])
def test_combine_matches_single_device(world, op, layout, variant):
    """mode="combine" (summaries all-gathered and composed) is as exact as the relay."""
    assert _results(world)[f"{op}-{layout}-{variant}-combine"] == "ok"


@pytest.mark.parametrize("op", RELAY_ONLY)
def test_combine_refuses_non_affine_ops(op):
    """Kalman's and VLA's state maps are not affine, the value-gated delta rule's has a map per value channel:
    combine names the ops it takes and points to the relay (before any message, so no process group is needed)."""
    args = SPECS[op].inputs(1, 3, H, K, V, torch.float64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"mode='combine'.*kaczmarz_attention.*use mode='relay'"):
        context_parallel(SPECS[op].fn, *args, mode="combine")
    with pytest.raises(ValueError, match="`mode` must be one of"):
        context_parallel(SPECS[op].fn, *args, mode="scan")


def test_every_rule_an_op_can_name_is_implemented():
    assert set(COMBINE_RULES) == set(op_spec.COMBINE_RULES)


@pytest.mark.parametrize("op", COMBINE_OPS)
def test_combine_rule_composes_on_random_inputs(op):
    """What a spec's combine rule claims, in one process: the rule summarises a piece's state map without knowing
    the state it starts from; that summary composed onto a random state S is the op's final state from S, and the
    piece finished from S gives the op's outputs from S (every row carried in and on, as on a middle rank)."""
    spec, n = SPECS[op], 2
    gen = torch.Generator().manual_seed(3)
    args = spec.inputs(n, T, H, K, V, torch.float64, gen)
    s = spec.random_state(n, H, K, V, torch.float64, gen)
    s = [s] if torch.is_tensor(s) else list(s)
    *ref_outs, ref_final = spec.fn(*args, initial_state=s[0] if spec.single_state else tuple(s),
                                   output_final_state=True, impl="torch")
    ref_final = [ref_final] if spec.single_state else list(ref_final)
    params = inspect.signature(spec.fn).bind(*args, impl="torch").arguments
    plan = _Plan(spec.fn, spec, params, Piece(0, n, n, n), None, None, None, len(args), True, False, (H, K, V),
                 torch.float64, torch.device("cpu"))
    rule, kwargs, own = COMBINE_RULES[spec.combine], plan.kwargs(list(args)), list(plan.defaults(0))
    summary, cache = rule.summarise(plan, kwargs, own)
    composed = rule.compose(summary, s)
    outs, final = rule.finish(plan, kwargs, own, s, cache)
    for what, xs, refs in (("composed state", composed, ref_final), ("final state", final, ref_final),
                           ("outputs", outs, ref_outs)):
        assert len(xs) == len(refs), what
        for x, r in zip(xs, refs):
            torch.testing.assert_close(x, r, rtol=TOL, atol=TOL, msg=lambda m: f"{op} {what}: {m}")


def test_packed_pieces():
    """4 pieces of CU: local offsets clipped, the crossing sequence continued, empty sequences placed once."""
    cu = check_offsets("test", torch.tensor(CU), None)
    got = [packed_piece(cu, s, n, last=r == 3) for r, (s, n) in enumerate(zip([0, 3, 7, 8], LENGTHS[4]))]
    assert all(p.cu_seqlens.tensor.tolist() == list(p.cu_seqlens.bounds) for p in got)
    assert [(p.lo, p.hi, p.n_in, p.n_out, list(p.cu_seqlens.bounds)) for p in got] == [
        (0, 2, 0, 0, [0, 0, 3]), (2, 4, 0, 1, [0, 0, 4]), (3, 4, 1, 1, [0, 1]), (3, 6, 1, 0, [0, 1, 5, 5])]
    with pytest.raises(ValueError, match="does not fit"):
        packed_piece(cu, 8, 4, last=True)


def test_rejects_other_ops():
    with pytest.raises(TypeError, match="not a kalmix op"):
        context_parallel(torch.add, torch.ones(1), torch.ones(1))
