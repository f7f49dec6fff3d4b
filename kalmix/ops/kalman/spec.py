"""The op spec of Kalman linear attention (``kalman_attention``), and its test inputs in trained layers' regime."""
from __future__ import annotations

import torch

from kalmix.ops.common.cost import Cost, Shape
from kalmix.ops.common.spec import OpSpec, randn, uniform, unit
from kalmix.ops.kalman.op import _IMPLS, kalman_attention


def _flops(s: Shape, mode: str) -> float:
    """9 (forward) or 39 (forward+backward) fp32 FMA-equivalents per lane-token, 2 FLOPs each
    (``kalmix.ops.common.cost``)."""
    return 2 * (9 if mode == "fwd" else 39) * s.B * s.H * s.T * s.K * s.V


def _inputs(B, T, H, N, D, dtype, gen):
    """q, k unit [B, T, H, N]; v [B, T, H, D]; precision in [0.1, 3); decay in [0.5, 1), process noise in [0, 0.2)
    [H, N, D]."""
    return [unit(gen, B, T, H, N, dtype=dtype), unit(gen, B, T, H, N, dtype=dtype), randn(gen, B, T, H, D, dtype=dtype),
            uniform(gen, 0.1, 3.0, B, T, H, D, dtype=dtype), uniform(gen, 0.5, 1.0, H, N, D, dtype=dtype),
            uniform(gen, 0.0, 0.2, H, N, D, dtype=dtype)]


def _default_state(n, H, N, D, dtype, device, kwargs):
    """Precision 1, mean 0."""
    return (torch.ones(n, H, N, D, dtype=dtype, device=device), torch.zeros(n, H, N, D, dtype=dtype, device=device))


SPEC = OpSpec(
    name="kalman",
    fn=kalman_attention,
    impls=_IMPLS,
    state_shapes=lambda n, H, N, D: ((n, H, N, D), (n, H, N, D)),          # (precision, mean)
    default_state=_default_state,
    inputs=_inputs,
    random_state=lambda n, H, N, D, dtype, gen: (uniform(gen, 0.5, 2.0, n, H, N, D, dtype=dtype),
                                                 randn(gen, n, H, N, D, dtype=dtype)),
    cost=Cost(_flops, reads=lambda s: 2 * s.K + 2 * s.V,                   # q, k; v and its precision
              param_bytes=lambda s: 4 * 2 * s.H * s.K * s.V, ceiling="fp32"),   # fp32 decay and process noise
    outputs=(None, "output_variance"),          # (o, variance)
    n_params=2,                 # decay, process_noise [H, N, D]
    combine=None,               # the precision follows a Möbius map: not affine in the state (relay only)
    step_impls=("triton",),
    # timed as in the paper's layer: one head of d_state slots × 2 · d_model channels (expand 2)
    bench_heads=lambda heads, head_dim, d_model, d_state: (1, d_state, 2 * d_model),
)


def realistic_inputs(T, dtype, seed=0, B=1, H=1, N=16, D=8):
    """The regime of trained layers: decay near 1, tiny process noise, value precision up to 1e4."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, N, **f64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, N, **f64), dim=-1)
    v = torch.randn(B, T, H, D, **f64)
    w = 10 ** (6 * torch.rand(B, T, H, D, **f64) - 2)               # 1e-2 .. 1e4
    a = 0.9 + 0.099 * torch.rand(H, N, D, **f64)                   # [0.9, 0.999]
    p = 10 ** (-7 + torch.rand(H, N, D, **f64))                     # 1e-7 .. 1e-6
    return [x.to(dtype) for x in (q, k, v, w, a, p)]
