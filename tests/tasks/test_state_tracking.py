"""Word problems: the group tables are the groups they claim to be, and the labels are the running products."""
import itertools

import pytest
import torch
from pydantic import ValidationError

from kalmix.tasks.state_tracking import (GROUPS, WordProblemConfig, group_elements, group_order,
                                         multiplication_table, running_products, sequence_accuracy, token_accuracy)

ORDERS = {"A5": 60, "S5": 120, "A4xZ5": 60, "Z60": 60}


def inverses(table):
    return (table == 0).int().argmax(1)


def subgroup_generated(table, gens):
    """Closure of ``gens`` under the product (a finite set closed under products is a subgroup)."""
    found, frontier = {0} | set(gens), set(gens)
    while frontier:
        new = {table[a, b].item() for a in found for b in frontier} | {table[b, a].item() for a in found
                                                                         for b in frontier}
        frontier = new - found
        found |= frontier
    return found


def derived_subgroup(table, h):
    inv = inverses(table)
    comm = {table[table[inv[a], inv[b]], table[a, b]].item() for a in h for b in h}
    return subgroup_generated(table, comm)


def derived_series(table):
    series = [set(range(len(table)))]
    while True:
        nxt = derived_subgroup(table, series[-1])
        if nxt == series[-1]:
            return series
        series.append(nxt)


@pytest.mark.parametrize("group", GROUPS)
def test_table_is_a_group(group):
    t = multiplication_table(group)
    n = ORDERS[group]
    assert group_order(group) == n and t.shape == (n, n) and t.dtype == torch.long
    assert ((t >= 0) & (t < n)).all()                                       # closure
    assert torch.equal(t[0], torch.arange(n)) and torch.equal(t[:, 0], torch.arange(n))  # identity at 0
    assert (t.sort(1).values == torch.arange(n)).all()                      # Latin square: left and right
    assert (t.sort(0).values == torch.arange(n)[:, None]).all()             # inverses exist, cancellation
    inv = inverses(t)
    assert (t[torch.arange(n), inv] == 0).all() and (t[inv, torch.arange(n)] == 0).all()
    a = torch.arange(n)
    assert torch.equal(t[t][:, :, a], t[a[:, None, None], t[None, :, :]])  # associativity on all triples
    assert len(set(group_elements(group))) == n


def test_tables_are_fresh_copies():
    t = multiplication_table("A5")
    t.zero_()
    assert multiplication_table("A5")[1, 0].item() == 1


def test_permutation_convention():
    """(a·b)[x] = b[a[x]]: a is applied first."""
    for group in ("A5", "S5"):
        els, t = group_elements(group), multiplication_table(group)
        assert els[0] == (0, 1, 2, 3, 4) and els == sorted(els)               # lexicographic, identity first
        for i, j in itertools.product(range(0, len(els), 7), range(0, len(els), 5)):
            a, b = els[i], els[j]
            assert els[t[i, j]] == tuple(b[a[x]] for x in range(5))


def parity(p):
    return sum(p[i] > p[j] for i in range(len(p)) for j in range(i + 1, len(p))) % 2


def test_a5_s5_elements():
    a5, s5 = group_elements("A5"), group_elements("S5")
    assert len(a5) == 60 and all(parity(p) == 0 for p in a5)
    assert set(s5) == set(itertools.permutations(range(5)))
    assert set(a5) == {p for p in s5 if parity(p) == 0}


def test_abelian_or_not():
    for group, abelian in [("A5", False), ("S5", False), ("A4xZ5", False), ("Z60", True)]:
        t = multiplication_table(group)
        assert torch.equal(t, t.T) == abelian
    t = multiplication_table("Z60")
    assert torch.equal(t, (torch.arange(60)[:, None] + torch.arange(60)) % 60)


def test_a4xz5_layout():
    els = group_elements("A4xZ5")
    assert els[0] == ((0, 1, 2, 3), 0)
    assert all(parity(a) == 0 for a, _ in els) and [z for _, z in els[:5]] == list(range(5))


