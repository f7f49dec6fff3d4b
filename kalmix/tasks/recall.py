"""Recall and memory tasks: single-needle recall, palindromes, multi-stack memory (Kaczmarz paper's controlled
tasks), the Kalman paper's hard MQAR (T = 2048, V = 256) and the VLA paper's MQAR capacity curve.

Label convention (the same as ``MQARConfig``): inputs and labels are LongTensors [num_examples, seq_len];
labels[:, t] is the target of the model's output at position t, i.e. the token that should come after
inputs[:, t] (the answer to what has just been read), −100 where not scored. Score logits[:, t] against
labels[:, t] directly (as ``kalmix.bench.mqar`` does), NOT through ``KalmixForCausalLM(labels=...)``, which
scores logits[t] against labels[t + 1]. The needle, palindrome, stack and hard-MQAR generators build a sequence of
seq_len + 1 tokens (and its answers at the answer tokens' own positions) and shift by one, exactly as
``MQARConfig``: inputs = seq[:, :-1], labels = answers[:, 1:]. The capacity task has no answer slots (its queries
follow each other), so its labels sit at the query positions; that is the same convention (the output after
reading a query key is its value).

Every generator is a pure function of (config, seed): all randomness comes from one ``torch.Generator``.
"""
from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kalmix.tasks.mqar import MQARConfig, mqar_examples, pairs

# the VLA paper's capacity grid (T = 3n + 1) and its long-context variant (n = 8)
CAPACITY_NUM_KV_PAIRS: tuple[int, ...] = (4, 8, 16, 24, 32, 48, 64, 96)
CAPACITY_LONG_SEQ_LENS: tuple[int, ...] = (64, 128, 256, 512)


