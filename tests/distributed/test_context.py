"""Context parallelism (kalmix.distributed.context) on 2 and 4 gloo ranks (CPU, fp64, impl="torch").

One process group per world size runs every case (op × plain batch or packed sequences × variant × mode: the
relay for every op, the combine for the affine ones); rank 0 gathers the pieces' outputs, final states and
gradients, compares them with the single-device op and reports "ok" or what differs, per case."""
from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.distributed as dist

from kalmix.distributed import context_parallel, packed_piece
from kalmix.ops.common.testing import CASES
from kalmix.ops.common.varlen import check_offsets
from tests.distributed.gloo import run_cases

H, K, V, T = 2, 4, 3, 13
LENGTHS = {2: [5, 8], 4: [3, 4, 1, 5]}      # unequal pieces of T tokens; on 4 ranks one of length 1
# packed: empty sequences at the start, at a piece boundary (3) and at the end; [3, 9) crosses both boundaries of
# the length-1 piece on 4 ranks, so a rank with no sequence of its own passes it on
CU = [0, 0, 3, 3, 9, 13, 13]
OPS, LAYOUTS = ("kalman", "gka", "kaczmarz", "vla"), ("batch", "packed")
COMBINE_OPS = ("gka", "kaczmarz", "gla")     # mode="combine": the ops whose state map over a piece is affine
# initial state given or default, final state returned (and in the loss) or not, Kalman's variance or not
VARIANTS = {"given": (True, True, True), "default": (False, True, False), "no-final": (True, False, True)}
N_PARAMS = {"kalman": 2}                    # trailing time-invariant arguments (decay, process_noise): not split
EXTRA = {"vla": {"lambda0": 0.5}}           # a default A_0 other than the op's
TOL = 1e-10


def _case(rank: int, world: int, name: str, layout: str, variant: str, mode: str) -> str:
    """Run one case on this rank; on rank 0 returns "ok" or what differs from the single-device op."""
    case, packed = CASES[name], layout == "packed"
    gen = torch.Generator().manual_seed(list(CASES).index(name))
    B, n_seq = (1, len(CU) - 1) if packed else (2, 2)
    cu = torch.tensor(CU) if packed else None
    args = case.inputs(B, T, H, K, V, torch.float64, gen)
    given, want_final, variance = VARIANTS[variant]
    state = case.state(n_seq, H, K, V, torch.float64, gen) if given else None
    state = (state,) if torch.is_tensor(state) else state
    kw = dict(EXTRA.get(name, {}), impl="torch", output_final_state=want_final, cu_seqlens=cu)
    if name == "kalman":
        kw["output_variance"] = variance
    n_seq_args = len(args) - N_PARAMS.get(name, 0)

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


@pytest.mark.parametrize("op", ["kalman", "vla"])
def test_combine_refuses_non_affine_ops(op):
    """Kalman's and VLA's state maps are not affine: combine names the ops that are and points to the relay
    (before any message, so no process group is needed)."""
    args = CASES[op].inputs(1, 3, H, K, V, torch.float64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"mode='combine'.*kaczmarz_attention.*use mode='relay'"):
        context_parallel(CASES[op].fn, *args, mode="combine")
    with pytest.raises(ValueError, match="`mode` must be one of"):
        context_parallel(CASES[op].fn, *args, mode="scan")


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
