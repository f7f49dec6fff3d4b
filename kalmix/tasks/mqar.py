"""Multi-query associative recall (Zoology, Arora et al. 2023), generated the way Zoology does it."""
from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


class MQARConfig(BaseModel):
    """MQAR: D key–value pairs ``k1 v1 k2 v2 …`` up front, then the D keys again as queries at even offsets.

    Keys come from [1, V/2), values from [V/2, V), 0 is filler (uniform random tokens with
    ``random_non_queries``). Query gap slot i is drawn with probability ∝ (i + 1)^(power_a − 1) without
    replacement (strongly favouring early slots). The label at a query is its key's value; −100 elsewhere.
    Sequences are built with length T + 1 and shifted by one (inputs [:-1], labels [1:]).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    num_kv_pairs: int = Field(gt=0)
    num_examples: int = Field(gt=0)
    power_a: float = Field(0.01, gt=0)
    random_non_queries: bool = False

    @model_validator(mode="after")
    def _zoology_constraints(self):
        if self.seq_len % 2:
            raise ValueError(f"seq_len must be even, got {self.seq_len}")
        if self.vocab_size <= self.seq_len:
            raise ValueError(f"vocab_size must exceed seq_len (Zoology), got {self.vocab_size} <= {self.seq_len}")
        if 4 * self.num_kv_pairs > self.seq_len:
            raise ValueError(f"need 4 * num_kv_pairs <= seq_len, got 4 * {self.num_kv_pairs} > {self.seq_len}")
        if self.num_kv_pairs > self.vocab_size // 2 - 1:
            raise ValueError(f"num_kv_pairs must be <= vocab_size // 2 - 1 distinct keys, got {self.num_kv_pairs}")
        return self

    def build(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns inputs, labels: LongTensors [num_examples, seq_len]; labels −100 where not scored."""
        return mqar_examples(self.num_examples, self.seq_len, self.num_kv_pairs, self.vocab_size, self.num_kv_pairs,
                             self.power_a, self.random_non_queries, torch.Generator().manual_seed(seed))


def distinct(n: int, count: int, D: int, gen: torch.Generator) -> torch.Tensor:
    """[n, D] distinct indices from [0, count) per row, uniformly: the positions of the D smallest of ``count``
    uniform draws, in increasing order of the draws (``rand(n, count).argsort(1)[:, :D]`` but for exact ties), drawn
    in blocks of rows so that memory stays bounded at any n."""
    rows = max(1, 2 ** 24 // count)
    return torch.cat([torch.rand(min(rows, n - i), count, generator=gen).topk(D, dim=1, largest=False).indices
                      for i in range(0, n, rows)])


def pairs(n: int, D: int, V: int, replacement: bool, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [n, D] from [1, V/2) and values [n, D] from [V/2, V): distinct within an example (Zoology), or each
    drawn independently with replacement (``replacement``: two pairs may share a key or a value)."""
    half = V // 2
    if replacement:
        return (torch.randint(1, half, (n, D), generator=gen), torch.randint(half, V, (n, D), generator=gen))
    return distinct(n, half - 1, D, gen) + 1, distinct(n, V - half, D, gen) + half


def mqar_examples(n: int, T: int, D: int, V: int, Q: int, power_a: float, random_non_queries: bool,
                  gen: torch.Generator, replacement: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """MQAR's sampling: per example D keys from [1, V/2) and D values from [V/2, V) (``pairs``) laid out as
    ``k1 v1 …``, then Q queries (every key once, then Q − D keys drawn again) at even offsets of the remaining
    T + 1 − 2D slots, slot i drawn ∝ (i + 1)^(power_a − 1) without replacement; filler 0, or uniform over [0, V)
    with ``random_non_queries``. Returns inputs, labels [n, T] (the sequence of T + 1 shifted by one)."""
    keys, values = pairs(n, D, V, replacement, gen)
    context = 2 * D
    kvs = torch.stack([keys, values], dim=2).reshape(n, context)
    space = (T - context) // 2
    p = power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (power_a - 1)
    gaps = torch.multinomial((p / p.sum()).expand(n, space), Q, replacement=False, generator=gen)
    which = torch.arange(D).expand(n, D)
    if Q > D:
        which = torch.cat([which, torch.randint(D, (n, Q - D), generator=gen)], dim=1)
    queries = torch.zeros(n, T - context + 1, dtype=torch.long)
    queries.scatter_(1, 2 * gaps, keys.gather(1, which))
    seqs = torch.cat([kvs, queries], dim=1)                                       # [n, T + 1]
    labels = torch.full((n, T + 1), -100, dtype=torch.long)
    labels.scatter_(1, 2 * gaps + context + 1, values.gather(1, which))
    inputs, labels = seqs[:, :-1].clone(), labels[:, 1:].clone()
    if random_non_queries:
        filler = inputs == 0
        inputs[filler] = torch.randint(V, (int(filler.sum()),), generator=gen)
    return inputs, labels
