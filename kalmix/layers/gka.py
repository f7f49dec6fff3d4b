"""Gated KalmaNet layer (GKA paper §4.3, Fig. 2; the parameterisation of its released layer)."""
from __future__ import annotations

import torch
import torch.nn as nn

from kalmix.layers.base import MixerLayer
from kalmix.layers.common import (DecayGate, GatedRMSNorm, ShortConv, check_int, check_layer, check_real,
                                  gated_norm_out, head_size, l2_normalize)
from kalmix.layers.spec import MixerSpec
from kalmix.ops import SPECS, gated_kalmanet


BETA_SCALINGS = ("squared", "linear", "none")
_BETA_EPS = 1e-6    # the released layer's offset: k and v are scaled by β + 1e-6


class GatedKalmaNet(MixerLayer):
    """One input projection (q, k, v, output gate, β, α and decay pre-activations) + short conv (4, SiLU) over
    q, k, v; q, k L2-normalised; β = sigmoid, α = sigmoid, Mamba-2 decay (A ~ U(0, 16), the released layer's
    init); x_t = Chebyshev solve of (H_t + ridge·‖H_t‖_F I) x = q_t; o = U_tᵀ (q + α(x − q)) / √D;
    per-head gated RMSNorm; out projection.

    ``beta_scaling`` sets the weight w_t each token gets in H_t = γ_t H_{t-1} + w_t k_t k_tᵀ and
    U_t = γ_t U_{t-1} + w_t k_t v_tᵀ (the op's ``beta``):

    - ``"squared"`` (default): w_t = (β_t + 1e-6)², what the authors' released layer computes by scaling both k_t
      and v_t by β_t + 1e-6 before its kernels (its ``use_beta_gate``, on by default).
    - ``"linear"``: w_t = β_t, the same range with β itself as the weight.
    - ``"none"``: w_t = 1, no β projection: the paper's objective (3), whose weights come from the decay alone
      (§4.1), as in its MQAR experiments (Fig. 3a).

    The default is the released layer's: the paper's equations have no β, and its authors train with the β gate.
    ``use_decay=False`` (γ = 1) and ``use_alpha=False`` (α = 1: the pure solve) drop those gates and their
    projections; with ``beta_scaling="none"`` they give the layer of the paper's Fig. 3a ("without any gating or
    α-connection").

    Args:
        d_model: width; num_heads: H; head_dim: D (K = V = D); ridge, num_iters: of the solve (DESIGN §1.2);
        norm_eps: of the output norm (the released layer's 1e-6); beta_scaling: "squared" | "linear" | "none";
        use_decay, use_alpha: keep the decay gate and the α-connection.
    """

    op_spec = SPECS["gka"]

    def __init__(self, d_model: int, num_heads: int = 4, head_dim: int | None = None, conv_size: int = 4,
                 ridge: float = 0.02, num_iters: int | None = 30, norm_eps: float = 1e-6,
                 beta_scaling: str = "squared", use_decay: bool = True, use_alpha: bool = True, layer_idx: int = 0,
                 impl: str | None = None):
        super().__init__()
        name = type(self).__name__
        check_layer(name, d_model, layer_idx, impl)
        if beta_scaling not in BETA_SCALINGS:
            raise ValueError(f"GatedKalmaNet: beta_scaling must be one of {BETA_SCALINGS}, got {beta_scaling!r}")
        if head_dim is None:
            head_dim = head_size(name, "d_model", d_model, num_heads)
        check_int(name, "num_heads", num_heads)
        check_int(name, "head_dim", head_dim)
        check_int(name, "conv_size", conv_size)
        check_real(name, "ridge", ridge)
        if num_iters is not None:
            check_int(name, "num_iters", num_iters, 0, " (or None: the exact solve)")
        check_real(name, "norm_eps", norm_eps)
        self.beta_scaling, self.use_decay, self.use_alpha = beta_scaling, use_decay, use_alpha
        self.d_model, self.layer_idx, self.impl = d_model, layer_idx, impl
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.ridge, self.num_iters = ridge, num_iters
        width = num_heads * self.head_dim
        on = {"beta": beta_scaling != "none", "alpha": use_alpha, "g": use_decay}
        self.proj_gates = tuple(n for n in ("beta", "alpha", "g") if on[n])    # their pre-activations' order
        self.gates = tuple(n for n in ("g", "beta", "alpha") if on[n])         # the op's arguments, in its order
        self.splits = (3 * width, width) + (num_heads,) * len(self.proj_gates)  # q|k|v, gate, β, α, decay
        self.in_proj = nn.Linear(d_model, sum(self.splits), bias=False)
        self.conv = ShortConv(3 * width, conv_size)                        # q, k, v channels in one conv
        if on["beta"]:
            self.beta_bias = nn.Parameter(torch.zeros(num_heads))
        if use_alpha:
            self.alpha_bias = nn.Parameter(torch.zeros(num_heads))
        if use_decay:
            self.decay = DecayGate(num_heads, a_init=(0.0, 16.0))
        self.o_norm = GatedRMSNorm(self.head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(width, d_model, bias=False)

    def project_in(self, x):
        return self.in_proj(x)

    def project(self, h, conv_state, docs=None):
        B, T, _ = h.shape
        H, D = self.num_heads, self.head_dim
        qkv, gate, *pre = h.split(self.splits, dim=-1)
        pre = dict(zip(self.proj_gates, pre))
        qkv, conv_state = self.conv(qkv, conv_state, docs)
        q, k, v = qkv.view(B, T, 3, H, D).unbind(2)
        q = l2_normalize(q, eps=1e-6)
        k = l2_normalize(k, eps=1e-6)
        gates = {}
        if "beta" in pre:
            beta = torch.sigmoid(pre["beta"] + self.beta_bias)
            gates["beta"] = (beta + _BETA_EPS) ** 2 if self.beta_scaling == "squared" else beta
        if "alpha" in pre:
            gates["alpha"] = torch.sigmoid(pre["alpha"] + self.alpha_bias)
        if "g" in pre:
            gates["g"] = self.decay(pre["g"])                          # fp32 (at least)
        return [q, k, v, *(gates[n] for n in self.gates)], gate, conv_state

    def mix(self, inputs, initial_state, output_final_state, cu_seqlens, impl, **kwargs):
        # g <= 0 and β = sigmoid >= 0 by construction: no host sync for checking them; a gate left out is the op's
        # default (γ = 1, β = 1, α = 1)
        o, state = self.run_op(gated_kalmanet, *inputs[:3], **dict(zip(self.gates, inputs[3:])), ridge=self.ridge,
                               num_iters=self.num_iters, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens, impl=impl,
                               check_values=False)
        return o, None, state

    def readout(self, o, extra, gate, **kwargs):
        return gated_norm_out(o, gate, self.o_norm, self.o_proj), None

    def state_size(self) -> int:
        """Recurrent-state elements per sequence: H [H, D, D] and U [H, D, D] (conv buffers not counted)."""
        return 2 * self.num_heads * self.head_dim ** 2


MIXER_SPECS = (MixerSpec("gka", GatedKalmaNet, lambda layer: (layer.num_heads, layer.head_dim, layer.head_dim),
                         {"heads": "num_heads", "head_dim": "head_dim"},
                         cost_kwargs=lambda layer: {"num_iters": layer.num_iters or 0}, headline=True),)
