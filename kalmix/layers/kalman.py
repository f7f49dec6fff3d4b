"""Kalman linear attention layer (Kalman LA paper §4.4 and App. A; gaps filled from the authors' released code)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kalmix.layers.base import MixerLayer
from kalmix.layers.common import (P_MIN, ShortConv, check_dt_range, check_int, check_layer, check_real, fused_kernels,
                                  head_size, upcast)
from kalmix.layers.spec import MixerSpec
from kalmix.ops import SPECS, kalman_attention


NOISE_PARAMS = ("p2", "p")


class KalmanAttention(MixerLayer):
    """Mamba-style block around an exact diagonal Kalman filter.

    in_proj -> (x, gate); x -> causal conv(4) + SiLU; sensor projection of x -> value v, value precision
    Λv = 1 / (softplus(s) + 1e-4), and unit-norm k, q per head (shared by the head's channels, like Mamba-1's
    B and C). The prior is an Ornstein–Uhlenbeck process with learned a > 0, Δ and p per (head, slot, channel):
    ā = exp(−aΔ), p̄ = p² / (2a) · (1 − exp(−2aΔ)). Output (μ readout + skip · x) · SiLU(gate) -> out_proj.

    ``forward(..., output_variance=True)`` returns the posterior variance propagated through the gate and the
    output projection as the second value (channels treated as independent: var · SiLU(gate)², then W_out²).

    ``forward(..., sample_readout=True)`` replaces the μ readout o [B, T, H, D] by one draw from the readout's
    posterior, o + √var · ε with ε ~ N(0, 1) fresh per element (``readout_noise``), in fp32 (fp64 for fp64
    activations) and then back to o's dtype: the sampled readout y^(s) of the paper's KLA+ (App. A, Eq. 24).

    ``noise_param`` sets how the learned p gives the process noise:

    - ``"p2"`` (default): p̄ = p² / (2a) · (1 − exp(−2aΔ)), the paper's OU discretisation (DESIGN §1.1).
    - ``"p"``: p̄ = max(p, 1e-7) / (2a) · (1 − exp(−2aΔ)), the authors' released layer (its p is clamped at
      1e-7, which keeps p̄ > 0).

    The default is ``"p2"`` because p² keeps p̄ >= 0 for every p with a gradient that vanishes only at p = 0,
    while the clamp gives p no gradient below 1e-7, so an entry that training pushes there stays there. At the
    same p_init = 0.01 the two start the noise 100× apart (p̄ ≈ p²Δ vs pΔ).

    Args:
        d_model: model width; expand: channels M = expand · d_model; d_state: N; num_heads: H (M = H · D);
        noise_param: "p2" | "p".
    """

    op_spec = SPECS["kalman"]

    def __init__(self, d_model: int, expand: int = 2, d_state: int = 16, num_heads: int = 1, conv_size: int = 4,
                 dt_min: float = 1e-3, dt_max: float = 0.1, p_init: float = 0.01, noise_param: str = "p2",
                 layer_idx: int = 0, impl: str | None = None):
        super().__init__()
        name = type(self).__name__
        check_layer(name, d_model, layer_idx, impl)
        if noise_param not in NOISE_PARAMS:
            raise ValueError(f"KalmanAttention: noise_param must be one of {NOISE_PARAMS}, got {noise_param!r}")
        self.d_inner = check_int(name, "expand", expand) * d_model
        head_dim = head_size(name, "expand · d_model", self.d_inner, num_heads)
        check_int(name, "d_state", d_state)
        check_int(name, "conv_size", conv_size)
        check_dt_range(name, dt_min, dt_max)
        check_real(name, "p_init", p_init, -math.inf)
        self.noise_param = noise_param
        self.d_model, self.layer_idx, self.impl = d_model, layer_idx, impl
        self.num_heads, self.d_state, self.head_dim = num_heads, d_state, head_dim
        M, H, N, D = self.d_inner, num_heads, d_state, self.head_dim
        self.in_proj = nn.Linear(d_model, 2 * M, bias=False)
        self.conv = ShortConv(M, conv_size, bias=True)
        self.sensor_proj = nn.Linear(M, 2 * M + 2 * H * N, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H, N, D))                # a = 1 at init (released code)
        dt = torch.exp(torch.rand(H, N, D) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp_min(1e-4)
        self.dt_raw = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^{-1}(Δ)
        self.p = nn.Parameter(torch.full((H, N, D), p_init))
        self.skip = nn.Parameter(torch.tensor(-1.0))
        self.out_proj = nn.Linear(M, d_model, bias=False)
        for prm in (self.A_log, self.dt_raw, self.p, self.skip):
            prm._no_weight_decay = True

    def fused(self, device) -> bool:
        """Whether the elementwise work around the op runs as fused Triton kernels (``layers/fused.py``): where
        the op runs its Triton impl. The torch chains below are the CPU path and the kernels' reference."""
        return self.impl == "triton" or (self.impl is None and device.type == "cuda")

    def dynamics(self):
        """(decay ā, process noise p̄), both [H, N, D] fp32, from the OU discretisation."""
        linear_p = self.noise_param == "p"
        if self.fused(self.A_log.device):
            return fused_kernels().ou_dynamics(self.A_log, self.dt_raw, self.p, linear_p)
        a = upcast(self.A_log).exp()
        dt = F.softplus(upcast(self.dt_raw))
        decay = torch.exp(-a * dt)
        p = upcast(self.p)
        scale = p.clamp_min(P_MIN) if linear_p else p ** 2
        noise = scale / (2 * a) * -torch.expm1(-2 * a * dt)
        return decay, noise

    def project_in(self, x):
        return self.in_proj(x)

    def project(self, h, conv_state, docs=None):
        B, T, _ = h.shape
        H, N, D = self.num_heads, self.d_state, self.head_dim
        z, gate = h.chunk(2, dim=-1)
        gate = gate.contiguous()    # what the readout saves for the backward, rather than a view keeping z's half too
        z, conv_state = self.conv(z, conv_state, docs)
        if self.fused(h.device):
            v, w, k, q = fused_kernels().sensor_split(self.sensor_proj(z), H, N)
            return [q, k, v.view(B, T, H, D), w.view(B, T, H, D)], (z, gate), conv_state
        v, s, k, q = self.sensor_proj(z).split([self.d_inner, self.d_inner, H * N, H * N], dim=-1)
        k = F.normalize(k.view(B, T, H, N), dim=-1)
        q = F.normalize(q.view(B, T, H, N), dim=-1)
        w = 1.0 / (F.softplus(upcast(s)) + 1e-4)
        return [q, k, v.view(B, T, H, D), w.view(B, T, H, D).to(v.dtype)], (z, gate), conv_state

    def mix(self, inputs, initial_state, output_final_state, cu_seqlens, impl, output_variance: bool = False,
            sample_readout: bool = False, **kwargs):
        decay, noise = self.dynamics()
        # the filter's state math is fp32 (fp64) whatever the activations are: every impl computes in
        # compute_dtype (precisions reach ~1e6), so the activations go in as they are
        # the values are in range by construction (Λv > 0, ā in (0, 1], p̄ >= 0): no host sync for checking them
        o, var, state = self.run_op(kalman_attention, *inputs, decay, noise, initial_state=initial_state,
                                    output_final_state=output_final_state,
                                    output_variance=output_variance or sample_readout,
                                    cu_seqlens=cu_seqlens, impl=impl, check_values=False)
        return o, var, state

    def readout_noise(self, var: torch.Tensor) -> torch.Tensor:
        """ε ~ N(0, 1) of var's shape [B, T, H, D], fp32 (fp64 for fp64 var): the draw of ``sample_readout``."""
        return torch.randn(var.shape, dtype=upcast(var).dtype, device=var.device)

    def readout(self, o, var, ctx, output_variance: bool = False, sample_readout: bool = False, **kwargs):
        z, gate = ctx
        B, T = z.shape[:2]
        if sample_readout:
            o = (upcast(o) + upcast(var).sqrt() * self.readout_noise(var)).to(o.dtype)
        if self.fused(z.device):
            y = fused_kernels().gated_skip(o.reshape(B, T, self.d_inner), z, gate, self.skip)
        else:
            y = (o.reshape(B, T, self.d_inner) + self.skip * z) * F.silu(gate)  # in the activations' dtype
        out = self.out_proj(y)
        if not output_variance:
            return out, None
        var_y = var.reshape(B, T, self.d_inner) * F.silu(upcast(gate)) ** 2
        return out, F.linear(var_y, upcast(self.out_proj.weight) ** 2)

    def state_size(self) -> int:
        """Recurrent-state elements per sequence: precision and mean [H, N, D] (the paper's 2·M·N; the short-conv
        buffer of kernel − 1 inputs per channel comes on top while decoding)."""
        return 2 * self.num_heads * self.d_state * self.head_dim


# benchmarks set its state slots, not its heads: the paper's layer has one; its compact variant is the paper's MQAR
# setting (expand 1)
MIXER_SPECS = (MixerSpec("kalman", KalmanAttention, lambda layer: (layer.num_heads, layer.d_state, layer.head_dim),
                         {"d_state": "d_state"}, compact={"expand": 1}, headline=True),)
