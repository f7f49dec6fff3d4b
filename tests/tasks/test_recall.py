"""Needle, palindrome, stack, hard-MQAR and capacity-MQAR generators: their defining properties."""
import pytest
import torch
from pydantic import ValidationError

from kalmix.tasks.mqar import MQARConfig
from kalmix.tasks.recall import (CAPACITY_LONG_SEQ_LENS, CAPACITY_NUM_KV_PAIRS, CapacityMQARConfig, HardMQARConfig,
                                 NeedleConfig, PalindromeConfig, StackConfig)


def check_pure(cfg):
    a, b, c = cfg.build(1), cfg.build(1), cfg.build(2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    for t in a:
        assert t.shape == (cfg.num_examples, a[0].shape[1]) and t.dtype == torch.long


# ---------------------------------------------------------------------------------------------------- needle

@pytest.mark.parametrize("T", [4, 5, 64, 1024])
def test_needle_structure(T):
    cfg = NeedleConfig(seq_len=T, num_examples=64)
    x, y = cfg.build(0)
    assert x.shape == y.shape == (64, T)
    (k0, k1), (v0, v1), (f0, f1) = cfg.key_range, cfg.value_range, cfg.filler_range
    assert (k0, k1, v0, v1, f0, f1) == (1, 64, 64, 128, 128, 256) and cfg.query_token == 0
    assert (y[:, :-1] == -100).all()                                        # only the last position is scored
    assert (x[:, -2] == 0).all() and ((x[:, -1] >= k0) & (x[:, -1] < k1)).all()
    value = y[:, -1]
    assert ((value >= v0) & (value < v1)).all()
    for i in range(64):
        row, key = x[i].tolist(), x[i, -1].item()
        assert row.count(value[i].item()) == 1 and row.count(key) == 2 and row.count(0) == 1
        p = row.index(key)
        assert p <= T - 4 and row[p + 1] == value[i].item()               # the needle is ``k v``, before QUERY
        rest = [t for j, t in enumerate(row) if j not in (p, p + 1, T - 2, T - 1)]
        assert all(f0 <= t < f1 for t in rest)                              # filler elsewhere


def test_needle_position_uniform_and_depth():
    x, _ = NeedleConfig(seq_len=68, num_examples=2000).build(0)
    pos = ((x >= 1) & (x < 64)).int().argmax(1)                             # first key occurrence = the needle
    assert pos.min() == 0 and pos.max() == 64
    assert (pos < 32).float().mean().sub(0.5).abs() < 0.05
    for depth, expect in [(0.0, 0), (0.5, 32), (1.0, 64)]:
        x, y = NeedleConfig(seq_len=68, num_examples=10, depth=depth).build(0)
        assert (x[:, expect] == x[:, -1]).all() and (x[:, expect + 1] == y[:, -1]).all()


def test_needle_pure_and_invalid():
    check_pure(NeedleConfig(seq_len=256, num_examples=8))
    with pytest.raises(ValidationError, match="seq_len must be >= 4"):
        NeedleConfig(seq_len=3, num_examples=1)
    with pytest.raises(ValidationError, match="vocab_size must be >= 8"):
        NeedleConfig(seq_len=16, num_examples=1, vocab_size=7)
    with pytest.raises(ValidationError, match="less than or equal to 1"):
        NeedleConfig(seq_len=16, num_examples=1, depth=1.5)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        NeedleConfig(seq_len=16, num_examples=1, query_token=3)


# ---------------------------------------------------------------------------------------------------- palindrome

@pytest.mark.parametrize("L", [1, 2, 16, 100])
def test_palindrome_structure(L):
    cfg = PalindromeConfig(length=L, num_examples=50)
    x, y = cfg.build(0)
    assert cfg.seq_len == 2 * L and x.shape == y.shape == (50, 2 * L) and cfg.separator == 127
    content = x[:, :L]
    assert ((content >= 0) & (content < 127)).all() and (x[:, L] == 127).all()
    assert torch.equal(x[:, L + 1:], content.flip(1)[:, :L - 1])            # inputs: the reverse, teacher-forced
    assert (y[:, :L] == -100).all()                                         # only the reversed half is scored
    assert torch.equal(y[:, L:], content.flip(1))                           # ... and it is the reverse
    full = torch.cat([x, y[:, -1:]], dim=1)                                 # the unshifted 2L + 1 tokens
    assert torch.equal(full[:, L + 1:], full[:, :L].flip(1))


def test_palindrome_pure_and_invalid():
    check_pure(PalindromeConfig(length=32, num_examples=8))
    x, _ = PalindromeConfig(length=8, num_examples=100, vocab_size=10).build(0)
    assert (x[:, 8] == 9).all() and (x[:, :8] < 9).all() and x[:, :8].unique().numel() == 9
    with pytest.raises(ValidationError, match="vocab_size must be >= 2"):
        PalindromeConfig(length=8, num_examples=1, vocab_size=1)
    with pytest.raises(ValidationError, match="greater than 0"):
        PalindromeConfig(length=0, num_examples=1)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        PalindromeConfig(length=8, num_examples=1, seq_len=16)


# ---------------------------------------------------------------------------------------------------- stack

def simulate_stacks(cfg, row):
    """Reference: parse the (unshifted) token stream op by op with Python lists; expected labels (shifted)."""
    W, S = cfg.num_values, cfg.num_stacks
    stacks = [[] for _ in range(S)]
    expect = [-100] * len(row)
    pushes = pops = 0
    for j in range(0, len(row), 3):
        op = row[j]
        assert op in (cfg.push_token, cfg.pop_token)
        if j + 1 >= len(row):
            break
        sid = row[j + 1] - W
        assert 0 <= sid < S
        if op == cfg.push_token:
            if j + 2 < len(row):
                assert 0 <= row[j + 2] < W
                stacks[sid].append(row[j + 2])
                pushes += 1
        else:
            assert stacks[sid], "POP on an empty stack"
            if j + 2 < len(row):                                           # the answer slot exists
                assert row[j + 2] == cfg.query_token
            expect[j + 1] = stacks[sid].pop()                              # label at the stack-id token
            pops += 1
    return expect, pushes, pops


@pytest.mark.parametrize("T", [5, 6, 7, 8, 63, 300])
def test_stack_matches_reference(T):
    cfg = StackConfig(seq_len=T, num_examples=60, num_stacks=4, num_values=5)
    x, y = cfg.build(0)
    assert x.shape == y.shape == (60, T) and cfg.vocab_size == 12
    assert ((x >= 0) & (x < cfg.vocab_size)).all()
    for i in range(60):
        expect, _, _ = simulate_stacks(cfg, x[i].tolist())
        assert y[i].tolist() == expect
        assert x[i, 0] == cfg.push_token                                    # every stack starts empty


def test_stack_default_layout_and_statistics():
    cfg = StackConfig(seq_len=3 * 400 - 1, num_examples=50)
    assert (cfg.num_stacks, cfg.num_values, cfg.push_prob) == (64, 26, 0.6)
    assert (cfg.push_token, cfg.pop_token, cfg.query_token, cfg.vocab_size) == (90, 91, 92, 93)
    assert cfg.stack_token(0) == 26 and cfg.stack_token(63) == 89
    x, y = cfg.build(0)
    ops = x[:, 0::3]
    assert abs((ops == cfg.push_token).float().mean().item() - 0.6) < 0.02  # stacks are rarely all empty
    total_pops = 0
    for i in range(50):
        expect, _, pops = simulate_stacks(cfg, x[i].tolist())
        assert y[i].tolist() == expect
        total_pops += pops
    assert total_pops == (y != -100).sum().item()                          # every complete POP is scored once
    scored = y[y != -100]
    assert ((scored >= 0) & (scored < 26)).all() and scored.unique().numel() == 26
    assert ((y != -100) == (x == cfg.pop_token).roll(1, 1)).all()           # labels exactly at POPs' stack ids


def test_stack_forced_push_when_all_empty():
    cfg = StackConfig(seq_len=299, num_examples=200, num_stacks=1, num_values=3, push_prob=0.1)
    x, y = cfg.build(0)
    for i in range(200):
        expect, _, _ = simulate_stacks(cfg, x[i].tolist())                 # never pops an empty stack
        assert y[i].tolist() == expect
    ops = x[:, 0::3]
    assert (ops == 4).float().mean() > 0.45                                 # PUSH forced after each emptying


def test_stack_pure_and_invalid():
    check_pure(StackConfig(seq_len=128, num_examples=8))
    with pytest.raises(ValidationError, match="seq_len must be >= 5"):
        StackConfig(seq_len=4, num_examples=1)
    with pytest.raises(ValidationError, match="less than 1"):
        StackConfig(seq_len=64, num_examples=1, push_prob=1.0)
    with pytest.raises(ValidationError, match="greater than 0"):
        StackConfig(seq_len=64, num_examples=1, num_stacks=0)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        StackConfig(seq_len=64, num_examples=1, pop_prob=0.4)


# ---------------------------------------------------------------------------------------------------- hard MQAR

def check_mqar_rows(x, y, D, V, Q, random_filler):
    T = x.shape[1]
    for i in range(x.shape[0]):
        keys, values = x[i, 0:2 * D:2].tolist(), x[i, 1:2 * D:2].tolist()
        assert len(set(keys)) == D and all(1 <= k < V // 2 for k in keys)  # distinct keys
        assert len(set(values)) == D and all(V // 2 <= v < V for v in values)
        lookup = dict(zip(keys, values))
        scored = (y[i] != -100).nonzero()[:, 0].tolist()
        assert len(scored) == Q and all(p >= 2 * D and p % 2 == 0 for p in scored)
        asked = [x[i, p].item() for p in scored]
        assert set(asked) == set(keys)                                     # every key queried (at least once)
        for p in scored:
            assert y[i, p].item() == lookup[x[i, p].item()]                # the label is the queried key's value
        rest = torch.ones(T, dtype=torch.bool)
        rest[:2 * D] = False
        rest[scored] = False
        if not random_filler:
            assert (x[i, rest] == 0).all()


@pytest.mark.parametrize("random_filler", [True, False])
def test_hard_mqar_default_setting(random_filler):
    cfg = HardMQARConfig(num_kv_pairs=64, num_examples=6, random_non_queries=random_filler)
    assert (cfg.vocab_size, cfg.seq_len, cfg.queries) == (256, 2048, 64)
    x, y = cfg.build(0)
    assert x.shape == y.shape == (6, 2048) and ((x >= 0) & (x < 256)).all()
    check_mqar_rows(x, y, 64, 256, 64, random_filler)
    if random_filler:                                                      # keys recur in the filler, unscored
        keys = x[:, 0:128:2]
        in_filler = torch.isin(x[0, 128:], keys[0]) & (y[0, 128:] == -100)
        assert in_filler.sum() > 100


def test_hard_mqar_repeated_queries_and_max_keys():
    cfg = HardMQARConfig(num_kv_pairs=127, num_examples=4, num_queries=500, random_non_queries=False)
    x, y = cfg.build(0)
    check_mqar_rows(x, y, 127, 256, 500, False)
    cfg = HardMQARConfig(num_kv_pairs=8, num_examples=4, vocab_size=32, seq_len=64, num_queries=24)
    x, y = cfg.build(0)
    check_mqar_rows(x, y, 8, 32, 24, True)


def test_hard_mqar_equals_mqar_where_zoology_applies():
    for rnq in (False, True):
        hard = HardMQARConfig(num_kv_pairs=8, num_examples=20, vocab_size=512, seq_len=128, random_non_queries=rnq)
        mqar = MQARConfig(vocab_size=512, seq_len=128, num_kv_pairs=8, num_examples=20, random_non_queries=rnq)
        assert hard.as_mqar() == mqar
        for a, b in zip(hard.build(5), mqar.build(5)):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="num_queries must equal num_kv_pairs"):
        HardMQARConfig(num_kv_pairs=8, num_examples=1, num_queries=9).as_mqar()


def test_hard_mqar_pure_and_invalid():
    check_pure(HardMQARConfig(num_kv_pairs=16, num_examples=4))
    with pytest.raises(ValidationError, match="num_kv_pairs must be <= vocab_size // 2 - 1 = 127"):
        HardMQARConfig(num_kv_pairs=128, num_examples=1)
    with pytest.raises(ValidationError, match="seq_len must be even"):
        HardMQARConfig(num_kv_pairs=4, num_examples=1, seq_len=2047)
    with pytest.raises(ValidationError, match="num_queries must be >= num_kv_pairs"):
        HardMQARConfig(num_kv_pairs=8, num_examples=1, num_queries=4)
    with pytest.raises(ValidationError, match=r"2 \* num_kv_pairs \+ 2 \* num_queries <= seq_len"):
        HardMQARConfig(num_kv_pairs=8, num_examples=1, seq_len=64, num_queries=25)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        HardMQARConfig(num_kv_pairs=8, num_examples=1, d=8)


# ---------------------------------------------------------------------------------------------------- capacity

@pytest.mark.parametrize("n", CAPACITY_NUM_KV_PAIRS)
def test_capacity_layout(n):
    cfg = CapacityMQARConfig(num_kv_pairs=n, num_examples=20)
    x, y = cfg.build(0)
    T = 3 * n + 1
    assert cfg.full_seq_len == T and x.shape == y.shape == (20, T)
    assert ((x >= 0) & (x < 128)).all() and (x[:, 2 * n] == 0).all()      # the separator
    assert (y[:, :2 * n + 1] == -100).all() and (y[:, 2 * n + 1:] != -100).all()
    for i in range(20):
        keys, values = x[i, 0:2 * n:2].tolist(), x[i, 1:2 * n:2].tolist()
        assert len(set(keys)) == n and all(2 <= t < 128 for t in keys + values)
        queries = x[i, 2 * n + 1:].tolist()
        assert sorted(queries) == sorted(keys)                              # each key queried exactly once
        lookup = dict(zip(keys, values))
        assert y[i, 2 * n + 1:].tolist() == [lookup[q] for q in queries]   # label at the query position


@pytest.mark.parametrize("T", CAPACITY_LONG_SEQ_LENS)
def test_capacity_long_context(T):
    cfg = CapacityMQARConfig(num_kv_pairs=8, num_examples=10, seq_len=T)
    x, y = cfg.build(0)
    assert x.shape == y.shape == (10, T)
    assert (x[:, 16:T - 9] == cfg.pad_token).all() and (x[:, T - 9] == cfg.sep_token).all()
    assert (y[:, :T - 8] == -100).all()
    short = CapacityMQARConfig(num_kv_pairs=8, num_examples=10)             # same draws, only the gap grows
    xs, ys = short.build(0)
    assert torch.equal(x[:, :16], xs[:, :16]) and torch.equal(x[:, -9:], xs[:, -9:])
    assert torch.equal(y[:, -8:], ys[:, -8:])


def test_capacity_values_cover_vocab_and_queries_shuffled():
    x, _ = CapacityMQARConfig(num_kv_pairs=96, num_examples=50).build(0)
    assert x[:, 1:192:2].unique().numel() == 126
    keys, queries = x[:, 0:192:2], x[:, 193:]
    assert (keys == queries).float().mean() < 0.05


def test_capacity_pure_and_invalid():
    check_pure(CapacityMQARConfig(num_kv_pairs=16, num_examples=8))
    CapacityMQARConfig(num_kv_pairs=126, num_examples=1)
    with pytest.raises(ValidationError, match=r"num_kv_pairs = 127 distinct keys do not fit in the 126 key tokens"):
        CapacityMQARConfig(num_kv_pairs=127, num_examples=1)
    with pytest.raises(ValidationError, match="seq_len must be >= 3 \\* num_kv_pairs \\+ 1 = 25"):
        CapacityMQARConfig(num_kv_pairs=8, num_examples=1, seq_len=24)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        CapacityMQARConfig(num_kv_pairs=8, num_examples=1, sep_token=5)


# ------------------------------------------------------------------------------- the Kaczmarz release's MQAR

KLA = dict(vocab_size=8192, num_kv_pairs=32, sampling="replacement", placement="positions", power_a=0.9,
           random_non_queries=True)


def released_cdf(x, lo, hi, a=0.9):
    """P(position < x) under the density ∝ x^(a − 1) on [lo, hi)."""
    return (x ** a - lo ** a) / (hi ** a - lo ** a)


def test_released_mqar_queries_sit_far_after_the_pairs():
    x, y = HardMQARConfig(seq_len=2048, num_examples=1000, **KLA).build(0)
    pos = (y != -100).nonzero()[:, 1].double()
    assert pos.min() >= 64 and pos.max() <= 2045
    past = (pos >= 256).double().mean().item()
    assert abs(past - (1 - released_cdf(256, 64, 2046))) < 0.015 and past > 0.87      # the 89%
    mean_after = (pos - 64).mean().item()                                                  # the issue's ~950 tokens
    lo, hi = 64.0, 2046.0
    expect = 0.9 / 1.9 * (hi ** 1.9 - lo ** 1.9) / (hi ** 0.9 - lo ** 0.9) - 64
    assert abs(mean_after - expect) < 15
    zoology = HardMQARConfig(seq_len=2048, num_examples=1000, vocab_size=8192, num_kv_pairs=32).build(0)[1]
    past_gaps = ((zoology != -100).nonzero()[:, 1] >= 256).double().mean().item()
    assert 0.38 < past_gaps < 0.46                                                         # the gap layout: 42%


def test_released_mqar_layout_and_labels():
    cfg = HardMQARConfig(seq_len=256, num_examples=400, **KLA)
    x, y = cfg.build(0)
    assert x.shape == y.shape == (400, 256)
    keys, values = x[:, 0:64:2], x[:, 1:64:2]
    assert ((keys >= 1) & (keys < 4096)).all() and ((values >= 4096) & (values < 8192)).all()
    scored = y != -100
    assert not scored[:, :64].any() and not scored[:, 254:].any()
    per_row = scored.sum(1).double()
    assert per_row.max() <= 32 and 28 < per_row.mean() < 31        # 32 queries on 190 positions: some collide
    for i in range(50):
        bindings = {}
        for k, v in zip(keys[i].tolist(), values[i].tolist()):
            bindings.setdefault(k, set()).add(v)
        for p in scored[i].nonzero()[:, 0].tolist():
            assert y[i, p].item() in bindings[x[i, p].item()]        # the label is a value of the queried key
    dup = torch.tensor([len(set(r.tolist())) < 32 for r in keys]).double().mean().item()
    assert abs(dup - (1 - torch.prod(1 - torch.arange(32) / 4095.0).item())) < 0.05    # keys drawn with replacement
    filler = x[:, 64:][~scored[:, 64:]]
    assert abs(filler.double().mean().item() / 8191 - 0.5) < 0.01 and (filler < 4096).any()   # uniform over V
    distinct = HardMQARConfig(seq_len=256, num_examples=400, vocab_size=8192, num_kv_pairs=32,
                              placement="positions", power_a=0.9).build(0)[0][:, 0:64:2]
    assert all(len(set(r.tolist())) == 32 for r in distinct)
    check_pure(cfg)


def test_released_mqar_invalid():
    with pytest.raises(ValidationError, match="queries each pair once"):
        HardMQARConfig(num_kv_pairs=8, num_examples=1, placement="positions", num_queries=9)
    with pytest.raises(ValidationError, match=r"2 \* num_kv_pairs \+ 3 <= seq_len"):
        HardMQARConfig(num_kv_pairs=8, num_examples=1, seq_len=18, placement="positions")
    HardMQARConfig(num_kv_pairs=8, num_examples=1, seq_len=19, placement="positions")      # odd T is fine here
    HardMQARConfig(num_kv_pairs=200, num_examples=1, vocab_size=256, sampling="replacement")
    with pytest.raises(ValueError, match="sampling='distinct'"):
        HardMQARConfig(num_kv_pairs=8, num_examples=1, vocab_size=512, seq_len=128, **{
            "sampling": "replacement"}).as_mqar()


@pytest.mark.parametrize("T", [25, 512])
def test_capacity_fill_as_released(T):
    cfg = CapacityMQARConfig(num_kv_pairs=8, num_examples=2000, seq_len=T, queries="fill")
    x, y = cfg.build(0)
    assert x.shape == y.shape == (2000, T) and (x[:, 16] == cfg.sep_token).all()
    assert (x[:, 17:] != cfg.pad_token).all() or T == 25
    assert (y[:, :17] == -100).all() and (y[:, 17:] != -100).all()             # every position after SEP
    keys, values = x[:, 0:16:2], x[:, 1:16:2]
    hit = x[:, 17:, None] == keys[:, None, :]                                    # which pair each query asks
    assert (hit.sum(-1) == 1).all()
    assert torch.equal(y[:, 17:], (hit * values[:, None, :]).sum(-1))
    share = hit.double().mean((0, 1)) * 8
    assert (share - 1).abs().max() < 0.05                                        # keys drawn uniformly
    if T == 25:                                                                  # with replacement: 8!/8^8 are perms
        perm = (hit.sum(1) == 1).all(-1).double().mean().item()
        assert perm < 0.02
    check_pure(cfg)
