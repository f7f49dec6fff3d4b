"""The MAD-Lab tasks' defining properties, determinism, validation, and the macro / micro accuracy."""
import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from kalmix.tasks.mad import (CompressionConfig, FuzzyRecallConfig, InContextRecallConfig, MemorizationConfig,
                              NoisyRecallConfig, SelectiveCopyingConfig, macro_micro_accuracy,
                              sinusoidal_positions, to_causal_lm)

SMALL = {"num_train": 64, "num_test": 32}
ALL = [InContextRecallConfig, NoisyRecallConfig, FuzzyRecallConfig, SelectiveCopyingConfig, CompressionConfig,
       MemorizationConfig]


def recall_pairs(x_row, noise_lo=None):
    """(position, key, value) of each clean (key, value) pair that lies wholly inside a recall row's inputs."""
    seq = x_row.tolist()
    out = []
    for p in range(0, len(seq) - 1, 2):
        k, v = seq[p], seq[p + 1]
        if noise_lo is not None and k >= noise_lo:
            continue
        out.append((p, k, v))
    return out


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("split", ["train", "test"])
def test_shapes_dtypes_and_determinism(cls, split):
    cfg = cls(**SMALL)
    x, y = cfg.build(3, split)
    n = 64 if split == "train" else 32
    assert x.shape == y.shape == (n, cfg.seq_len) and x.dtype == y.dtype == torch.long
    assert ((x >= 0) & (x < cfg.vocab_size)).all()
    assert ((y == -100) | ((y >= 0) & (y < cfg.vocab_size))).all() and (y != -100).any()
    x2, y2 = cfg.build(3, split)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = cfg.build(4, split)
    assert not torch.equal(x, x3)
    xo, _ = cfg.build(3, "test" if split == "train" else "train")      # the two splits are different streams
    assert not torch.equal(x[:16], xo[:16])


@pytest.mark.parametrize("split", ["train", "test"])
def test_in_context_recall(split):
    cfg = InContextRecallConfig(**SMALL)
    x, y = cfg.build(0, split)
    assert x.shape[1] == 128
    keys, vals = x[:, 0::2], x[:, 1::2]
    assert ((keys >= 0) & (keys < 8)).all() and ((vals >= 8) & (vals < 16)).all()
    for i in range(x.shape[0]):
        lookup, seen = {}, set()
        for p, k, v in recall_pairs(x[i]):
            assert lookup.setdefault(k, v) == v                      # a key's value is fixed within the sequence
            if split == "train":
                assert y[i, p] == v                                 # (next token everywhere: checked below)
            else:
                assert y[i, p] == (v if k in seen else -100)        # scored only if the key was seen before
                assert y[i, p + 1] == -100
            seen.add(k)
        assert len(set(lookup.values())) == len(lookup)              # distinct keys have distinct values
    if split == "train":
        assert (y != -100).all() and torch.equal(y[:, :-1], x[:, 1:]) and (y[:, -1] < 8).all()
    else:
        assert ((y[:, 0::2] == -100) | (y[:, 0::2] >= 8)).all() and (y[:, 1::2] == -100).all()


def test_noisy_recall_noise_rate_and_never_scored():
    cfg = NoisyRecallConfig(num_train=400, num_test=400)
    for split in ("train", "test"):
        x, y = cfg.build(1, split)
        keys, vals = x[:, 0::2], x[:, 1::2]
        noise_slot = keys >= 16
        assert torch.equal(noise_slot, vals >= 16)                      # a slot is a whole pair or whole noise
        assert abs(noise_slot.float().mean().item() - 0.2) < 0.01          # ~20% of the slots
        assert ((y == -100) | (y < 16)).all()                             # noise is never a target
        clean_k, clean_v = keys[~noise_slot], vals[~noise_slot]
        assert ((clean_k < 8).all() and ((clean_v >= 8) & (clean_v < 16)).all())
        for i in range(50):
            lookup, seen = {}, set()
            for p, k, v in recall_pairs(x[i], noise_lo=16):
                assert lookup.setdefault(k, v) == v
                assert y[i, p] == (v if (split == "train" or k in seen) else -100)
                seen.add(k)
            if split == "train":                                          # scored iff the next token is clean
                assert torch.equal(y[i, :-1] != -100, x[i, 1:] < 16)


