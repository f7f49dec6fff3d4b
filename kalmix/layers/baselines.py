"""The field's baselines beside kalmix's own mixers: linear attention, GLA and Mamba-2 on kalmix's pure-PyTorch
``gated_linear_attention`` op, the VLA notebook's DeltaNet on ``value_gated_delta_rule``, and fla's public DeltaNet
layer."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kalmix.layers.base import MixerLayer
from kalmix.layers.common import (DecayGate, GatedRMSNorm, ShortConv, check_dt_range, check_int, check_layer,
                                  check_real, context_mask, gated_norm_out, head_size, l2_normalize, upcast)
from kalmix.layers.documents import Documents
from kalmix.layers.spec import MixerSpec
from kalmix.ops import SPECS, gated_linear_attention, value_gated_delta_rule
from kalmix.ops.common.cost import DELTA

NORMALIZERS = ("denominator", "rmsnorm")


class _GatedLinearLayer(MixerLayer):
    """What the three baselines on ``gated_linear_attention`` share: the op call, the impl check, ``state_size``.
    ``project`` returns [q, k, v] or [q, k, v, g]; g [B, T, H] (per head) or, with ``channel_gates``, [B, T, H·K]
    (per key channel, kept 3-D so that the base class leaves it in fp32, like every kalmix gate)."""

    op_spec = SPECS["gla"]
    scale: float | None = None                  # the op's default, K ** -0.5
    channel_gates = False

    def __init__(self, d_model: int, num_heads: int, head_k_dim: int, head_v_dim: int, layer_idx: int,
                 impl: str | None):
        super().__init__()
        check_layer(type(self).__name__, d_model, layer_idx, None)
        if impl not in (None, "naive", "torch"):
            raise ValueError(f"{type(self).__name__} runs kalmix's pure-PyTorch gated_linear_attention op; impl must "
                             f"be None, 'torch' or 'naive' (there is no Triton kernel), got {impl!r}")
        self.d_model, self.layer_idx, self.impl = d_model, layer_idx, impl
        self.num_heads, self.head_k_dim, self.head_v_dim = num_heads, head_k_dim, head_v_dim

    def mix(self, inputs, initial_state, output_final_state, cu_seqlens, impl, **kwargs):
        if self.channel_gates:
            inputs = [*inputs[:3], inputs[3].unflatten(-1, (self.num_heads, self.head_k_dim))]
        o, state = self.run_op(gated_linear_attention, *inputs, scale=self.scale, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens, impl=impl,
                               check_values=False)
        return o, None, state

    def state_size(self) -> int:
        """Recurrent-state elements per sequence: S [H, K, V] (conv buffers not counted)."""
        return self.num_heads * self.head_k_dim * self.head_v_dim


class LinearAttention(_GatedLinearLayer):
    """Causal linear attention without decay (Katharopoulos et al.'s, with their feature map; the VLA paper's
    "standard linear attention" baseline): q, k, v projections; φ = elu + 1 on q and k; S_t = S_{t−1} + φ(k_t) v_tᵀ;
    out projection. ``normalizer`` sets how the readout is scaled:

    - ``"denominator"`` (default): o_t = S_tᵀφ(q_t) / max(φ(q_t)·Σ_{s≤t} φ(k_s), eps), no output norm: Katharopoulos
      et al.'s layer, the VLA paper's §2.2 and its authors' released baseline (eps = 1e-6 there). The running key
      sum rides in the state as one more value column (v gets a column of ones), so decoding, padding and packed
      documents carry it: the state is [H, K, V + 1].
    - ``"rmsnorm"``: o = Sᵀφ(q) / √K through a per-head RMSNorm, no denominator (fla's LinearAttention default).

    Args:
        d_model: width; num_heads: H (K = V = d_model / H); normalizer: "denominator" | "rmsnorm"; eps: of the
        denominator; norm_eps: of the RMSNorm; bias: biases on the q, k, v and out projections (the VLA release has
        them, zero at init).
    """

    def __init__(self, d_model: int, num_heads: int = 4, normalizer: str = "denominator", eps: float = 1e-6,
                 norm_eps: float = 1e-5, bias: bool = False, layer_idx: int = 0, impl: str | None = None):
        if normalizer not in NORMALIZERS:
            raise ValueError(f"LinearAttention: normalizer must be one of {NORMALIZERS}, got {normalizer!r}")
        check_int(type(self).__name__, "d_model", d_model)
        head = head_size(type(self).__name__, "d_model", d_model, num_heads)
        check_real(type(self).__name__, "eps", eps)
        check_real(type(self).__name__, "norm_eps", norm_eps)
        super().__init__(d_model, num_heads, head, head, layer_idx, impl)
        self.normalizer, self.eps = normalizer, eps
        width = num_heads * self.head_k_dim
        self.qkv_proj = nn.Linear(d_model, 3 * width, bias=bias)
        if normalizer == "denominator":
            self.scale = 1.0                            # the ratio is scale-free; 1 keeps eps on the raw sum
        else:
            self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(width, d_model, bias=bias)

    def project(self, x, conv_state, docs=None):
        q, k, v = self.qkv_proj(x).unflatten(-1, (3, self.num_heads, self.head_k_dim)).unbind(2)
        if self.normalizer == "denominator":
            v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)            # its readout: φ(q)·Σφ(k)
        return [F.elu(q) + 1, F.elu(k) + 1, v], None, conv_state

    def readout(self, o, extra, ctx, **kwargs):
        if self.normalizer == "denominator":
            o = (upcast(o[..., :-1]) / upcast(o[..., -1:]).clamp_min(self.eps)).to(o.dtype)
        else:
            o = self.o_norm(o)
        return self.o_proj(o.flatten(2)), None

    def state_size(self) -> int:
        """Recurrent-state elements per sequence: S [H, K, V] (and the key sum [H, K] with the denominator)."""
        return self.num_heads * self.head_k_dim * (self.head_v_dim + (self.normalizer == "denominator"))


class GatedLinearAttention(_GatedLinearLayer):
    """Gated linear attention (Yang et al. 2024, its GLA layer): q, k, v and output-gate projections; a low-rank
    gate α_t = exp(logsigmoid(W₂W₁x_t + b) / gate_normalizer) per key channel; S_t = diag(α_t) S_{t−1} + k_t v_tᵀ;
    o = Sᵀq / √K; per-head RMSNorm times swish(output gate); out projection.

    Args:
        d_model: width; num_heads: H; expand_k, expand_v: K = expand_k · d_model / H, V = expand_v · d_model / H
        (GLA's 0.5 and 1); gate_low_rank_dim: the rank of W₂W₁ (16); gate_normalizer: 16 (GLA's); norm_eps.
    """

    channel_gates = True

    def __init__(self, d_model: int, num_heads: int = 4, expand_k: float = 0.5, expand_v: float = 1.0,
                 gate_low_rank_dim: int = 16, gate_normalizer: float = 16.0, norm_eps: float = 1e-5,
                 layer_idx: int = 0, impl: str | None = None):
        name = type(self).__name__
        check_int(name, "d_model", d_model)
        widths = {}
        for arg, expand in (("expand_k", expand_k), ("expand_v", expand_v)):
            check_real(name, arg, expand)
            if d_model * expand != int(d_model * expand) or d_model * expand < 1:
                raise ValueError(f"{name}: `{arg}` = {expand} must make {arg} · d_model = {expand} · {d_model} a "
                                 f"whole number >= 1")
            widths[arg] = head_size(name, f"{arg} · d_model", int(d_model * expand), num_heads)
        check_int(name, "gate_low_rank_dim", gate_low_rank_dim)
        check_real(name, "gate_normalizer", gate_normalizer)
        check_real(name, "norm_eps", norm_eps)
        super().__init__(d_model, num_heads, widths["expand_k"], widths["expand_v"], layer_idx, impl)
        self.gate_normalizer = gate_normalizer
        kw, vw = num_heads * self.head_k_dim, num_heads * self.head_v_dim
        self.splits = (kw, kw, vw, vw)                                  # q, k, v, output gate
        self.in_proj = nn.Linear(d_model, sum(self.splits), bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(d_model, gate_low_rank_dim, bias=False),
                                     nn.Linear(gate_low_rank_dim, kw))
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(vw, d_model, bias=False)

    def project(self, x, conv_state, docs=None):
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        q, k, v, gate = self.in_proj(x).split(self.splits, dim=-1)
        g = F.logsigmoid(upcast(self.gk_proj(x))) / self.gate_normalizer         # [B, T, H·K], fp32 (at least)
        return [q.unflatten(-1, (H, K)), k.unflatten(-1, (H, K)), v.unflatten(-1, (H, V)), g], gate, conv_state

    def readout(self, o, extra, gate, **kwargs):
        return gated_norm_out(o, gate, self.o_norm, self.o_proj), None


class Mamba2(_GatedLinearLayer):
    """Mamba-2's mixer (SSD, n_groups = 1) on ``gated_linear_attention``: one input projection to z, x, B, C and
    Δ; short conv (SiLU, with bias) over [x, B, C]; Δ = softplus(dt + dt_bias), a_t = exp(−exp(A_log) · Δ_t) per
    head; S_t = a_t S_{t−1} + (Δ_t B_t) x_tᵀ ([d_state, head_dim] per head, B and C shared by the heads);
    y_t = S_tᵀ C_t + D ⊙ x_t; RMSNorm(y ⊙ silu(z)) over d_inner (Mamba-2 gates before the norm); out projection.
    Init as Mamba-2's: A ~ U(1, 16), Δ log-uniform in [dt_min, dt_max], D = 1.

    Args:
        d_model: width; expand: d_inner = expand · d_model; head_dim: P (H = d_inner / P); num_heads: H, when
        given, instead of head_dim (P = d_inner / H); d_state: N; conv_size: short-convolution width; dt_min,
        dt_max: Δ's init range; norm_eps.
    """

    scale = 1.0

    def __init__(self, d_model: int, expand: int = 2, head_dim: int = 64, num_heads: int | None = None,
                 d_state: int = 64, conv_size: int = 4, dt_min: float = 1e-3, dt_max: float = 0.1,
                 norm_eps: float = 1e-5, layer_idx: int = 0, impl: str | None = None):
        name = type(self).__name__
        d_inner = check_int(name, "expand", expand) * check_int(name, "d_model", d_model)
        if num_heads is not None:
            head_dim = head_size(name, "d_inner = expand · d_model", d_inner, num_heads)
        elif d_inner % check_int(name, "head_dim", head_dim):
            raise ValueError(f"{name}: `head_dim` = {head_dim} must divide d_inner = expand · d_model = {d_inner}; "
                             f"allowed: {[p for p in range(1, d_inner + 1) if d_inner % p == 0]}")
        check_int(name, "d_state", d_state)
        check_int(name, "conv_size", conv_size)
        check_dt_range(name, dt_min, dt_max)
        check_real(name, "norm_eps", norm_eps)
        super().__init__(d_model, d_inner // head_dim, d_state, head_dim, layer_idx, impl)
        self.d_inner = d_inner
        self.splits = (d_inner, d_inner + 2 * d_state, self.num_heads)          # z, x|B|C, dt
        self.in_proj = nn.Linear(d_model, sum(self.splits), bias=False)
        self.conv = ShortConv(d_inner + 2 * d_state, conv_size, bias=True)
        self.decay = DecayGate(self.num_heads, dt_min, dt_max)                  # A_log, dt_bias and their init
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.D._no_weight_decay = True
        self.norm = GatedRMSNorm(d_inner, eps=norm_eps)
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def project(self, x, conv_state, docs=None):
        B, T, _ = x.shape
        H, N, P = self.num_heads, self.head_k_dim, self.head_v_dim
        z, xbc, dt = self.in_proj(x).split(self.splits, dim=-1)
        xbc, conv_state = self.conv(xbc, conv_state, docs)
        xs, b, c = xbc.split([self.d_inner, N, N], dim=-1)
        delta = F.softplus(upcast(dt) + upcast(self.decay.dt_bias))            # Δ [B, T, H], fp32 (at least)
        g = -upcast(self.decay.A_log).exp() * delta
        xs = xs.unflatten(-1, (H, P))
        return [c[:, :, None].expand(B, T, H, N), delta[..., None] * b[:, :, None], xs, g], (z, xs), conv_state

    def readout(self, o, extra, ctx, **kwargs):
        z, xs = ctx
        y = (o + self.D[:, None] * xs).flatten(2)
        return self.out_proj(self.norm(upcast(y) * F.silu(upcast(z))).to(o.dtype)), None


class NotebookDeltaNet(MixerLayer):
    """The DeltaNet of the VLA authors' released notebook (``07-vlav3-benchmark-fixed.ipynb``, ``DeltaNetAttn``), the
    baseline behind the VLA paper's MQAR numbers; not fla's DeltaNet (``deltanet``). q, k, v and gate projections
    (with biases); per head q = elu(q) + 1, k = k/max(‖k‖, 1e-12), a gate γ = sigmoid(W_g x) per value channel;
    the value-gated delta rule with a unit step, S_t = S_{t−1} diag(γ_t) + k_t (v_t − S_{t−1}ᵀ k_t)ᵀ (the error on
    the undecayed state, ``value_gated_delta_rule``); o_t = S_tᵀ q_t (no scale, norm or denominator); out
    projection. No short convolution: the notebook's model adds learned absolute positions to the tokens
    (``KalmixConfig(position="learned")``).

    Args:
        d_model: width; num_heads: H (K = V = d_model / H); bias: biases on the four projections and the output
        (the notebook's, zero at init).
    """

    op_spec = SPECS["value_delta"]

    def __init__(self, d_model: int, num_heads: int = 4, bias: bool = True, layer_idx: int = 0,
                 impl: str | None = None):
        super().__init__()
        name = type(self).__name__
        check_layer(name, d_model, layer_idx, None)
        if impl not in (None, "naive", "torch"):
            raise ValueError(f"{name} runs kalmix's pure-PyTorch value_gated_delta_rule op; impl must be None, "
                             f"'torch' or 'naive' (there is no Triton kernel), got {impl!r}")
        if not isinstance(bias, bool):
            raise ValueError(f"{name}: `bias` must be True or False, got {bias!r}")
        self.head_dim = head_size(name, "d_model", d_model, num_heads)
        self.d_model, self.num_heads, self.layer_idx, self.impl = d_model, num_heads, layer_idx, impl
        self.qkvg_proj = nn.Linear(d_model, 4 * d_model, bias=bias)            # q, k, v and the gate
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)

    def project(self, x, conv_state, docs=None):
        q, k, v, g = self.qkvg_proj(x).unflatten(-1, (4, self.num_heads, self.head_dim)).unbind(2)
        g = F.logsigmoid(upcast(g)).flatten(2)      # [B, T, H·V], 3-D so that the base class keeps it in fp32
        return [F.elu(q) + 1, l2_normalize(k), v, g], None, conv_state

    def mix(self, inputs, initial_state, output_final_state, cu_seqlens, impl, **kwargs):
        q, k, v, g = inputs
        o, state = self.run_op(value_gated_delta_rule, q, k, v, g.unflatten(-1, v.shape[-2:]), scale=1.0,
                               initial_state=initial_state, output_final_state=output_final_state,
                               cu_seqlens=cu_seqlens, impl=impl, check_values=False)
        return o, None, state

    def readout(self, o, extra, ctx, **kwargs):
        return self.o_proj(o.flatten(2)), None

    def state_size(self) -> int:
        """Recurrent-state elements per sequence: S [H, K, V]."""
        return self.num_heads * self.head_dim ** 2


class FlaDeltaNet(nn.Module):
    """fla's ``DeltaNet`` layer (ungated delta rule, short convolutions, L2-normalised q and k, output RMSNorm),
    with kalmix's layer signature; its cache entries live in the model's ``KalmixCache``.

    CUDA only: fla's Triton ops do not run on CPU, nor in Triton's interpreter. fla trains it on Hopper with
    triton 3.6 (its ungated chunk backward is not among the ones it refuses there). fla's gated layers (GLA,
    Gated DeltaNet, Mamba-2) are not offered: fla refuses their backward on Hopper with triton < 3.7.1; kalmix's
    ``gdn`` mixer is Gated DeltaNet on kalmix's own kernels, ``gla`` and ``mamba2`` run on its PyTorch op.

    Args:
        d_model: width; num_heads: H (K = V = d_model / H); conv_size: short-convolution width; use_gate: fla's
        output gate.
    """

    def __init__(self, d_model: int, num_heads: int = 4, conv_size: int = 4, use_gate: bool = False,
                 layer_idx: int = 0, impl: str | None = None):
        super().__init__()
        check_layer("FlaDeltaNet", d_model, layer_idx, None)
        head_size("FlaDeltaNet", "d_model", d_model, num_heads)
        check_int("FlaDeltaNet", "conv_size", conv_size)
        if not isinstance(use_gate, bool):
            raise ValueError(f"FlaDeltaNet: `use_gate` must be True or False, got {use_gate!r}")
        if impl not in (None, "triton"):
            raise ValueError(f"FlaDeltaNet runs fla's Triton kernels; impl must be None or 'triton', got {impl!r}")
        from fla.layers import DeltaNet                 # after the checks: a config is checked without fla installed
        self.d_model, self.num_heads, self.layer_idx = d_model, num_heads, layer_idx
        self.inner = DeltaNet(hidden_size=d_model, num_heads=num_heads, conv_size=conv_size, use_gate=use_gate,
                              layer_idx=layer_idx)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, **kwargs):
        if not hidden_states.is_cuda:
            raise ValueError(f"FlaDeltaNet runs fla's Triton kernels, which need CUDA tensors; got "
                             f"{hidden_states.device}. On CPU use kalmix's mixers (e.g. 'gdn', 'kaczmarz')")
        context_mask(type(self).__name__, attention_mask, hidden_states, past_key_values, self.layer_idx)
        docs = Documents.of_layer_call(type(self).__name__, kwargs, hidden_states, attention_mask, past_key_values,
                                       use_cache)
        if docs is not None:                            # fla's packed layout: [1, total] with cu_seqlens
            o, _, _ = self.inner(docs.pack(hidden_states), cu_seqlens=docs.cu_seqlens.long())
            return docs.unpack(o), None, None
        return self.inner(hidden_states, attention_mask=attention_mask, past_key_values=past_key_values,
                          use_cache=use_cache)

    def state_size(self) -> int:
        """Recurrent-state elements per sequence: S [H, K, V] (conv buffers not counted)."""
        return self.d_model ** 2 // self.num_heads


def _heads(layer) -> tuple[int, int, int]:
    return layer.num_heads, layer.head_k_dim, layer.head_v_dim


def _notebook_heads(layer: NotebookDeltaNet) -> tuple[int, int, int]:
    return layer.num_heads, layer.head_dim, layer.head_dim


def _fla_heads(layer: FlaDeltaNet) -> tuple[int, int, int]:
    head = layer.d_model // layer.num_heads
    return layer.num_heads, head, head


MIXER_SPECS = (MixerSpec("linear_attention", LinearAttention, _heads, {"heads": "num_heads"}),
               MixerSpec("gla", GatedLinearAttention, _heads, {"heads": "num_heads"}),
               MixerSpec("mamba2", Mamba2, _heads, {"heads": "num_heads"}),
               MixerSpec("notebook_deltanet", NotebookDeltaNet, _notebook_heads, {"heads": "num_heads"}),
               MixerSpec("deltanet", FlaDeltaNet, _fla_heads, {"heads": "num_heads"}, cost=DELTA, requires="fla"))
