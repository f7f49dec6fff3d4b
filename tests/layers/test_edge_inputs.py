"""Edge inputs of every layer: an empty sequence (T = 0), an unchecked NaN row in the VLA layer, bad constructor
arguments and bad masks, each refused with a ValueError naming the argument."""
import pytest
import torch

from kalmix.layers import ALL_MIXERS, MIXERS
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


HEAD_MIXERS = ["attention", "gdn", "kaczmarz", "gka", "vla", "linear_attention", "gla", "deltanet"]


@pytest.mark.parametrize("name, kw, match", [
    *[(n, dict(num_heads=3), r"`num_heads` = 3 must divide (d_model|expand_k · d_model) = (8|4) into equal heads; "
                             r"allowed: \[1, 2, 4(, 8)?\]") for n in HEAD_MIXERS],
    *[(n, dict(num_heads=0), r"`num_heads` must be an int >= 1, got 0") for n in [*HEAD_MIXERS, "kalman", "mamba2"]],
    *[(n, dict(num_heads=2.0), r"`num_heads` must be an int >= 1, got 2.0") for n in ["gka", "kalman", "attention"]],
    *[(n, dict(d_model=0), r"`d_model` must be an int >= 1, got 0") for n in ALL_MIXERS],
    *[(n, dict(layer_idx=-1), r"`layer_idx` must be an int >= 0, got -1") for n in ALL_MIXERS],
    *[(n, dict(conv_size=0), r"`conv_size` must be an int >= 1, got 0") for n in
      ["gdn", "kaczmarz", "gka", "kalman", "mamba2", "deltanet"]],
    ("vla", dict(conv_size=-1), r"`conv_size` must be an int >= 0 \(0: no convolution\), got -1"),
    ("kalman", dict(num_heads=3), r"KalmanAttention: `num_heads` = 3 must divide expand · d_model = 16"),
    ("kalman", dict(d_state=0), r"KalmanAttention: `d_state` must be an int >= 1, got 0"),
    ("kalman", dict(expand=0), r"KalmanAttention: `expand` must be an int >= 1, got 0"),
    ("kalman", dict(expand=1.5), r"KalmanAttention: `expand` must be an int >= 1, got 1.5"),
    ("kalman", dict(dt_min=0.1, dt_max=0.01), r"`dt_max` must be a finite number >= 0.1, got 0.01"),
    ("mamba2", dict(d_state=0), r"Mamba2: `d_state` must be an int >= 1, got 0"),
    ("mamba2", dict(expand=0), r"Mamba2: `expand` must be an int >= 1, got 0"),
    ("mamba2", dict(num_heads=None, head_dim=0), r"Mamba2: `head_dim` must be an int >= 1, got 0"),
    ("mamba2", dict(num_heads=None, head_dim=5), r"Mamba2: `head_dim` = 5 must divide d_inner = expand · d_model = 16"),
    ("mamba2", dict(num_heads=3), r"Mamba2: `num_heads` = 3 must divide d_inner = expand · d_model = 16"),
    ("gka", dict(head_dim=0), r"GatedKalmaNet: `head_dim` must be an int >= 1, got 0"),
    ("gka", dict(ridge=0.0), r"GatedKalmaNet: `ridge` must be a finite number > 0"),
    ("gka", dict(num_iters=-1), r"`num_iters` must be an int >= 0 \(or None: the exact solve\), got -1"),
    ("vla", dict(head_dim=-2), r"VariationalLinearAttention: `head_dim` must be an int >= 1, got -2"),
    ("vla", dict(lambda0=0.0), r"`lambda0` must be a finite number > 0"),
    ("vla", dict(eps=0.0), r"VariationalLinearAttention: `eps` must be a finite number > 0"),
    ("kaczmarz", dict(head_k_dim=0), r"KaczmarzAttention: `head_k_dim` must be an int >= 1, got 0"),
    ("kaczmarz", dict(expand_v=0.3), r"`expand_v` = 0.3 must make the value head size .* a whole number >= 1"),
    ("kaczmarz", dict(expand_v=-1.0), r"KaczmarzAttention: `expand_v` must be a finite number > 0"),
    ("kaczmarz", dict(eps=-1e-6), r"KaczmarzAttention: `eps` must be a finite number >= 0"),
    ("gla", dict(expand_k=0.0), r"GatedLinearAttention: `expand_k` must be a finite number > 0"),
    ("gla", dict(expand_v=0.3), r"`expand_v` = 0.3 must make expand_v · d_model = 0.3 · 8 a whole number"),
    ("gla", dict(gate_low_rank_dim=0), r"`gate_low_rank_dim` must be an int >= 1, got 0"),
    ("attention", dict(num_heads=8), r"the head size d_model / num_heads = 8 / 8 = 1 must be even"),
    ("attention", dict(rope_theta=0.0), r"SoftmaxAttention: `rope_theta` must be a finite number > 0"),
    ("attention", dict(impl="cuda"), r"SoftmaxAttention: `impl` must be None or one of \['naive', 'torch', 'triton'\]"),
    ("gka", dict(impl="fast"), r"GatedKalmaNet: `impl` must be None or one of"),
    ("deltanet", dict(use_gate=1), r"FlaDeltaNet: `use_gate` must be True or False"),
])
def test_constructors_refuse_bad_sizes_naming_the_argument(name, kw, match):
    kw = {**({"num_heads": 2} if name in HEAD_MIXERS else {"mamba2": {"num_heads": 4}}.get(name, {})), **kw}
    d_model = kw.pop("d_model", 8)
    with pytest.raises(ValueError, match=match):
        ALL_MIXERS[name](d_model, **kw)


