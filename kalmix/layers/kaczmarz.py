"""Kaczmarz linear attention layer (the Gated DeltaNet template, Kaczmarz LA paper §3) and the Gated DeltaNet
baseline it is one normalisation away from."""
from __future__ import annotations

import torch
import torch.nn as nn

from kalmix.layers.base import MixerLayer
from kalmix.layers.common import (DecayGate, GatedRMSNorm, ShortConv, check_int, check_layer, check_real,
                                  gated_norm_out, head_size, l2_normalize)
from kalmix.layers.spec import MixerSpec
from kalmix.ops import SPECS, kaczmarz_attention


class KaczmarzAttention(MixerLayer):
    """One input projection (q, k, v, output gate, η and decay pre-activations) + short conv (4, SiLU) over q, k, v;
    q L2-normalised, k raw; η = sigmoid, Mamba-2 decay (A ~ U(0, 16), the released layer's init);
    S_t = γS + η/(‖k‖² + eps) · k (v − γSᵀk)ᵀ; o = Sᵀq / √K; per-head gated RMSNorm; out projection.
    The released MQAR configs use K = 0.75 · d_model / H and V = 2K (``head_k_dim``, ``expand_v=2``).

    Args:
        d_model: width; num_heads: H; head_k_dim: K; expand_v: V = expand_v · K; eps: of the Kaczmarz step.
    """

    normalize_keys = False
    op_spec = SPECS["kaczmarz"]

    def __init__(self, d_model: int, num_heads: int = 4, head_k_dim: int | None = None, expand_v: float = 1.0,
                 conv_size: int = 4, eps: float = 1e-6, norm_eps: float = 1e-5, layer_idx: int = 0,
                 impl: str | None = None):
        super().__init__()
        name = type(self).__name__
        check_layer(name, d_model, layer_idx, impl)
        if head_k_dim is None:
            head_k_dim = head_size(name, "d_model", d_model, num_heads)
        check_int(name, "num_heads", num_heads)
        check_int(name, "head_k_dim", head_k_dim)
        check_real(name, "expand_v", expand_v)
        if head_k_dim * expand_v != int(head_k_dim * expand_v) or head_k_dim * expand_v < 1:
            raise ValueError(f"{name}: `expand_v` = {expand_v} must make the value head size expand_v · head_k_dim "
                             f"= {expand_v} · {head_k_dim} a whole number >= 1")
        check_int(name, "conv_size", conv_size)
        check_real(name, "eps", eps, inclusive=True)
        check_real(name, "norm_eps", norm_eps)
        self.d_model, self.layer_idx, self.impl = d_model, layer_idx, impl
        self.num_heads = num_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = int(self.head_k_dim * expand_v)
        self.eps = 0.0 if self.normalize_keys else eps
        kw, vw = num_heads * self.head_k_dim, num_heads * self.head_v_dim
        self.splits = (2 * kw + vw, vw, num_heads, num_heads)                 # q|k|v, gate, η, decay
        self.in_proj = nn.Linear(d_model, sum(self.splits), bias=False)
        self.conv = ShortConv(2 * kw + vw, conv_size)                      # q, k, v channels in one conv
        self.eta_bias = nn.Parameter(torch.zeros(num_heads))
        self.decay = DecayGate(num_heads, a_init=(0.0, 16.0))
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(vw, d_model, bias=False)

    def project_in(self, x):
        return self.in_proj(x)

    def project(self, h, conv_state, docs=None):
        B, T, _ = h.shape
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        qkv, gate, eta, dt = h.split(self.splits, dim=-1)
        qkv, conv_state = self.conv(qkv, conv_state, docs)
        q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
        q = l2_normalize(q.view(B, T, H, K), eps=1e-6)
        k = k.view(B, T, H, K)
        if self.normalize_keys:
            k = l2_normalize(k, eps=1e-6)
        eta = torch.sigmoid(eta + self.eta_bias)
        g = self.decay(dt)                                             # fp32 (at least)
        return [q, k, v.view(B, T, H, V), g, eta], gate, conv_state

    def mix(self, inputs, initial_state, output_final_state, cu_seqlens, impl, **kwargs):
        # g <= 0 and η = sigmoid in [0, 1] by construction (η = 0, a sigmoid underflowing in bf16, writes
        # nothing): no host sync for checking them
        o, state = self.run_op(kaczmarz_attention, *inputs, eps=self.eps, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens, impl=impl,
                               check_values=False)
        return o, None, state

    def readout(self, o, extra, gate, **kwargs):
        return gated_norm_out(o, gate, self.o_norm, self.o_proj), None

    def state_size(self) -> int:
        """Recurrent-state elements per sequence: S [H, K, V] (conv buffers not counted)."""
        return self.num_heads * self.head_k_dim * self.head_v_dim


class GatedDeltaNet(KaczmarzAttention):
    """Gated DeltaNet baseline on kalmix's own CPU/GPU path: unit keys and eps = 0 turn the Kaczmarz step
    η/(‖k‖² + eps) into GDN's learned β = η exactly."""

    normalize_keys = True


def _heads(layer) -> tuple[int, int, int]:
    return layer.num_heads, layer.head_k_dim, layer.head_v_dim


_SIZES = {"heads": "num_heads", "head_dim": "head_k_dim"}
MIXER_SPECS = (MixerSpec("gdn", GatedDeltaNet, _heads, _SIZES, headline=True),
                MixerSpec("kaczmarz", KaczmarzAttention, _heads, _SIZES, headline=True))
