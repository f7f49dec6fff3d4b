"""MQAR's defining properties."""
import pytest
import torch
from pydantic import ValidationError

from kalmix.tasks import MQARConfig


@pytest.mark.parametrize("T,D", [(64, 4), (128, 8), (256, 16), (256, 64)])
def test_structure(T, D):
    cfg = MQARConfig(vocab_size=8192, seq_len=T, num_kv_pairs=D, num_examples=50)
    x, y = cfg.build(seed=0)
    assert x.shape == y.shape == (50, T) and x.dtype == y.dtype == torch.long
    keys, values = x[:, 0:2 * D:2], x[:, 1:2 * D:2]
    assert ((keys >= 1) & (keys < 4096)).all() and ((values >= 4096) & (values < 8192)).all()
    for i in range(50):
        assert len(set(keys[i].tolist())) == D                         # distinct keys
        lookup = dict(zip(keys[i].tolist(), values[i].tolist()))
        scored = (y[i] != -100).nonzero()[:, 0]
        assert len(scored) == D                                        # every key is queried once
        assert ((scored - 2 * D) % 2 == 0).all() and (scored >= 2 * D).all()
        for pos in scored.tolist():
            assert lookup[x[i, pos].item()] == y[i, pos].item()        # the label is the queried key's value
        rest = torch.ones(T, dtype=torch.bool)
        rest[:2 * D] = False
        rest[scored] = False
        assert (x[i, rest] == 0).all()                                 # filler elsewhere
        assert (y[i, :2 * D] == -100).all()


def test_pure_function_of_config_and_seed():
    cfg = MQARConfig(vocab_size=512, seq_len=128, num_kv_pairs=8, num_examples=20)
    a, b, c = cfg.build(1), cfg.build(1), cfg.build(2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_power_law_favours_early_gaps():
    cfg = MQARConfig(vocab_size=8192, seq_len=512, num_kv_pairs=8, num_examples=400)
    _, y = cfg.build(0)
    slots = ((y != -100).nonzero()[:, 1] - 16) // 2                    # gap slot of each query
    space = (512 - 16) // 2
    assert (slots < space // 4).float().mean() > 0.4                   # uniform would give 0.25


def test_random_non_queries_keeps_structure():
    cfg = MQARConfig(vocab_size=256, seq_len=64, num_kv_pairs=4, num_examples=30, random_non_queries=True)
    x, y = cfg.build(0)
    plain, y0 = cfg.model_copy(update={"random_non_queries": False}).build(0)
    assert torch.equal(y, y0)
    assert (x == 0).float().mean() < 0.05 and (plain == 0).float().mean() > 0.5


def test_invalid_configs():
    with pytest.raises(ValidationError, match="vocab_size must exceed seq_len"):
        MQARConfig(vocab_size=64, seq_len=64, num_kv_pairs=4, num_examples=1)
    with pytest.raises(ValidationError, match="4 \\* num_kv_pairs <= seq_len"):
        MQARConfig(vocab_size=8192, seq_len=64, num_kv_pairs=17, num_examples=1)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        MQARConfig(vocab_size=8192, seq_len=64, num_kv_pairs=4, num_examples=1, typo=3)


def test_distinct_draws_in_blocks_equal_one_draw():
    from kalmix.tasks.mqar import distinct
    gen = torch.Generator().manual_seed(5)
    blocks = distinct(3000, 8191, 16, gen)                      # 2048 rows per block: two blocks
    one = torch.rand(3000, 8191, generator=torch.Generator().manual_seed(5)).argsort(1)[:, :16]
    assert torch.equal(blocks.sort(1).values, one.sort(1).values)          # the same draws, the same keys
    assert (blocks == one).all(1).double().mean() > 0.998                   # in the same order but for exact ties
    assert all(len(set(r.tolist())) == 16 for r in blocks[:100])