def test_fuzzy_recall():
    cfg = FuzzyRecallConfig(**SMALL)
    pad, kt = 15, 7                                                       # V = 16
    for split in ("train", "test"):
        x, y = cfg.build(2, split)
        lengths = set()
        for i in range(x.shape[0]):
            seq = x[i].tolist()
            if split == "train":             # the whole T + 1 sequence: in train only a pad target is unscored
                seq.append(y[i, -1].item() if y[i, -1] != -100 else pad)
            # split into maximal runs of key tokens and value tokens; pad only at the end
            n_real = next((j for j, t in enumerate(seq) if t == pad), len(seq))
            assert all(t == pad for t in seq[n_real:]) and all(t != pad for t in seq[:n_real])
            runs, cur = [], [seq[0]]
            for t in seq[1:n_real]:
                if (t < kt) == (cur[-1] < kt):
                    cur.append(t)
                else:
                    runs.append(cur)
                    cur = [t]
            runs.append(cur)
            if split == "test" and n_real == len(seq):     # test: the pair reaching past the inputs may be cut
                runs = runs[:-1] if len(runs) % 2 else runs[:-2]
            assert runs[0][0] < kt and len(runs) % 2 == 0                 # key, value, key, value, …, whole pairs
            lookup, seen, pos = {}, set(), 0
            for key, val in zip(runs[0::2], runs[1::2]):
                assert 1 <= len(key) <= 3 and 1 <= len(val) <= 3
                assert len(set(key)) == len(key) and len(set(val)) == len(val)
                assert all(7 <= t < 15 for t in val)
                assert lookup.setdefault(tuple(key), tuple(val)) == tuple(val)   # a key's value is fixed
                if split == "test":
                    assert len(key) == 3                                  # test keys always have length 3
                lengths.add(len(key))
                # labels of the value tokens: label position = one before each value token
                want = val if (split == "train" or tuple(key) in seen) else [-100] * len(val)
                start = pos + len(key)
                assert y[i, start - 1:start - 1 + len(val)].tolist() == want
                seen.add(tuple(key))
                pos = start + len(val)
            if split == "train":                                          # next token everywhere but pad
                assert torch.equal(y[i, :-1] != -100, x[i, 1:] != pad)
            else:                                                         # only recalled value tokens
                assert ((y[i] == -100) | (y[i] >= kt)).all()
            assert len(lookup) <= cfg.num_keys
        assert lengths == ({1, 2, 3} if split == "train" else {3})


def test_selective_copying():
    cfg = SelectiveCopyingConfig(**SMALL)
    x, y = cfg.build(5)
    assert x.shape == (64, 256)
    assert (x[:, 239] == 15).all() and (x[:, 240:] == 14).all()
    region = x[:, :239]
    assert ((region < 14) | (region == 14)).all() and (region != 15).all()
    assert ((region < 14).sum(1) == 16).all()                           # 16 content tokens among blanks
    assert (y[:, :240] == -100).all()
    for i in range(64):
        content = region[i][region[i] < 14]
        assert torch.equal(y[i, 240:], content)                           # the content in order, at the last 16
    positions = (region < 14).nonzero()[:, 1]
    assert positions.float().mean() > 80 and positions.max() > 200      # scattered over the whole region


def test_compression():
    cfg = CompressionConfig(**SMALL)
    x, y = cfg.build(0)
    assert x.shape == (64, 32) and (x[:, -1] == 15).all() and (x[:, :-1] < 15).all()
    assert torch.equal(x, y)                                              # reconstruct every input token
    _, y2 = cfg.model_copy(update={"score_compression_token": False}).build(0)
    assert (y2[:, -1] == -100).all() and torch.equal(y2[:, :-1], x[:, :-1])
    pe = sinusoidal_positions(32, 16)
    assert pe.shape == (32, 16) and torch.allclose(pe[0], torch.tensor([0.0, 1.0] * 8))
    t = torch.tensor(5.0)
    assert torch.allclose(pe[5, :2], torch.stack([t.sin(), t.cos()]))
    assert torch.allclose(pe[5, 2:4], torch.stack([(t / 10_000 ** (2 / 16)).sin(), (t / 10_000 ** (2 / 16)).cos()]))