@pytest.mark.parametrize("name", list(SMALL))
def test_every_layer_refuses_a_wrong_mask_the_same_way(name):
    """Without a cache the mask is [B, T]; with a cache of P tokens it is [B, P + T] (HF's convention, which
    attention needs): a longer or shorter mask, or one of this call's tokens only, is refused by every layer."""
    layer = make(name)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    for mask in (torch.ones(2, 7), torch.ones(2, 4), torch.ones(3, 5), torch.ones(10)):
        with pytest.raises(ValueError, match=r"`attention_mask` must be a padding mask \[B, T\] = \[2, 5\]"):
            layer(x, attention_mask=mask)
    _, _, cache = layer(x, use_cache=True)
    step = torch.randn(2, 1, 8, dtype=torch.float64)
    for mask in (torch.ones(2, 1), torch.ones(2, 9)):
        with pytest.raises(ValueError, match=r"\[B, P \+ T\] = \[2, 6\] \(P = 5 cached tokens, T = 1 new ones\)"):
            layer(step, attention_mask=mask, past_key_values=cache, use_cache=True)
    o, _, _ = layer(step, attention_mask=torch.ones(2, 6), past_key_values=cache, use_cache=True)
    assert o.shape == (2, 1, 8)
    with pytest.raises(ValueError, match=r"`attention_mask` must hold only 0 \(padding\) and 1 \(token\), got "
                                         r"values \[0, 2\]"):
        layer(x, attention_mask=torch.tensor([[0, 2, 2, 2, 2]] * 2))
    with pytest.raises(ValueError, match="`attention_mask` is on meta but the input is on cpu"):
        layer(x, attention_mask=torch.ones(2, 5, device="meta"))


@pytest.mark.parametrize("name", list(SMALL))
def test_every_layer_refuses_bad_hidden_states(name):
    layer = make(name)
    for x in (torch.zeros(2, 5, 8, dtype=torch.long), torch.zeros(5, 8, dtype=torch.float64), [[0.0] * 8]):
        with pytest.raises(ValueError, match=r"`hidden_states` must be \[B, T, 8\] \(floating point\), got"):
            layer(x)
    with pytest.raises(ValueError, match=r"`hidden_states` must hold at least one sequence \(B >= 1\)"):
        layer(torch.zeros(0, 5, 8, dtype=torch.float64))


@pytest.mark.parametrize("flag", ["--steps", "--batch-size", "--seq-len", "--d-model", "--test-examples"])
def test_bench_mqar_rejects_non_positive_counts(flag, capsys):
    from kalmix.cli import main
    with pytest.raises(SystemExit) as e:
        main(["bench", "mqar", flag, "0"])
    assert e.value.code == 2 and "greater than or equal to 1" in capsys.readouterr().err
