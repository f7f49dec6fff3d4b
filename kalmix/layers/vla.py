"""Variational linear attention layer (VLA paper §3 and Alg. 1; the options of its authors' released layer)."""
from __future__ import annotations

import torch.nn as nn

from kalmix.layers.base import MixerLayer
from kalmix.layers.common import ShortConv, check_int, check_layer, check_real, head_size
from kalmix.layers.spec import MixerSpec
from kalmix.ops import SPECS, variational_linear_attention
from kalmix.ops.vla.op import WRITE_KEYS

U_MAPS = ("full", "shared")


class VariationalLinearAttention(MixerLayer):
    """q, k, v from one projection; penalty directions u = W_u k from the raw keys; the recursive-least-squares
    mixer of DESIGN §1.4; optionally a LayerNorm; out projection. No gate.

    ``lambda0`` defaults to 0.1 · head_dim: the paper's Alg. 1 scales u to norm 1/√head_dim with λ0 = 0.1, and
    since only the direction of A_t k̂_t matters that equals unit u with λ0 = 0.1 · head_dim.

    Options; the defaults are the authors' released layer (the one whose runs printed the paper's MQAR numbers)
    wherever the paper is silent or contradicts itself, the short convolution excepted:

    - ``write_key``, the key S is written and erased along (the op's argument); the normaliser sums φ(k) = elu(k)
      + 1 either way. ``"feature"`` (default): k̂ = φ(k)/‖φ(k)‖, the paper's Alg. 1 (lines 8–9) and the released
      code. ``"raw"``: k̂ = k/‖k‖, the paper's equations (7) and (10); it leaves the keys' directions free, where
      φ(k) > 0 puts every feature key in the positive orthant (no two of them orthogonal).
    - ``out_norm``: True (default) puts a LayerNorm over the H·K outputs before the out projection, as the
      released layer does (the paper does not mention it); False reads o out directly.
    - ``u_map``: ``"full"`` (default): one [H·K, H·K] map of all heads' raw keys, split into heads (the released
      ``Wu``); ``"shared"``: one [K, K] map of each head's own key, shared by the heads. The paper's Alg. 1 is
      written for one head, where the two coincide.
    - ``bias``: biases on the q, k, v and out projections (the released layer has them, zero at init); off by
      default, as in the paper's k = W_k x.
    - ``conv_size``: 4 (default) passes q, k, v through the causal short convolution (SiLU) every other kalmix
      layer has; 0 gives the paper's and the released layer's bare projections. The released model gets token
      order from learned absolute position embeddings, which kalmix's recurrent models do not have; without the
      convolution the 2-layer MQAR model stays at chance in our runs.

    Not reproduced: the released layer adds 1e-3 · I to A every 20th token (the paper's "identity refresh"); the op
    keeps the exact A_t = (λ0 I + Σ û ûᵀ)^{-1} that its chunked form needs (DESIGN §1.4).

    Args:
        d_model: width; num_heads: H; head_dim: K = V (default d_model / H); lambda0, eps: of the op;
        conv_size, write_key ("feature" | "raw"), out_norm, u_map ("full" | "shared"), bias: above.
    """

    op_spec = SPECS["vla"]

    def __init__(self, d_model: int, num_heads: int = 4, head_dim: int | None = None, lambda0: float | None = None,
                 eps: float = 1e-4, conv_size: int = 4, write_key: str = "feature", out_norm: bool = True,
                 u_map: str = "full", bias: bool = False, layer_idx: int = 0, impl: str | None = None):
        super().__init__()
        name = type(self).__name__
        check_layer(name, d_model, layer_idx, impl)
        if write_key not in WRITE_KEYS:
            raise ValueError(f"VariationalLinearAttention: write_key must be one of {WRITE_KEYS}, got {write_key!r}")
        if u_map not in U_MAPS:
            raise ValueError(f"VariationalLinearAttention: u_map must be one of {U_MAPS}, got {u_map!r}")
        if head_dim is None:
            head_dim = head_size(name, "d_model", d_model, num_heads)
        check_int(name, "num_heads", num_heads)
        check_int(name, "head_dim", head_dim)
        if lambda0 is not None:
            check_real(name, "lambda0", lambda0, note=" (or None: 0.1 · head_dim)")
        check_real(name, "eps", eps)
        check_int(name, "conv_size", conv_size, 0, " (0: no convolution)")
        self.write_key, self.u_map = write_key, u_map
        self.d_model, self.layer_idx, self.impl = d_model, layer_idx, impl
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.lambda0 = 0.1 * self.head_dim if lambda0 is None else lambda0
        self.eps = eps
        width = num_heads * self.head_dim
        self.qkv_proj = nn.Linear(d_model, 3 * width, bias=bias)
        self.conv = ShortConv(3 * width, conv_size) if conv_size else None     # q, k, v channels in one conv
        u_width = width if u_map == "full" else self.head_dim
        self.u_proj = nn.Linear(u_width, u_width, bias=False)
        self.o_norm = nn.LayerNorm(width) if out_norm else None
        self.o_proj = nn.Linear(width, d_model, bias=bias)

    def project_in(self, x):
        return self.qkv_proj(x)

    def project(self, qkv, conv_state, docs=None):
        B, T, _ = qkv.shape
        if self.conv is not None:
            qkv, conv_state = self.conv(qkv, conv_state, docs)
        q, k, v = qkv.view(B, T, 3, self.num_heads, self.head_dim).unbind(2)
        kc = k.contiguous()         # what u_proj saves for the backward, rather than a view keeping all of qkv
        u = self.u_proj(kc.flatten(2)).view_as(k) if self.u_map == "full" else self.u_proj(kc)
        return [q, k, v, u], None, conv_state

    def mix(self, inputs, initial_state, output_final_state, cu_seqlens, impl, **kwargs):
        o, state = self.run_op(variational_linear_attention, *inputs, lambda0=self.lambda0, eps=self.eps,
                               write_key=self.write_key, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens, impl=impl,
                               check_values=False)
        return o, None, state

    def readout(self, o, extra, ctx, **kwargs):
        o = o.flatten(2)
        return self.o_proj(o if self.o_norm is None else self.o_norm(o)), None

    def state_size(self) -> int:
        """Recurrent-state elements per sequence: S [H, K, V], A [H, K, K], n [H, K] (conv buffers not counted)."""
        H, D = self.num_heads, self.head_dim
        return H * (2 * D * D + D)


MIXER_SPECS = (MixerSpec("vla", VariationalLinearAttention,
                         lambda layer: (layer.num_heads, layer.head_dim, layer.head_dim),
                         {"heads": "num_heads", "head_dim": "head_dim"}, headline=True),)