def test_memorization_map_is_fixed():
    cfg = MemorizationConfig(num_test=64)
    assert cfg.num_train == 256
    vmap = cfg.value_map()
    assert vmap.shape == (127,) and ((vmap >= 127) & (vmap < 255)).all()
    assert torch.equal(vmap, MemorizationConfig(num_train=8).value_map())            # not tied to sizes / seed
    assert not torch.equal(vmap, MemorizationConfig(map_seed=1).value_map())
    for seed, split in [(0, "train"), (1, "train"), (7, "test")]:
        x, y = cfg.build(seed, split)
        keys = x[:, 0::2]
        assert ((keys >= 0) & (keys < 127)).all() and (x[:, 1::2] == 255).all()
        assert all(len(set(r.tolist())) == 16 for r in keys)                        # distinct keys per sequence
        assert (y[:, 0::2] == -100).all()
        assert torch.equal(y[:, 1::2], vmap[keys])                                   # the same map everywhere
    x, _ = cfg.build(0)
    assert x[:, 0::2].unique().numel() == 127                                        # training covers every key


def test_unknown_keys_rejected():
    for cls in ALL:
        with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
            cls(typo=1)
        with pytest.raises(ValidationError, match="frozen"):
            cls().num_train = 3


def test_bad_sizes_rejected():
    with pytest.raises(ValidationError, match="vocab_size must be even"):
        InContextRecallConfig(vocab_size=15)
    with pytest.raises(ValidationError, match="seq_len must be >= 4"):
        InContextRecallConfig(seq_len=3)
    with pytest.raises(ValidationError, match="vocab_size - noise_vocab_size must be even and >= 2"):
        NoisyRecallConfig(vocab_size=32, noise_vocab_size=31)
    with pytest.raises(ValidationError, match="frac_noise"):
        NoisyRecallConfig(frac_noise=1.0)
    with pytest.raises(ValidationError, match="num_keys must be <= 210 distinct key tuples"):
        FuzzyRecallConfig(num_keys=211)
    with pytest.raises(ValidationError, match="max_tuple_len must be <= the 7 key tokens"):
        FuzzyRecallConfig(max_tuple_len=8)
    with pytest.raises(ValidationError, match="seq_len \\+ 1 must hold two of the longest pairs"):
        FuzzyRecallConfig(seq_len=10)
    with pytest.raises(ValidationError, match="seq_len must be >= 2 \\* num_tokens_to_copy \\+ 1 = 33"):
        SelectiveCopyingConfig(seq_len=32)
    with pytest.raises(ValidationError, match="vocab_size must be >= 3"):
        SelectiveCopyingConfig(vocab_size=2)
    with pytest.raises(ValidationError, match="seq_len must be >= 2"):
        CompressionConfig(seq_len=1)
    with pytest.raises(ValidationError, match="seq_len must be even"):
        MemorizationConfig(seq_len=31)
    with pytest.raises(ValidationError, match="64 pairs need as many distinct keys, but vocab_size = 64 has only 31"):
        MemorizationConfig(vocab_size=64, seq_len=128)
    with pytest.raises(ValidationError, match="greater than 0"):
        CompressionConfig(num_test=0)
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        CompressionConfig().build(0, "val")
    with pytest.raises(ValueError, match="seed must be an int"):
        CompressionConfig().build(-1)


