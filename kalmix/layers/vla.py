"""Variational linear attention layer (VLA paper §3 and Alg. 1)."""
from __future__ import annotations

import torch.nn as nn

from kalmix.layers.base import MixerLayer
from kalmix.layers.common import ShortConv, check_int, check_layer, check_real, head_size
from kalmix.ops import variational_linear_attention
from kalmix.ops.vla.op import WRITE_KEYS


class VariationalLinearAttention(MixerLayer):
    """q, k, v from one projection; penalty directions u = W_u k (a learned map of each head's raw key, shared by
    heads); the recursive-least-squares mixer of DESIGN §1.4; out projection. No gate or norm (the paper has none).

    The paper's backbone is silent on positions. By default q, k, v pass through the same causal short
    convolution (4, SiLU) every other kalmix layer has, which gives the layer the local token order that MQAR's
    key -> value binding needs (without it the 2-layer model stays at chance in our runs); ``conv_size=0``
    gives the paper's bare projections.

    ``lambda0`` defaults to 0.1 · head_dim: the paper's Alg. 1 scales u to norm 1/√head_dim with λ0 = 0.1, and
    since only the direction of A_t k̂_t matters that equals unit u with λ0 = 0.1 · head_dim.

    ``write_key`` picks the key S is written and erased along (the op's argument of that name); the normaliser
    sums φ(k) = elu(k) + 1 either way:

    - ``"raw"`` (default): k̂ = k/‖k‖, the paper's equations (7) and (10) and DESIGN §1.4.
    - ``"feature"``: k̂ = φ(k)/‖φ(k)‖, the paper's Alg. 1 (lines 8–9) and the authors' released code.

    The default is ``"raw"``: it is the recurrence the paper's equations and propositions state, and it leaves
    the keys' directions free, whereas φ(k) > 0 puts every feature key in the positive orthant, where any two keys
    have a positive inner product (none are orthogonal).

    Args:
        d_model: width; num_heads: H; head_dim: K = V; write_key: "raw" | "feature".
    """

    def __init__(self, d_model: int, num_heads: int = 4, head_dim: int | None = None, lambda0: float | None = None,
                 eps: float = 1e-4, conv_size: int = 4, write_key: str = "raw", layer_idx: int = 0,
                 impl: str | None = None):
        super().__init__()
        name = type(self).__name__
        check_layer(name, d_model, layer_idx, impl)
        if write_key not in WRITE_KEYS:
            raise ValueError(f"VariationalLinearAttention: write_key must be one of {WRITE_KEYS}, got {write_key!r}")
        if head_dim is None:
            head_dim = head_size(name, "d_model", d_model, num_heads)
        check_int(name, "num_heads", num_heads)
        check_int(name, "head_dim", head_dim)
        if lambda0 is not None:
            check_real(name, "lambda0", lambda0, note=" (or None: 0.1 · head_dim)")
        check_real(name, "eps", eps)
        check_int(name, "conv_size", conv_size, 0, " (0: no convolution)")
        self.write_key = write_key
        self.d_model, self.layer_idx, self.impl = d_model, layer_idx, impl
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.lambda0 = 0.1 * self.head_dim if lambda0 is None else lambda0
        self.eps = eps
        width = num_heads * self.head_dim
        self.qkv_proj = nn.Linear(d_model, 3 * width, bias=False)
        self.conv = ShortConv(3 * width, conv_size) if conv_size else None     # q, k, v channels in one conv
        self.u_proj = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.o_proj = nn.Linear(width, d_model, bias=False)

    def project(self, x, conv_state, doc_pos=None):
        B, T, _ = x.shape
        qkv = self.qkv_proj(x)
        if self.conv is not None:
            qkv, conv_state = self.conv(qkv, conv_state, doc_pos=doc_pos)
        q, k, v = qkv.view(B, T, 3, self.num_heads, self.head_dim).unbind(2)
        return [q, k, v, self.u_proj(k)], None, conv_state

    def mix(self, inputs, initial_state, output_final_state, cu_seqlens, impl, **kwargs):
        o, state = self.run_op(variational_linear_attention, *inputs, lambda0=self.lambda0, eps=self.eps,
                               write_key=self.write_key, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens, impl=impl,
                               check_values=False)
        return o, None, state

    def readout(self, o, extra, ctx, **kwargs):
        return self.o_proj(o.flatten(2)), None

    def state_size(self) -> int:
        """Recurrent-state elements per sequence: S [H, K, V], A [H, K, K], n [H, K] (conv buffers not counted)."""
        H, D = self.num_heads, self.head_dim
        return H * (2 * D * D + D)