def _shift(seq: torch.Tensor, answers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, T + 1] sequence and answers (−100 where none) -> inputs [n, T], labels [n, T], as MQARConfig."""
    return seq[:, :-1].clone(), answers[:, 1:].clone()


class NeedleConfig(BaseModel):
    """Single-needle recall: one key–value pair ``k v`` hidden in random filler, then ``QUERY k`` at the end.

    Vocabulary V = ``vocab_size`` (default 256), four disjoint ranges:
      - 0: the query marker ``QUERY``;
      - keys [1, V // 4);
      - values [V // 4, V // 2);
      - filler [V // 2, V), drawn uniformly per position.
    Sequence (seq_len + 1 tokens before the shift): filler everywhere, the needle ``k v`` at positions (p, p + 1),
    and the last three tokens ``QUERY k v``. The needle position p ∈ [0, seq_len − 4] is uniform, or
    round(depth · (seq_len − 4)) with ``depth`` ∈ [0, 1] given (0 = right at the start, 1 = just before the query).
    After the shift, inputs end with ``QUERY k`` and the only scored label is labels[:, −1] = v. In inputs the
    key appears exactly twice (needle and query) and the value exactly once (the needle). The Kaczmarz paper uses
    T from 1K to 8K; any seq_len >= 4 is accepted.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq_len: int = Field(gt=0)
    num_examples: int = Field(gt=0)
    vocab_size: int = Field(256, gt=0)
    depth: float | None = Field(None, ge=0, le=1)

    query_token: ClassVar[int] = 0

    @model_validator(mode="after")
    def _sizes(self):
        if self.seq_len < 4:
            raise ValueError(f"seq_len must be >= 4 (needle k v, then QUERY k), got {self.seq_len}")
        if self.vocab_size < 8:
            raise ValueError(f"vocab_size must be >= 8 so that keys, values and filler each get tokens, got "
                             f"{self.vocab_size}")
        return self

    @property
    def key_range(self) -> tuple[int, int]:
        return 1, self.vocab_size // 4

    @property
    def value_range(self) -> tuple[int, int]:
        return self.vocab_size // 4, self.vocab_size // 2

    @property
    def filler_range(self) -> tuple[int, int]:
        return self.vocab_size // 2, self.vocab_size

    def build(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns inputs, labels: LongTensors [num_examples, seq_len]; only labels[:, −1] (the value) is scored."""
        gen = torch.Generator().manual_seed(seed)
        n, T = self.num_examples, self.seq_len
        seq = torch.randint(*self.filler_range, (n, T + 1), generator=gen)
        keys = torch.randint(*self.key_range, (n,), generator=gen)
        values = torch.randint(*self.value_range, (n,), generator=gen)
        if self.depth is None:
            pos = torch.randint(0, T - 3, (n,), generator=gen)
        else:
            pos = torch.full((n,), round(self.depth * (T - 4)), dtype=torch.long)
        rows = torch.arange(n)
        seq[rows, pos], seq[rows, pos + 1] = keys, values
        seq[:, T - 2], seq[:, T - 1], seq[:, T] = self.query_token, keys, values
        answers = torch.full((n, T + 1), -100, dtype=torch.long)
        answers[:, T] = values
        return _shift(seq, answers)


class PalindromeConfig(BaseModel):
    """Palindrome: ``length`` = L tokens from [0, V − 1), the separator V − 1, then the L tokens reversed.

    V = ``vocab_size`` (default 128: content [0, 127), separator 127); content tokens are i.i.d. uniform. The
    2L + 1 tokens are shifted as MQARConfig, so seq_len = 2L: inputs = ``x_1 … x_L SEP x_L … x_2``, labels −100 at
    positions 0..L−1 and labels[:, L + j] = x_{L−j} (j = 0..L−1): exactly the reversed half is scored, starting
    at the separator.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    length: int = Field(gt=0)
    num_examples: int = Field(gt=0)
    vocab_size: int = Field(128, gt=0)

    @model_validator(mode="after")
    def _sizes(self):
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 (content tokens and a separator), got {self.vocab_size}")
        return self

    @property
    def seq_len(self) -> int:
        return 2 * self.length

    @property
    def separator(self) -> int:
        return self.vocab_size - 1

    def build(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns inputs, labels: LongTensors [num_examples, 2 * length]; the reversed half scored."""
        gen = torch.Generator().manual_seed(seed)
        n, L = self.num_examples, self.length
        content = torch.randint(self.vocab_size - 1, (n, L), generator=gen)
        rev = content.flip(1)
        seq = torch.cat([content, torch.full((n, 1), self.separator), rev], dim=1)
        answers = torch.cat([torch.full((n, L + 1), -100), rev], dim=1)
        return _shift(seq, answers)


class StackConfig(BaseModel):
    """Multi-stack memory: ``num_stacks`` stacks (64) of values (26), a stream of PUSH / POP operations.

    Token layout (S = num_stacks, W = num_values): values [0, W) (a value's token is the value itself), stack ids
    [W, W + S) (stack s is token W + s), then PUSH = W + S, POP = W + S + 1, QUERY = W + S + 2;
    vocab_size = W + S + 3 (93 by default). Every operation is three tokens:
      - ``PUSH sid val``: push val onto stack sid;
      - ``POP sid QUERY``: pop stack sid; QUERY is a placeholder in the answer slot (as MQAR's filler 0), and the
        answer there is the popped value.
    Each operation is drawn given the current stacks: PUSH with probability ``push_prob`` (0.6) onto a uniform
    stack with a uniform value, else POP from a stack drawn uniformly among the NON-EMPTY ones; when every stack
    is empty (at the start, for one) the operation is a PUSH, so an empty stack is never popped. Stacks are
    unbounded and start empty. seq_len + 1 tokens of operations are generated (the last operation cut off where
    the sequence ends) and shifted as MQARConfig: the label at a POP's stack-id token is the popped value, −100
    elsewhere; a POP is scored exactly when its stack-id token is among the inputs.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq_len: int = Field(gt=0)
    num_examples: int = Field(gt=0)
    num_stacks: int = Field(64, gt=0)
    num_values: int = Field(26, gt=0)
    push_prob: float = Field(0.6, gt=0, lt=1)

    @model_validator(mode="after")
    def _sizes(self):
        if self.seq_len < 5:
            raise ValueError(f"seq_len must be >= 5 to hold a PUSH and a scored POP, got {self.seq_len}")
        return self

    @property
    def push_token(self) -> int:
        return self.num_values + self.num_stacks

    @property
    def pop_token(self) -> int:
        return self.num_values + self.num_stacks + 1

    @property
    def query_token(self) -> int:
        return self.num_values + self.num_stacks + 2

    @property
    def vocab_size(self) -> int:
        return self.num_values + self.num_stacks + 3

    def stack_token(self, sid: int) -> int:
        return self.num_values + sid

    def build(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns inputs, labels: LongTensors [num_examples, seq_len]; popped values at POPs' stack ids."""
        gen = torch.Generator().manual_seed(seed)
        n, S, W, T = self.num_examples, self.num_stacks, self.num_values, self.seq_len
        m = (T + 1 + 2) // 3                                   # operations, the last one possibly cut off
        coin = torch.rand(n, m, generator=gen)
        push_sid = torch.randint(S, (n, m), generator=gen)
        push_val = torch.randint(W, (n, m), generator=gen)
        # each stack as a linked list over operation indices: top[b, s] is the operation that pushed the top value
        # (−1: empty), below[b, j] the top before operation j's push, pushed[b, j] its value
        top = torch.full((n, S), -1, dtype=torch.long)
        below = torch.full((n, m), -1, dtype=torch.long)
        pushed = torch.zeros(n, m, dtype=torch.long)
        ops, sids, thirds = (torch.zeros(n, m, dtype=torch.long) for _ in range(3))
        popped = torch.full((n, m), -100, dtype=torch.long)
        for j in range(m):
            nonempty = top >= 0
            push = (coin[:, j] < self.push_prob) | ~nonempty.any(1)
            pop_sid = torch.rand(n, S, generator=gen).masked_fill(~nonempty, -1.0).argmax(1)
            sid = torch.where(push, push_sid[:, j], pop_sid)
            old = top.gather(1, sid[:, None])[:, 0]
            at = old.clamp_min(0)[:, None]
            value = pushed.gather(1, at)[:, 0]
            below[:, j], pushed[:, j] = old, push_val[:, j]     # used only if this is a push
            top.scatter_(1, sid[:, None], torch.where(push, j, below.gather(1, at)[:, 0])[:, None])
            ops[:, j] = torch.where(push, self.push_token, self.pop_token)
            sids[:, j] = sid + W
            thirds[:, j] = torch.where(push, push_val[:, j], self.query_token)
            popped[:, j] = torch.where(push, -100, value)
        seq = torch.stack([ops, sids, thirds], dim=2).reshape(n, 3 * m)[:, :T + 1]
        answers = torch.stack([torch.full_like(ops, -100), torch.full_like(ops, -100), popped], dim=2)
        return _shift(seq, answers.reshape(n, 3 * m)[:, :T + 1])


class HardMQARConfig(BaseModel):
    """MQAR generalised to V < T (the Kalman paper's hard setting T = 2048, V = 256, the defaults) and to the
    Kaczmarz paper's released generator.

    D = ``num_kv_pairs`` pairs ``k1 v1 … kD vD`` up front, keys from [1, V/2) and values from [V/2, V), then
    queries, the label at a query being its pair's value. Options:
      - ``sampling``: "distinct" (Zoology's: D distinct keys and D distinct values, so D <= V/2 − 1) or
        "replacement" (the Kaczmarz release's: every key and value drawn independently, so two pairs may share a
        key, whose queries are then ambiguous, or a value);
      - ``placement``: where the queries go:
          - "gaps" (Zoology's layout): at even offsets of the rest, gap slot i drawn with probability
            ∝ (i + 1)^(power_a − 1) without replacement, each query followed by an answer slot; built at length
            T + 1 and shifted (as ``MQARConfig``). The first D queries ask every key once; ``num_queries`` Q > D
            adds Q − D queries of uniform keys at the slots drawn after those (needs 2D + 2Q <= T).
          - "positions" (the Kaczmarz release's ``mqar_data.py``): each pair's key is queried once at an absolute
            position x drawn from the density ∝ x^(power_a − 1) on [2D, T − 2) and floored (the release's
            power-law alpha = 1 − power_a: its 0.1 is ``power_a = 0.9``, close to uniform), the pairs placed in a
            random order, a later query overwriting an earlier one at the same position (an example may keep fewer
            than D queries). No answer slot: the token after a query is filler. Built at length T, the label at
            the query's own position. Needs 2D + 3 <= T and no ``num_queries``. At T = 2048 with 32 pairs and
            power_a = 0.9, 89% of the queries sit past position 256 (the release's length extrapolation), where
            "gaps" with power_a = 0.01 puts 42% there.
      - ``random_non_queries`` (default True): every non-pair, non-query position (answer slots included) is a
        uniform token from [0, V); with V < T key and value tokens necessarily recur in this filler, unscored, and
        labels always use the D bindings up front. False: ``MQARConfig``'s zero filler.
    With the default options, num_queries = D and V > T the output equals ``MQARConfig``'s with the same fields
    and seed (Zoology's V > T requirement is dropped here).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_kv_pairs: int = Field(gt=0)
    num_examples: int = Field(gt=0)
    vocab_size: int = Field(256, gt=0)
    seq_len: int = Field(2048, gt=0)
    num_queries: int | None = Field(None, gt=0)
    power_a: float = Field(0.01, gt=0)
    random_non_queries: bool = True
    sampling: Literal["distinct", "replacement"] = "distinct"
    placement: Literal["gaps", "positions"] = "gaps"

    @model_validator(mode="after")
    def _sizes(self):
        D, Q = self.num_kv_pairs, self.queries
        if self.vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4 (keys [1, V/2) and values [V/2, V)), got {self.vocab_size}")
        if self.sampling == "distinct" and D > self.vocab_size // 2 - 1:
            raise ValueError(f"num_kv_pairs must be <= vocab_size // 2 - 1 = {self.vocab_size // 2 - 1} distinct "
                             f"keys, got {D} (or sampling='replacement')")
        if Q < D:
            raise ValueError(f"num_queries must be >= num_kv_pairs (every key is queried), got {Q} < {D}")
        if self.placement == "positions":
            if self.num_queries is not None and self.num_queries != D:
                raise ValueError(f"placement='positions' queries each pair once; num_queries must be None or "
                                 f"{D}, got {self.num_queries}")
            if 2 * D + 3 > self.seq_len:
                raise ValueError(f"placement='positions' needs 2 * num_kv_pairs + 3 <= seq_len, got 2 * {D} + 3 > "
                                 f"{self.seq_len}")
        else:
            if self.seq_len % 2:
                raise ValueError(f"seq_len must be even with placement='gaps', got {self.seq_len}")
            if 2 * D + 2 * Q > self.seq_len:
                raise ValueError(f"need 2 * num_kv_pairs + 2 * num_queries <= seq_len, got 2 * {D} + 2 * {Q} > "
                                 f"{self.seq_len}")
        return self

    @property
    def queries(self) -> int:
        return self.num_kv_pairs if self.num_queries is None else self.num_queries

    def build(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns inputs, labels: LongTensors [num_examples, seq_len]; labels −100 where not scored."""
        gen = torch.Generator().manual_seed(seed)
        n, T, D, V = self.num_examples, self.seq_len, self.num_kv_pairs, self.vocab_size
        if self.placement == "gaps":
            return mqar_examples(n, T, D, V, self.queries, self.power_a, self.random_non_queries, gen,
                                 replacement=self.sampling == "replacement")
        keys, values = pairs(n, D, V, self.sampling == "replacement", gen)
        inputs = (torch.randint(V, (n, T), generator=gen) if self.random_non_queries
                  else torch.zeros(n, T, dtype=torch.long))
        inputs[:, :2 * D] = torch.stack([keys, values], dim=2).reshape(n, 2 * D)
        labels = torch.full((n, T), -100, dtype=torch.long)
        order = torch.rand(n, D, generator=gen).argsort(1)                    # the order the pairs are placed in
        a, lo, hi = self.power_a, 2 * D, T - 2
        u = torch.rand(n, D, generator=gen, dtype=torch.float64)              # inverse CDF of x^(a − 1) on [lo, hi)
        pos = (u * (hi ** a - lo ** a) + lo ** a).pow(1 / a).floor().long().clamp(lo, hi - 1)
        rows = torch.arange(n)
        for j in range(D):                                                    # later placements overwrite earlier
            which = order[:, j]
            inputs[rows, pos[:, j]] = keys[rows, which]
            labels[rows, pos[:, j]] = values[rows, which]
        return inputs, labels

    def as_mqar(self) -> MQARConfig:
        """The equivalent ``MQARConfig`` (only valid where Zoology's constraints hold: V > T, num_queries = D,
        distinct pairs at gap slots)."""
        if self.queries != self.num_kv_pairs:
            raise ValueError("MQARConfig queries every key exactly once; num_queries must equal num_kv_pairs")
        if self.sampling != "distinct" or self.placement != "gaps":
            raise ValueError("MQARConfig draws distinct pairs and places queries at gap slots; needs "
                             "sampling='distinct' and placement='gaps'")
        return MQARConfig(vocab_size=self.vocab_size, seq_len=self.seq_len, num_kv_pairs=self.num_kv_pairs,
                          num_examples=self.num_examples, power_a=self.power_a,
                          random_non_queries=self.random_non_queries)


class CapacityMQARConfig(BaseModel):
    """The VLA paper's MQAR capacity curve: ``k1 v1 … kn vn SEP q1 q2 …``, T = 3n + 1 by default.

    V = ``vocab_size`` (default 128). Tokens: SEP = 0, PAD = 1, keys and values share [2, V): n = ``num_kv_pairs``
    distinct keys (needs n <= V − 2; the paper's grid ``CAPACITY_NUM_KV_PAIRS`` tops out at 96 <= 126) and values
    i.i.d. uniform from [2, V) (they may repeat and may equal key tokens: a token's role is fixed by its position).
    Queries follow each other with no answer slot, so labels sit at the query positions: labels[:, t] = value of
    key inputs[:, t] at every query, −100 elsewhere (the output after reading a query key is its value,
    MQARConfig's convention). ``queries`` picks how the part after SEP is made:

    - "permutation" (default): the n keys again, each once, in a uniformly random order; a ``seq_len`` above 3n + 1
      puts its extra T − (3n + 1) positions as PAD tokens between the last pair and SEP, so the pairs stay at the
      start, the queries at the end, and only the distance between them grows;
    - "fill" (the authors' released notebook): every one of the T − 2n − 1 positions after SEP is a query of a key
      drawn uniformly with replacement from the n (at T = 3n + 1: n queries, keys may repeat or be missing); a
      longer ``seq_len`` (the paper's long-context variant: n = 8, T in ``CAPACITY_LONG_SEQ_LENS``) means more
      queries, never PAD.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_kv_pairs: int = Field(gt=0)
    num_examples: int = Field(gt=0)
    vocab_size: int = Field(128, gt=0)
    seq_len: int | None = Field(None, gt=0)
    queries: Literal["permutation", "fill"] = "permutation"

    sep_token: ClassVar[int] = 0
    pad_token: ClassVar[int] = 1

    @model_validator(mode="after")
    def _sizes(self):
        n = self.num_kv_pairs
        if n > self.vocab_size - 2:
            raise ValueError(f"num_kv_pairs = {n} distinct keys do not fit in the {self.vocab_size - 2} key tokens "
                             f"[2, {self.vocab_size})")
        if self.seq_len is not None and self.seq_len < 3 * n + 1:
            raise ValueError(f"seq_len must be >= 3 * num_kv_pairs + 1 = {3 * n + 1}, got {self.seq_len}")
        return self

    @property
    def full_seq_len(self) -> int:
        """T: seq_len, or 3n + 1 when not given."""
        return 3 * self.num_kv_pairs + 1 if self.seq_len is None else self.seq_len

    def build(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns inputs, labels: LongTensors [num_examples, T]; every query position labelled with its value."""
        gen = torch.Generator().manual_seed(seed)
        N, n, V, T = self.num_examples, self.num_kv_pairs, self.vocab_size, self.full_seq_len
        keys = torch.rand(N, V - 2, generator=gen).argsort(1)[:, :n] + 2
        values = torch.randint(2, V, (N, n), generator=gen)
        if self.queries == "fill":
            pad, which = 0, torch.randint(n, (N, T - 2 * n - 1), generator=gen)
        else:
            pad, which = T - (3 * n + 1), torch.rand(N, n, generator=gen).argsort(1)
        inputs = torch.cat([torch.stack([keys, values], dim=2).reshape(N, 2 * n),
                            torch.full((N, pad), self.pad_token), torch.full((N, 1), self.sep_token),
                            keys.gather(1, which)], dim=1)
        labels = torch.cat([torch.full((N, 2 * n + pad + 1), -100), values.gather(1, which)], dim=1)
        return inputs, labels