def test_macro_micro_accuracy_by_hand():
    # scored targets: class 0 ×4 (3 right), class 1 ×1 (wrong, predicted 2); class 3 only in an ignored position
    labels = torch.tensor([[0, 0, 0, -100], [0, 1, -100, -100]])
    pred = torch.tensor([[0, 0, 1, 3], [0, 2, 3, 3]])
    macro, micro = macro_micro_accuracy(pred, labels)
    assert micro == pytest.approx(3 / 5)
    # torchmetrics macro: classes 0 (3/4), 1 (0/1) and 2 (predicted, never a target: 0); 3 is absent at scored
    # positions and does not count
    assert macro == pytest.approx((0.75 + 0 + 0) / 3)
    labels = torch.tensor([[5, 5, 5, 5, 5, 5, 5, 5, 7, 7]])               # imbalance: macro != micro
    pred = torch.tensor([[5, 5, 5, 5, 5, 5, 5, 5, 5, 7]])
    macro, micro = macro_micro_accuracy(pred, labels)
    assert micro == pytest.approx(0.9) and macro == pytest.approx((1.0 + 0.5) / 2)
    assert macro_micro_accuracy(labels, labels) == (1.0, 1.0)
    with pytest.raises(ValueError, match="no scored positions"):
        macro_micro_accuracy(pred, torch.full_like(pred, -100))


def test_to_causal_lm_matches_kalmix_loss():
    from kalmix.models import KalmixConfig, KalmixForCausalLM
    x, y = SelectiveCopyingConfig(num_train=4, seq_len=40, num_tokens_to_copy=8).build(0)   # last position scored
    x2, y2 = to_causal_lm(x, y)
    assert x2.shape == y2.shape == (4, 41) and torch.equal(x2[:, :40], x) and torch.equal(y2[:, 1:], y)
    torch.manual_seed(0)
    model = KalmixForCausalLM(KalmixConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1, mixers=["attention"],
                                           mixer_kwargs={"attention": {"num_heads": 2}})).eval()
    with torch.no_grad():
        out = model(x2, labels=y2)
        logits = model(x).logits
    want = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    assert torch.allclose(out.loss, want, atol=1e-5)
    assert torch.allclose(out.logits[:, :40], logits, atol=1e-5)


def shares_a_value(x_row, noise_lo=None) -> bool:
    """Whether two distinct keys of a recall row map to the same value."""
    lookup = {}
    for _, k, v in recall_pairs(x_row, noise_lo):
        lookup.setdefault(k, v)
    return len(set(lookup.values())) < len(lookup)


@pytest.mark.parametrize("cls", [InContextRecallConfig, NoisyRecallConfig])
def test_recall_values_independent_as_mad_lab(cls):
    noise_lo = 16 if cls is NoisyRecallConfig else None
    bij = cls(num_train=200, num_test=8).build(0)[0]
    ind_cfg = cls(num_train=200, num_test=8, values="independent")
    ind, y = ind_cfg.build(0)
    assert not any(shares_a_value(r, noise_lo) for r in bij)
    # eight keys, each value drawn on its own: all eight distinct with probability 8!/8^8 = 0.0024
    assert sum(shares_a_value(r, noise_lo) for r in ind) / len(ind) > 0.95
    for i in range(20):
        lookup = {}
        for p, k, v in recall_pairs(ind[i], noise_lo):
            assert lookup.setdefault(k, v) == v                          # still one value per key in a sequence
    assert ((ind[:, 1::2] >= 8) & (ind[:, 1::2] < 16) | (ind[:, 1::2] >= 16)).all()


def test_memorization_keys_with_replacement_as_mad_lab():
    cfg = MemorizationConfig(num_train=4000, keys="with_replacement")
    x, y = cfg.build(0)
    keys = x[:, 0::2]
    repeated = torch.tensor([len(set(r.tolist())) < 16 for r in keys]).float().mean().item()
    expect = 1 - torch.prod(1 - torch.arange(16) / 127.0).item()          # 16 draws from 127 keys: 0.62
    assert abs(repeated - expect) < 0.03
    assert torch.equal(y[:, 1::2], cfg.value_map()[keys]) and (x[:, 1::2] == 255).all()
    MemorizationConfig(seq_len=512, keys="with_replacement")               # more pairs than keys: allowed
    with pytest.raises(ValidationError, match="or keys='with_replacement'"):
        MemorizationConfig(seq_len=512)
