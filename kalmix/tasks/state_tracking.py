"""Word problems over finite groups (Merrill et al. 2024): track the running product of a sequence of elements.

Groups (``GROUPS``) and their deterministic element ordering, the identity always at index 0:

- ``"S5"``: all 120 permutations of {0, …, 4} in lexicographic order of their tuples.
- ``"A5"``: the 60 even permutations of {0, …, 4}, lexicographic order (non-solvable: the hard case).
- ``"A4xZ5"``: pairs (a, z) with a one of the 12 even permutations of {0, …, 3} (lexicographic, index i_a) and
  z ∈ Z5; index = 5 · i_a + z (60 elements, solvable: a control of the same order as A5).
- ``"Z60"``: the integers mod 60, index = the integer (abelian control).

A permutation is a tuple p with p[x] the image of x. The product a·b applies a FIRST, then b:
(a·b)[x] = b[a[x]]. A4xZ5 multiplies componentwise, (a, z)·(b, w) = (a·b, z + w mod 5); Z60 adds mod 60.
``multiplication_table(group)[i, j]`` is the index of e_i·e_j.

Task: inputs are k element indices drawn uniformly (and independently) from 0..|G|−1; labels[:, i] is the index of
the running product g_1·g_2·…·g_i, multiplied left to right (s_1 = g_1, s_i = s_{i−1}·g_i), i.e. the permutation
that applies g_1, then g_2, …, then g_i. Every position is scored (there is no −100).

Label convention (the same as ``MQARConfig``): labels[:, t] is the target of the model's output at position t, after
it has read inputs[:, :t + 1]; score logits[:, t] against labels[:, t] directly (as ``kalmix.bench.mqar`` does), NOT
through ``KalmixForCausalLM(labels=...)``, which scores logits[t] against labels[t + 1]. Here this is token
classification with the label at the same position as the element it follows (not next-token prediction): the
label is never the next input token. Inputs and labels share the ids 0..|G|−1 (``num_classes`` = vocabulary).
"""
from __future__ import annotations

import functools
import itertools
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

GroupName = Literal["A5", "S5", "A4xZ5", "Z60"]
GROUPS: tuple[str, ...] = ("A5", "S5", "A4xZ5", "Z60")


def _is_even(p: tuple[int, ...]) -> bool:
    inversions = sum(p[i] > p[j] for i in range(len(p)) for j in range(i + 1, len(p)))
    return inversions % 2 == 0


def _compose(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """a·b: apply a first, then b."""
    return tuple(b[a[x]] for x in range(len(a)))


@functools.cache
def _group(group: str) -> tuple[tuple, tuple[tuple[int, ...], ...]]:
    """(elements, table) as tuples; the identity is element 0."""
    if group in ("S5", "A5"):
        perms = list(itertools.permutations(range(5)))          # lexicographic: the identity first
        elements = tuple(p for p in perms if group == "S5" or _is_even(p))
        mul = _compose
    elif group == "A4xZ5":
        a4 = [p for p in itertools.permutations(range(4)) if _is_even(p)]
        elements = tuple((a, z) for a in a4 for z in range(5))  # index 5 * i_a + z
        def mul(x, y):
            return (_compose(x[0], y[0]), (x[1] + y[1]) % 5)
    elif group == "Z60":
        elements = tuple(range(60))
        def mul(x, y):
            return (x + y) % 60
    else:
        raise ValueError(f"unknown group {group!r}; expected one of {GROUPS}")
    index = {e: i for i, e in enumerate(elements)}
    table = tuple(tuple(index[mul(a, b)] for b in elements) for a in elements)
    return elements, table


def group_elements(group: str) -> list:
    """The elements in index order: permutation tuples (A5, S5), (perm-of-4 tuple, z) pairs (A4xZ5), ints (Z60)."""
    return list(_group(group)[0])


def group_order(group: str) -> int:
    """|G|."""
    return len(_group(group)[0])


def multiplication_table(group: str) -> torch.Tensor:
    """[|G|, |G|] LongTensor (a fresh copy): entry [i, j] is the index of e_i·e_j (e_i applied first)."""
    return torch.tensor(_group(group)[1], dtype=torch.long)


def running_products(table: torch.Tensor, elements: torch.Tensor) -> torch.Tensor:
    """Prefix products along the last dim of ``elements`` [..., k]: out[..., i] = e_0·e_1·…·e_i (left to right).

    A Hillis–Steele scan (log2 k table look-ups over the whole batch); valid for any associative ``table``.
    """
    out = elements.clone()
    shift = 1
    while shift < out.shape[-1]:
        out = torch.cat([out[..., :shift], table[out[..., :-shift], out[..., shift:]]], dim=-1)
        shift *= 2
    return out


class WordProblemConfig(BaseModel):
    """Word problem of ``group``: ``seq_len`` = k uniform element indices; labels = indices of the running products.

    See the module docstring for the element ordering, the product's order and the label convention.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    group: GroupName
    seq_len: int = Field(gt=0)
    num_examples: int = Field(gt=0)

    @property
    def num_classes(self) -> int:
        """|G|: both the input vocabulary and the number of label classes."""
        return group_order(self.group)

    def build(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns inputs, labels: LongTensors [num_examples, seq_len], both in 0..|G|−1 (every position scored)."""
        gen = torch.Generator().manual_seed(seed)
        inputs = torch.randint(self.num_classes, (self.num_examples, self.seq_len), generator=gen)
        labels = running_products(multiplication_table(self.group), inputs)
        return inputs, labels


def _predictions(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if pred.dim() == labels.dim() + 1 and pred.shape[:-1] == labels.shape:
        pred = pred.argmax(-1)                      # logits [N, T, C]
    if pred.shape != labels.shape:
        raise ValueError(f"pred must be [N, T] class indices or [N, T, C] logits matching labels "
                         f"{list(labels.shape)}, got {list(pred.shape)}")
    return pred


def token_accuracy(pred: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of scored positions (labels != −100) predicted right, pooled over all sequences (micro).

    ``pred``: [N, T] predicted class indices, or [N, T, C] logits (arg-maxed). NaN when nothing is scored.
    """
    pred = _predictions(pred, labels)
    scored = labels != -100
    return ((pred == labels) & scored).sum().item() / scored.sum().item() if scored.any() else float("nan")


def sequence_accuracy(pred: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of sequences whose every scored position (labels != −100) is predicted right.

    ``pred`` as in ``token_accuracy``. A sequence without scored positions counts as right.
    """
    pred = _predictions(pred, labels)
    wrong = (pred != labels) & (labels != -100)
    return (~wrong.any(-1)).float().mean().item()