def test_derived_series_solvable_vs_not():
    """A5 is perfect (its derived series stops at A5); A4xZ5 is solvable (reaches {e}): not isomorphic."""
    a5 = derived_series(multiplication_table("A5"))
    assert len(a5) == 1 and len(a5[0]) == 60
    a4z5 = derived_series(multiplication_table("A4xZ5"))
    assert [len(h) for h in a4z5] == [60, 4, 1]                             # A4xZ5 > V4 > {e}
    s5 = derived_series(multiplication_table("S5"))
    assert [len(h) for h in s5] == [120, 60]                                # S5 > A5, then stuck
    assert [len(h) for h in derived_series(multiplication_table("Z60"))] == [60, 1]


@pytest.mark.parametrize("group", GROUPS)
def test_labels_are_left_to_right_products(group):
    cfg = WordProblemConfig(group=group, seq_len=37, num_examples=40)
    x, y = cfg.build(seed=3)
    t = multiplication_table(group).tolist()
    assert x.shape == y.shape == (40, 37) and x.dtype == y.dtype == torch.long
    assert ((x >= 0) & (x < cfg.num_classes)).all() and ((y >= 0) & (y < cfg.num_classes)).all()
    for xi, yi in zip(x.tolist(), y.tolist()):
        state = 0
        for g, label in zip(xi, yi):
            state = t[state][g]                                             # s_i = s_{i-1} · g_i
            assert label == state


def test_products_are_permutations_applied_in_order():
    cfg = WordProblemConfig(group="S5", seq_len=9, num_examples=5)
    x, y = cfg.build(0)
    els = group_elements("S5")
    for xi, yi in zip(x.tolist(), y.tolist()):
        arrangement = list(range(5))                                        # state of x: where it has moved to
        for g, label in zip(xi, yi):
            arrangement = [els[g][v] for v in arrangement]
            assert tuple(arrangement) == els[label]


def test_running_products_scan_any_length():
    t = multiplication_table("S5")
    for k in (1, 2, 3, 16, 17, 100):
        e = torch.randint(120, (3, k), generator=torch.Generator().manual_seed(k))
        out = running_products(t, e)
        ref = e.clone()
        for i in range(1, k):
            ref[:, i] = t[ref[:, i - 1], e[:, i]]
        assert torch.equal(out, ref)


def test_uniform_inputs():
    x, _ = WordProblemConfig(group="S5", seq_len=100, num_examples=200).build(0)
    counts = torch.bincount(x.flatten(), minlength=120).float()
    assert counts.min() > 0.5 * counts.mean() and counts.max() < 1.5 * counts.mean()


def test_pure_function_of_config_and_seed():
    cfg = WordProblemConfig(group="A5", seq_len=64, num_examples=20)
    a, b, c = cfg.build(1), cfg.build(1), cfg.build(2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_invalid_configs():
    with pytest.raises(ValidationError, match="Input should be 'A5', 'S5', 'A4xZ5' or 'Z60'"):
        WordProblemConfig(group="A6", seq_len=8, num_examples=1)
    with pytest.raises(ValidationError, match="greater than 0"):
        WordProblemConfig(group="A5", seq_len=0, num_examples=1)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        WordProblemConfig(group="A5", seq_len=8, num_examples=1, k=8)
    with pytest.raises(ValueError, match="unknown group 'A6'"):
        multiplication_table("A6")


def test_accuracies():
    labels = torch.tensor([[1, 2, 3], [4, 5, -100], [7, 8, 9]])
    pred = torch.tensor([[1, 2, 3], [4, 5, 0], [7, 0, 9]])
    assert token_accuracy(pred, labels) == pytest.approx(7 / 8)
    assert sequence_accuracy(pred, labels) == pytest.approx(2 / 3)
    logits = torch.nn.functional.one_hot(pred, 10).float()
    assert token_accuracy(logits, labels) == pytest.approx(7 / 8)
    assert sequence_accuracy(logits, labels) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="pred must be"):
        token_accuracy(pred[:, :2], labels)
