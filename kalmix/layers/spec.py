"""The mixer spec: what models, benchmarks and the trainer ask about one mixer, declared beside its layer class
(each layer module's ``SPECS``) and registered in ``kalmix.layers.MIXER_SPECS``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch.nn as nn

from kalmix.ops import OpSpec
from kalmix.ops.common.cost import Cost, Shape

SIZES = ("heads", "head_dim", "d_state")      # the generic sizes a benchmark gives every mixer


def _no_kwargs(layer: nn.Module) -> dict:
    return {}


@dataclass(frozen=True)
class MixerSpec:
    """One mixer.

    Args:
        name: its name in configs and on the command line ("kaczmarz").
        layer: its class, built as ``layer(d_model, **kwargs)``; its ``op_spec`` class attribute, if any, is the
            kalmix op it runs.
        heads: a built layer -> the head shape (H, K, V) of its op.
        sizes: generic size (``SIZES``) -> the layer's argument that sets it; a size it lacks is not passed
            (Kalman takes d_state but keeps its paper's one head).
        compact: layer arguments of its smaller variant, for small synthetic-task models and for parameter
            matching (Kalman: expand 1); empty for none.
        cost: the cost model of what it runs when it runs no kalmix op (softmax attention's SDPA, fla's delta rule).
        cost_kwargs: a built layer -> the op keywords its cost depends on (GKA: its Chebyshev steps).
        headline: in the benchmarks' default comparison (kalmix's four mixers beside attention and GDN).
        requires: a package beyond kalmix's own that it runs on ("fla": fla's Triton kernels, CUDA only).
    """
    name: str
    layer: type
    heads: Callable[[nn.Module], tuple[int, int, int]]
    sizes: Mapping[str, str] = field(default_factory=dict)
    compact: Mapping[str, Any] = field(default_factory=dict)
    cost: Cost | None = None
    cost_kwargs: Callable[[nn.Module], dict] = _no_kwargs
    headline: bool = False
    requires: str | None = None

    def __post_init__(self):
        bad = sorted(set(self.sizes) - set(SIZES))
        if bad:
            raise ValueError(f"MixerSpec {self.name!r}: sizes {bad} are not among {SIZES}")
        if (self.cost is None) == (self.op is None):
            raise ValueError(f"MixerSpec {self.name!r}: give `cost` exactly when the layer runs no kalmix op "
                             "(an op's cost is its spec's)")

    @property
    def op(self) -> OpSpec | None:
        """The spec of the kalmix op it runs (None: softmax attention, fla's layers)."""
        return getattr(self.layer, "op_spec", None)

    @property
    def op_cost(self) -> Cost:
        """The cost model of what it runs: its op's, or its own ``cost``."""
        return self.op.cost if self.op is not None else self.cost

    @property
    def context_parallel(self) -> bool:
        """Whether it can run on a sequence split across ranks (``kalmix.distributed.context_parallel_model``)."""
        return hasattr(self.layer, "context_split")

    def size_kwargs(self, **sizes: int | None) -> dict:
        """The layer's arguments for the generic ``sizes`` (heads=, head_dim=, d_state=; None: not given) that it
        takes, e.g. ``{"num_heads": 8, "head_k_dim": 64}``."""
        bad = sorted(set(sizes) - set(SIZES))
        if bad:
            raise ValueError(f"MixerSpec.size_kwargs: unknown size(s) {bad}; the sizes are {SIZES}")
        return {self.sizes[k]: v for k, v in sizes.items() if k in self.sizes and v is not None}

    def flops(self, layer: nn.Module, seq_len: int) -> float:
        """Forward+backward FLOPs of the built ``layer``'s op on one row of ``seq_len`` tokens (attention: the
        whole causal triangle of the row)."""
        return self.op_cost.flops(Shape(1, seq_len, *self.heads(layer)), "fwdbwd", **self.cost_kwargs(layer))
