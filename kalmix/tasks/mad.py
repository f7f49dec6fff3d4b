"""The six MAD-Lab synthetic tasks (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid Architectures").

Every task is a frozen pydantic config with ``num_train`` / ``num_test`` sizes (MAD's 12,800 / 1,280 by default;
Memorization trains on 256) and ``build(seed, split="train" | "test") -> (inputs, labels)``: LongTensors
[num_train or num_test, seq_len], a pure function of (config, seed, split). The two splits of one seed come from
different random streams (seeds 2·seed and 2·seed + 1), so a train set and a test set never share a stream.

Label convention (all six tasks): **labels[:, t] is what the model must output at position t, having read
inputs[:, :t + 1]**, so a causal LM's ``logits[:, t]`` is scored against ``labels[:, t]`` (−100: not scored) —
``F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)`` and accuracy on
``logits.argmax(-1)`` vs ``labels``. For the recall tasks this is next-token prediction: the sequence is built with
length T + 1 and shifted (inputs = seq[:-1], labels = seq[1:], as in ``MQARConfig``), so labels[:, t] =
inputs[:, t + 1] wherever scored. Selective copying and memorization put the target at the blank / insert slot
itself (the MAD layout), and compression's labels are the input tokens for an autoencoder readout (see
``CompressionConfig``).

``KalmixForCausalLM(input_ids, labels=...)`` instead scores logits[t] against labels[t + 1] (the Hugging Face
convention). ``to_causal_lm(inputs, labels)`` converts: it appends one unscored filler token to the inputs and
prepends −100 to the labels (both become [N, T + 1]), so its loss is exactly the cross-entropy above, with the
last task position scored too. Accuracy: take ``logits[:, :T].argmax(-1)`` against the task's own labels.

``macro_micro_accuracy`` reports MAD's class-macro accuracy (torchmetrics' multiclass default) and the micro one.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

IGNORE = -100
Split = Literal["train", "test"]

__all__ = ["CompressionConfig", "FuzzyRecallConfig", "InContextRecallConfig", "MemorizationConfig",
           "NoisyRecallConfig", "SelectiveCopyingConfig", "macro_micro_accuracy", "sinusoidal_positions",
           "to_causal_lm"]


class _MADTask(BaseModel):
    """Shared by the six tasks: the split sizes and ``build``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_train: int = Field(12_800, gt=0)
    num_test: int = Field(1_280, gt=0)

    def build(self, seed: int, split: Split = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Returns inputs, labels: LongTensors [num_train or num_test, seq_len]; labels −100 where not scored and
        labels[:, t] the target of the model's output at position t (see the module docstring)."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 62:
            raise ValueError(f"seed must be an int in [0, 2**62), got {seed!r}")
        gen = torch.Generator().manual_seed(2 * seed + (split == "test"))
        n = self.num_train if split == "train" else self.num_test
        inputs, labels = self._generate(n, gen, split == "test")
        return inputs.contiguous(), labels.contiguous()

    def _generate(self, n: int, gen: torch.Generator, test: bool) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------------- recall

def _recall(n: int, T: int, num_keys: int, noise_vocab_size: int, frac_noise: float, values: str,
            gen: torch.Generator, test: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [0, K), values [K, 2K), noise [2K, 2K + noise_vocab_size); T // 2 + 1 two-token slots, cut to T + 1.
    ``values``: "bijection" (a permutation key -> value per sequence) or "independent" (each key's value drawn
    uniformly on its own, so keys may share a value)."""
    K = num_keys
    S = T // 2 + 1                                                      # 2S >= T + 1 tokens
    if values == "bijection":
        values_of = torch.rand(n, K, generator=gen).argsort(1) + K
    else:
        values_of = torch.randint(K, 2 * K, (n, K), generator=gen)
    keys = torch.randint(K, (n, S), generator=gen)
    pairs = torch.stack([keys, values_of.gather(1, keys)], dim=2)       # [n, S, 2]
    noise = torch.zeros(n, S, dtype=torch.bool)
    if noise_vocab_size:
        noise = torch.rand(n, S, generator=gen) < frac_noise
        noise_tokens = torch.randint(noise_vocab_size, (n, S, 2), generator=gen) + 2 * K
        pairs = torch.where(noise[..., None], noise_tokens, pairs)
    seq = pairs.reshape(n, 2 * S)[:, :T + 1]
    if test:                                                            # values of keys seen in an earlier pair
        slot = torch.arange(S).expand(n, S)                             # first clean slot of each key (noise: K)
        first = torch.full((n, K + 1), S).scatter_reduce(1, torch.where(noise, K, keys), slot, "amin")
        seen = (slot > first.gather(1, keys)) & ~noise
        scored = torch.stack([torch.zeros_like(seen), seen], dim=2).reshape(n, 2 * S)
    else:                                                               # next token everywhere but noise
        scored = (~noise).repeat_interleave(2, dim=1)
    labels = seq[:, 1:].masked_fill(~scored[:, 1:T + 1], IGNORE)
    return seq[:, :T], labels


class InContextRecallConfig(_MADTask):
    """In-context recall: a sequence of (key, value) pairs ``k v k v …`` with a fixed key -> value map per sequence.

    Keys come from [0, V/2), values from [V/2, V). Each sequence draws its own key -> value map, ``values``:
    "bijection" (default: a uniform random permutation of the values) or "independent" (MAD-Lab's generator: each
    key's value drawn uniformly on its own, so two keys may share a value), then T // 2 + 1 keys uniformly *with
    replacement*, each followed by its value; the T + 1 tokens are shifted by one into inputs / labels. Train:
    every next token is scored (the keys, unpredictable, included — MAD's "next-token everywhere"). Test: only the
    value after a key that already occurred in an earlier pair of the same sequence (label position = the key's
    position). The Kalman paper's hard MQAR ("CR (hard)") is this task at V = 256, T = 2048.
    """

    vocab_size: int = Field(16, gt=0)
    seq_len: int = Field(128, gt=0)
    values: Literal["bijection", "independent"] = "bijection"

    @model_validator(mode="after")
    def _check(self):
        if self.vocab_size % 2 or self.vocab_size < 2:
            raise ValueError(f"vocab_size must be even and >= 2 (keys and values split it in half), "
                             f"got {self.vocab_size}")
        if self.seq_len < 4:
            raise ValueError(f"seq_len must be >= 4 (room for two key-value pairs), got {self.seq_len}")
        return self

    def _generate(self, n, gen, test):
        return _recall(n, self.seq_len, self.vocab_size // 2, 0, 0.0, self.values, gen, test)


class NoisyRecallConfig(_MADTask):
    """Noisy in-context recall: in-context recall with noise pairs mixed in.

    The last ``noise_vocab_size`` tokens of the vocabulary are noise; the rest is split in half into keys
    [0, K) and values [K, 2K), K = (V − noise_vocab_size) / 2 (V 32: keys 0–7, values 8–15, noise 16–31). The
    sequence is T // 2 + 1 two-token slots; each slot independently, with probability ``frac_noise``, holds two
    uniform noise tokens instead of a (key, value) pair (the pair drawn as in ``InContextRecallConfig``, from the
    sequence's key -> value map, ``values`` as there). Noise is never a target. Train: every non-noise next token
    is scored.
    Test: only the value after a key that occurred in an earlier non-noise slot.
    """

    vocab_size: int = Field(32, gt=0)
    seq_len: int = Field(128, gt=0)
    noise_vocab_size: int = Field(16, gt=0)
    frac_noise: float = Field(0.2, ge=0.0, lt=1.0)
    values: Literal["bijection", "independent"] = "bijection"

    @model_validator(mode="after")
    def _check(self):
        clean = self.vocab_size - self.noise_vocab_size
        if clean < 2 or clean % 2:
            raise ValueError(f"vocab_size - noise_vocab_size must be even and >= 2 (keys and values split it in "
                             f"half), got {self.vocab_size} - {self.noise_vocab_size} = {clean}")
        if self.seq_len < 4:
            raise ValueError(f"seq_len must be >= 4 (room for two key-value pairs), got {self.seq_len}")
        return self

    def _generate(self, n, gen, test):
        K = (self.vocab_size - self.noise_vocab_size) // 2
        return _recall(n, self.seq_len, K, self.noise_vocab_size, self.frac_noise, self.values, gen, test)


def _random_tuples(n: int, lo: int, count: int, max_len: int, gen: torch.Generator,
                   fixed_len: bool) -> torch.Tensor:
    """[n, max_len] tuples of distinct tokens from [lo, lo + count), −1 after their length (uniform in
    [1, max_len], or max_len when fixed_len)."""
    lengths = (torch.full((n,), max_len) if fixed_len else torch.randint(1, max_len + 1, (n,), generator=gen))
    tokens = torch.rand(n, count, generator=gen).argsort(1)[:, :max_len] + lo
    return tokens.masked_fill(torch.arange(max_len) >= lengths[:, None], -1)


class FuzzyRecallConfig(_MADTask):
    """Fuzzy in-context recall: recall where keys and values are tuples of 1–``max_tuple_len`` tokens.

    Tokens: pad = V − 1; key tokens [0, Kt), value tokens [Kt, V − 1), Kt = (V − 1) // 2 (V 16: keys 0–6, values
    7–14, pad 15). The two ranges are disjoint, so a sequence splits unambiguously into its key and value tuples.
    Each sequence draws a dictionary of ``num_keys`` *distinct* key tuples (train: length uniform in
    [1, max_tuple_len]; test: always max_tuple_len), each with a value tuple (length uniform in
    [1, max_tuple_len]; values may repeat across keys); a tuple's tokens are distinct and uniformly ordered. It
    then lays out pairs ``key-tuple value-tuple`` drawn uniformly with replacement from the dictionary, as many
    whole pairs as fit in T + 1 tokens, and pads the rest with the pad token; shifted by one into inputs / labels.
    Train: every next token except pad is scored. Test: only the tokens of a value tuple whose key tuple occurred
    in an earlier pair (so every token of the recalled value, predicted from the key's last token onwards).
    """

    vocab_size: int = Field(16, gt=0)
    seq_len: int = Field(128, gt=0)
    max_tuple_len: int = Field(3, gt=0)
    num_keys: int = Field(8, gt=0)

    @model_validator(mode="after")
    def _check(self):
        kt = (self.vocab_size - 1) // 2
        vt = self.vocab_size - 1 - kt
        if self.max_tuple_len > kt:
            raise ValueError(f"max_tuple_len must be <= the {kt} key tokens (tokens in a tuple are distinct), "
                             f"got {self.max_tuple_len}")
        if self.num_keys > math.perm(kt, self.max_tuple_len):
            raise ValueError(f"num_keys must be <= {math.perm(kt, self.max_tuple_len)} distinct key tuples of "
                             f"length max_tuple_len = {self.max_tuple_len}, got {self.num_keys}")
        if self.max_tuple_len > vt:
            raise ValueError(f"max_tuple_len must be <= the {vt} value tokens, got {self.max_tuple_len}")
        if self.seq_len + 1 < 4 * self.max_tuple_len:
            raise ValueError(f"seq_len + 1 must hold two of the longest pairs, 4 * max_tuple_len = "
                             f"{4 * self.max_tuple_len}, got seq_len = {self.seq_len}")
        return self

    def _generate(self, n, gen, test):
        T, L, D, V = self.seq_len, self.max_tuple_len, self.num_keys, self.vocab_size
        kt, pad = (V - 1) // 2, V - 1
        # the dictionary: D distinct key tuples per row, each slot redrawn (that row only) until it differs
        keys = torch.full((n, D, L), -1, dtype=torch.long)
        for j in range(D):
            todo = torch.arange(n)
            while len(todo):
                keys[todo, j] = _random_tuples(len(todo), 0, kt, L, gen, test)
                dup = (keys[todo, :j] == keys[todo, j, None]).all(-1).any(-1)
                todo = todo[dup]
        values = _random_tuples(n * D, kt, V - 1 - kt, L, gen, False).view(n, D, L)
        # pairs drawn from the dictionary, enough that 2 tokens each overfill T + 1
        P = (T + 1) // 2 + 1
        idx = torch.randint(D, (n, P), generator=gen)
        blocks = torch.cat([keys.gather(1, idx[..., None].expand(n, P, L)),
                            values.gather(1, idx[..., None].expand(n, P, L))], dim=2)      # [n, P, 2L]
        kept = (blocks >= 0).sum(2).cumsum(1) <= T + 1                                     # whole pairs that fit
        occ = F.one_hot(idx, D) * kept[..., None]
        seen = ((occ.cumsum(1) - occ).gather(2, idx[..., None])[..., 0] > 0) & kept       # key seen earlier
        valid = (blocks >= 0) & kept[..., None]
        in_value = (torch.arange(2 * L) >= L).expand(n, P, 2 * L)
        valid, blocks = valid.reshape(n, -1), blocks.reshape(n, -1)
        test_scored = (in_value & seen[..., None]).reshape(n, -1) & valid
        dest = torch.where(valid, valid.cumsum(1) - 1, T + 1)                              # T + 1: discarded
        seq = torch.full((n, T + 2), pad, dtype=torch.long).scatter_(1, dest, torch.where(valid, blocks, pad))
        scored = torch.zeros(n, T + 2, dtype=torch.bool).scatter_(1, dest, test_scored if test else valid)
        labels = seq[:, 1:T + 1].masked_fill(~scored[:, 1:T + 1], IGNORE)
        return seq[:, :T], labels


# ------------------------------------------------------------------------------------------- selective copy

class SelectiveCopyingConfig(_MADTask):
    """Selective copying: copy the content tokens scattered among blanks, in order, after a copy token.

    Tokens: content [0, V − 2), blank V − 2, copy V − 1. The first R = T − k − 1 positions (k =
    ``num_tokens_to_copy``) hold k content tokens (uniform, with replacement) at k distinct uniformly chosen
    positions, blanks elsewhere; position R is the copy token and the last k positions are blanks. labels −100
    everywhere except the last k positions, which hold the content tokens in their order of appearance (the
    model emits content i at the i-th blank after the copy token). Both splits are scored the same way.
    """

    vocab_size: int = Field(16, gt=0)
    seq_len: int = Field(256, gt=0)
    num_tokens_to_copy: int = Field(16, gt=0)

    @model_validator(mode="after")
    def _check(self):
        if self.vocab_size < 3:
            raise ValueError(f"vocab_size must be >= 3 (content, blank and copy tokens), got {self.vocab_size}")
        k = self.num_tokens_to_copy
        if self.seq_len < 2 * k + 1:
            raise ValueError(f"seq_len must be >= 2 * num_tokens_to_copy + 1 = {2 * k + 1} (k content slots, the "
                             f"copy token, k output blanks), got {self.seq_len}")
        return self

    def _generate(self, n, gen, test):
        T, k, V = self.seq_len, self.num_tokens_to_copy, self.vocab_size
        R = T - k - 1
        pos = torch.rand(n, R, generator=gen).argsort(1)[:, :k].sort(1).values
        content = torch.randint(V - 2, (n, k), generator=gen)
        inputs = torch.full((n, T), V - 2, dtype=torch.long).scatter_(1, pos, content)
        inputs[:, R] = V - 1
        labels = torch.full((n, T), IGNORE, dtype=torch.long)
        labels[:, T - k:] = content
        return inputs, labels


# ---------------------------------------------------------------------------------------------- compression

class CompressionConfig(_MADTask):
    """Compression: reconstruct the whole sequence from the hidden state at its last position.

    inputs: T − 1 uniform tokens from [0, V − 1), then the compression token V − 1. labels: the input sequence
    itself (labels == inputs; with ``score_compression_token=False`` the trivially known last position is −100).

    **Not a next-token task: it needs an autoencoder readout.** The harness runs the model over ``inputs``, takes
    the last hidden state h = hidden[:, T − 1] ([N, d]), broadcasts it to every position and adds a fixed
    (untrained) sinusoidal position code, ``h[:, None] + sinusoidal_positions(T, d)`` ([N, T, d]), decodes that
    with a small MLP (then the LM head) into logits [N, T, V], and scores logits[:, t] against labels[:, t] with
    cross-entropy / ``macro_micro_accuracy``. ``to_causal_lm`` / ``KalmixForCausalLM(labels=...)`` do not apply.
    """

    vocab_size: int = Field(16, gt=0)
    seq_len: int = Field(32, gt=0)
    score_compression_token: bool = True

    @model_validator(mode="after")
    def _check(self):
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 (data tokens and the compression token), "
                             f"got {self.vocab_size}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (data tokens and the compression token), got {self.seq_len}")
        return self

    def _generate(self, n, gen, test):
        T, V = self.seq_len, self.vocab_size
        inputs = torch.cat([torch.randint(V - 1, (n, T - 1), generator=gen),
                            torch.full((n, 1), V - 1, dtype=torch.long)], dim=1)
        labels = inputs.clone()
        if not self.score_compression_token:
            labels[:, -1] = IGNORE
        return inputs, labels


def sinusoidal_positions(seq_len: int, dim: int, base: float = 10_000.0) -> torch.Tensor:
    """The fixed sinusoidal position code of Vaswani et al. [seq_len, dim] (float32): column 2i is
    sin(t / base^(2i/dim)), column 2i + 1 its cos (dim even). Compression's decoder input is h + this."""
    if dim % 2 or dim <= 0:
        raise ValueError(f"dim must be even and positive, got {dim}")
    t = torch.arange(seq_len, dtype=torch.float64)[:, None]
    angle = t / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return torch.stack([angle.sin(), angle.cos()], dim=2).reshape(seq_len, dim).float()


# -------------------------------------------------------------------------------------------- memorization

class MemorizationConfig(_MADTask):
    """Memorization: a key -> value map fixed across the whole data set, learned into the weights.

    Tokens: keys [0, K), values [K, V − 1), insert V − 1, K = (V − 1) // 2 (V 256: keys 0–126, values 127–254,
    insert 255). The map (``value_map()``) gives each key a uniform value, drawn once from ``map_seed`` — the same
    for every example, seed and split. A sequence is T/2 pairs ``key insert``, its keys (uniform) ``keys``:
    "distinct" (default: without replacement within the sequence) or "with_replacement" (MAD-Lab's generator: each
    pair's key drawn on its own, so a key may recur); values never appear in the inputs, so they cannot be recalled
    in context either way. labels −100 except at each insert position, which holds the preceding key's value. MAD
    trains on 256 sequences; the test split is fresh sequences over the same map.
    """

    num_train: int = Field(256, gt=0)
    vocab_size: int = Field(256, gt=0)
    seq_len: int = Field(32, gt=0)
    map_seed: int = Field(0, ge=0)
    keys: Literal["distinct", "with_replacement"] = "distinct"

    @model_validator(mode="after")
    def _check(self):
        if self.vocab_size < 3:
            raise ValueError(f"vocab_size must be >= 3 (keys, values and the insert token), got {self.vocab_size}")
        if self.seq_len % 2:
            raise ValueError(f"seq_len must be even ((key, insert) pairs), got {self.seq_len}")
        K = (self.vocab_size - 1) // 2
        if self.keys == "distinct" and self.seq_len // 2 > K:
            raise ValueError(f"seq_len / 2 = {self.seq_len // 2} pairs need as many distinct keys, but "
                             f"vocab_size = {self.vocab_size} has only {K} (or keys='with_replacement')")
        return self

    def value_map(self) -> torch.Tensor:
        """[K] LongTensor: the value of each key, a function of (vocab_size, map_seed) only."""
        K = (self.vocab_size - 1) // 2
        gen = torch.Generator().manual_seed(self.map_seed)
        return torch.randint(self.vocab_size - 1 - K, (K,), generator=gen) + K

    def _generate(self, n, gen, test):
        T, V = self.seq_len, self.vocab_size
        K = (V - 1) // 2
        if self.keys == "distinct":
            keys = torch.rand(n, K, generator=gen).argsort(1)[:, :T // 2]
        else:
            keys = torch.randint(K, (n, T // 2), generator=gen)
        inputs = torch.stack([keys, torch.full_like(keys, V - 1)], dim=2).reshape(n, T)
        labels = torch.stack([torch.full_like(keys, IGNORE), self.value_map()[keys]], dim=2).reshape(n, T)
        return inputs, labels


# ------------------------------------------------------------------------------------------------- helpers

def to_causal_lm(inputs: torch.Tensor, labels: torch.Tensor, filler: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) in this module's convention (logits[t] vs labels[t]) -> [N, T + 1] tensors for the Hugging
    Face convention of ``KalmixForCausalLM(input_ids, labels=...)`` (logits[t] vs labels[t + 1]): the inputs get
    one filler token appended (its logits are never scored, and a causal model's earlier logits do not see it),
    the labels a −100 prepended. Not for compression."""
    if inputs.shape != labels.shape or inputs.dim() != 2:
        raise ValueError(f"inputs and labels must both be [N, T], got {list(inputs.shape)} and "
                         f"{list(labels.shape)}")
    n = inputs.shape[0]
    return (torch.cat([inputs, inputs.new_full((n, 1), filler)], dim=1),
            torch.cat([labels.new_full((n, 1), IGNORE), labels], dim=1))


def macro_micro_accuracy(pred: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = IGNORE) -> tuple[float, float]:
    """Accuracy of predictions pred [N, T] against labels [N, T] over the positions where labels != ignore_index.

    micro: the fraction of scored positions predicted right. macro (MAD's, torchmetrics' multiclass
    ``average="macro"``): the mean over classes of per-class accuracy tp / (tp + fn), i.e. recall of each target
    class; as in torchmetrics a class counts when it occurs as a target or as a prediction at a scored position
    (a class predicted but never a target there counts with accuracy 0), and classes absent from both do not.
    Returns (macro, micro) as floats.
    """
    if pred.shape != labels.shape:
        raise ValueError(f"pred and labels must have the same shape, got {list(pred.shape)} and "
                         f"{list(labels.shape)}")
    mask = labels != ignore_index
    y, p = labels[mask].long(), pred[mask].long()
    if y.numel() == 0:
        raise ValueError("no scored positions (every label is ignore_index)")
    if (y < 0).any() or (p < 0).any():
        raise ValueError("class ids at scored positions must be >= 0")
    correct = p == y
    C = int(max(y.max(), p.max())) + 1
    tp = torch.bincount(y[correct], minlength=C).double()
    support = torch.bincount(y, minlength=C).double()                  # tp + fn
    predicted = torch.bincount(p, minlength=C)                         # tp + fp
    counted = (support > 0) | (predicted > 0)
    per_class = torch.where(support > 0, tp / support.clamp(min=1), torch.zeros_like(tp))
    return per_class[counted].mean().item(), correct.double().mean().item()
