"""Edge inputs of every layer: an empty sequence (T = 0) and an unchecked NaN row in the VLA layer."""
import pytest
import torch

from kalmix.layers import MIXERS
from kalmix.layers.cache import KalmixCache

SMALL = {"kalman": dict(d_state=6, num_heads=2), "gka": dict(num_heads=2, num_iters=4),
         "kaczmarz": dict(num_heads=2), "vla": dict(num_heads=2), "gdn": dict(num_heads=2),
         "attention": dict(num_heads=2), "linear_attention": dict(num_heads=2), "gla": dict(num_heads=2),
         "mamba2": dict(num_heads=4, d_state=4)}


def make(name, d_model=8):
    torch.manual_seed(0)
    return MIXERS[name](d_model, **SMALL[name]).double()


@pytest.mark.parametrize("name", list(SMALL))
def test_empty_sequence_gives_empty_output_and_keeps_the_cache(name):
    layer = make(name)
    o, attn, cache = layer(torch.zeros(2, 0, 8, dtype=torch.float64))
    assert o.shape == (2, 0, 8) and attn is None and cache is None
    o, _, cache = layer(torch.zeros(2, 0, 8, dtype=torch.float64), use_cache=True)
    assert o.shape == (2, 0, 8) and isinstance(cache, KalmixCache) and cache.get_seq_length(0) == 0
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    full, _, _ = layer(torch.cat([x, torch.randn(2, 1, 8, dtype=torch.float64)], 1))
    _, _, cache = layer(x, use_cache=True)
    o, _, cache = layer(torch.zeros(2, 0, 8, dtype=torch.float64), past_key_values=cache, use_cache=True)
    assert o.shape == (2, 0, 8) and cache.get_seq_length(0) == 5
    mask = torch.ones(2, 5, dtype=torch.long)
    o, _, cache = layer(torch.zeros(2, 0, 8, dtype=torch.float64), attention_mask=mask, past_key_values=cache,
                        use_cache=True)
    assert o.shape == (2, 0, 8) and cache.get_seq_length(0) == 5


def test_vla_layer_nan_row_stays_in_its_sequence():
    layer = make("vla")
    x = torch.randn(3, 7, 8, dtype=torch.float64)
    x[1, 2] = float("nan")
    o, _, _ = layer(x)
    assert torch.isfinite(o[[0, 2]]).all() and o[1, 2:].isnan().all()


@pytest.mark.parametrize("flag", ["--steps", "--batch-size", "--seq-len", "--d-model", "--test-examples"])
def test_bench_mqar_rejects_non_positive_counts(flag, capsys):
    from kalmix.cli import main
    with pytest.raises(SystemExit) as e:
        main(["bench", "mqar", flag, "0"])
    assert e.value.code == 2 and "greater than or equal to 1" in capsys.readouterr().err
