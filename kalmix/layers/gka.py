"""Gated KalmaNet layer (GKA paper §4.3, Fig. 2; the parameterisation of its released layer)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kalmix.layers.base import MixerLayer
from kalmix.layers.common import DecayGate, GatedRMSNorm, ShortConv, gated_norm_out, project_and_convolve
from kalmix.ops import gated_kalmanet


class GatedKalmaNet(MixerLayer):
    """q, k, v projections + short conv (4, SiLU); q, k L2-normalised; β = sigmoid, α = sigmoid, Mamba-2 decay;
    x_t = Chebyshev solve of (H_t + ridge·‖H_t‖_F I) x = q_t; o = U_tᵀ (q + α(x − q)) / √D;
    per-head gated RMSNorm; out projection.

    Args:
        d_model: width; num_heads: H; head_dim: D (K = V = D); ridge, num_iters: of the solve (DESIGN §1.2).
    """

    def __init__(self, d_model: int, num_heads: int = 4, head_dim: int | None = None, conv_size: int = 4,
                 ridge: float = 0.02, num_iters: int | None = 30, norm_eps: float = 1e-5, layer_idx: int = 0,
                 impl: str | None = None):
        super().__init__()
        self.d_model, self.layer_idx, self.impl = d_model, layer_idx, impl
        self.num_heads = num_heads
        self.head_dim = head_dim or d_model // num_heads
        self.ridge, self.num_iters = ridge, num_iters
        width = num_heads * self.head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, width, bias=False) for _ in range(3))
        self.q_conv, self.k_conv, self.v_conv = (ShortConv(width, conv_size) for _ in range(3))
        self.b_proj = nn.Linear(d_model, num_heads, bias=True)
        self.a_proj = nn.Linear(d_model, num_heads, bias=True)
        self.decay = DecayGate(d_model, num_heads)
        self.g_proj = nn.Linear(d_model, width, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(width, d_model, bias=False)

    def project(self, x, conv_state):
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        (q, k, v), conv_state = project_and_convolve(x, (self.q_proj, self.k_proj, self.v_proj),
                                                     (self.q_conv, self.k_conv, self.v_conv), conv_state)
        q = F.normalize(q.view(B, T, H, D), dim=-1, eps=1e-6)
        k = F.normalize(k.view(B, T, H, D), dim=-1, eps=1e-6)
        beta = torch.sigmoid(self.b_proj(x))
        alpha = torch.sigmoid(self.a_proj(x))
        g = self.decay(x)                                              # fp32 (at least)
        return [q, k, v.view(B, T, H, D), g, beta, alpha], self.g_proj(x), conv_state

    def mix(self, inputs, initial_state, output_final_state, cu_seqlens, impl, **kwargs):
        # g <= 0 and β = sigmoid >= 0 by construction: no host sync for checking them
        o, state = gated_kalmanet(*inputs, ridge=self.ridge, num_iters=self.num_iters, initial_state=initial_state,
                                  output_final_state=output_final_state, cu_seqlens=cu_seqlens, impl=impl,
                                  check_values=False)
        return o, None, state

    def readout(self, o, extra, gate, **kwargs):
        return gated_norm_out(o, gate, self.o_norm, self.o_proj), None

    def state_size(self) -> int:
        """Recurrent-state elements per sequence: H [H, D, D] and U [H, D, D] (conv buffers not counted)."""
        return 2 * self.num_heads * self.head_dim ** 2
