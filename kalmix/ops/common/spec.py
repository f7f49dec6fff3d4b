"""The op spec: everything the rest of kalmix asks about one op, declared once beside its code
(``kalmix/ops/<op>/spec.py``) and registered in ``kalmix.ops.SPECS``.

Layers, models, ``kalmix.distributed``, the benchmarks and the tests read an op's impls, state layout, context-
parallel rule, cost model, decoding step and test inputs from its spec instead of keeping tables of their own.
Shapes follow the package's layout: activations [B, T, H, K] / [B, T, H, V] (Kalman: K, V = N, D), states
[n, H, ...] for n sequences.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from kalmix.ops.common.checks import device_refusal
from kalmix.ops.common.cost import Cost

# what mode="combine" of kalmix.distributed.context_parallel does with an op whose state map over a piece is affine:
# "columns": S ↦ P S + Q with P independent of S, acting on each column of S alone (probed in one call);
# "decayed_sums": every state tensor is a sum decayed by one scalar per head and token (P = exp(Σ g))
COMBINE_RULES = ("columns", "decayed_sums")


def matrix_heads(heads: int, head_dim: int, d_model: int, d_state: int) -> tuple[int, int, int]:
    """The head shape (H, K, V) of a matrix-state op at a model's sizes: ``heads`` heads of head_dim × head_dim."""
    return heads, head_dim, head_dim


@dataclass(frozen=True)
class OpSpec:
    """One op, as the rest of kalmix sees it.

    Args:
        name: the registry key ("kalman"); ``fn.__name__`` is the public function's name.
        fn: the op, ``fn(*inputs, initial_state=, output_final_state=, cu_seqlens=, impl=, ...)``.
        impls: impl name -> the function that runs it (``impl=None`` resolves to one of these or raises).
        state_shapes: (n, H, K, V) -> the shape of each state tensor for n sequences.
        default_state: (n, H, K, V, dtype, device, kwargs) -> the state the op starts from when given none
            (kwargs: the op's call arguments, e.g. VLA's ``lambda0``).
        inputs: (B, T, H, K, V, dtype, generator) -> realistic random positional inputs (tests, benchmarks).
        random_state: (n, H, K, V, dtype, generator) -> a valid random initial state for n sequences, in the form
            the op takes (one tensor or a tuple).
        cost: its FLOP and byte model.
        outputs: for each output before the final state, the keyword that requests it (None: always returned):
            (None,) for (o,); Kalman's (None, "output_variance") for (o, variance).
        n_params: trailing positional inputs that are time-invariant ([H, ...], not split along T: Kalman's decay
            and process noise).
        combine: the affine rule of its state map over a piece (one of ``COMBINE_RULES``) for context
            parallelism's mode="combine"; None: relay only.
        step_impls: impls whose single-token call is one fused step (decoding runs it where the layer runs that
            impl; elsewhere the token loop's step, impl="naive").
        bench_heads: (heads, head_dim, d_model, d_state) -> the head shape (H, K, V) ``kalmix speed`` times the op
            at: the shape it has in its layer at those sizes.
        sweep: a keyword ``kalmix speed`` times at several values, one row each (GKA's num_iters), or None.
        timed: ``kalmix speed`` times the op itself (False: an op under baselines only, timed through its layers).
        test_kwargs: keywords the contract tests call it with, besides every optional output (GKA's ridge).
    """
    name: str
    fn: Callable
    impls: Mapping[str, Callable]
    state_shapes: Callable[[int, int, int, int], tuple[tuple[int, ...], ...]]
    default_state: Callable[..., tuple[torch.Tensor, ...]]
    inputs: Callable[..., list[torch.Tensor]]
    random_state: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
    cost: Cost
    outputs: tuple[str | None, ...] = (None,)
    n_params: int = 0
    combine: str | None = None
    step_impls: tuple[str, ...] = ()
    bench_heads: Callable[[int, int, int, int], tuple[int, int, int]] = matrix_heads
    sweep: str | None = None
    timed: bool = True
    test_kwargs: Mapping = field(default_factory=dict)

    def __post_init__(self):
        if self.combine not in (None, *COMBINE_RULES):
            raise ValueError(f"OpSpec {self.name!r}: `combine` must be None or one of {COMBINE_RULES}, "
                             f"got {self.combine!r}")
        bad = sorted(set(self.step_impls) - set(self.impls))
        if bad:
            raise ValueError(f"OpSpec {self.name!r}: step_impls {bad} are not among its impls {list(self.impls)}")

    @property
    def n_outputs(self) -> int:
        """Outputs before the final state."""
        return len(self.outputs)

    @property
    def single_state(self) -> bool:
        """The state is one tensor, not a tuple."""
        return len(self.state_shapes(1, 1, 1, 1)) == 1

    def runnable_impls(self, device: torch.device) -> tuple[str, ...]:
        """The impls that run on ``device``: on CPU, "triton" only under TRITON_INTERPRET=1."""
        return tuple(i for i in self.impls if device_refusal(i, device) is None)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal values drawn in fp64 from ``gen``, cast to ``dtype`` (the same draw for every dtype)."""
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def uniform(gen: torch.Generator, lo: float, hi: float, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Values uniform in [lo, hi), drawn in fp64 from ``gen``, cast to ``dtype``."""
    return (lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)).to(dtype)


def unit(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal vectors scaled to unit length along the last dimension."""
    x = randn(gen, *shape, dtype=dtype)
    return x / x.norm(dim=-1, keepdim=True)


def spd(gen: torch.Generator, n: int, H: int, K: int, dtype: torch.dtype, shift: float) -> torch.Tensor:
    """[n, H, K, K] symmetric positive definite: X Xᵀ / K + shift · I."""
    X = randn(gen, n, H, K, K, dtype=torch.float64)
    return (X @ X.transpose(-1, -2) / K + shift * torch.eye(K, dtype=torch.float64)).to(dtype)
