"""Pieces the layers share: causal short convolution with a decode cache, gated RMSNorm, Mamba-2 decay gate,
padding masks to packed sequences, the activation dtype under mixed precision."""
from __future__ import annotations

import contextlib
import math
import numbers
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from kalmix.ops.common.checks import IMPLS, triton_module

P_MIN = 1e-7        # the floor the released Kalman layer puts on p where its noise is linear in p


def fused_kernels():
    """``kalmix.layers.fused``, the layers' Triton kernels (run on CUDA), imported at first use: kalmix imports
    without triton, and a layer on CUDA without it raises an ImportError saying so."""
    return triton_module("kalmix.layers.fused")


_fused_everywhere = False


def runs_fused(x: torch.Tensor) -> bool:
    """Whether the fused Triton kernels of the work around the ops run for x (the short convolution, the norms,
    the LM loss's chunks): on CUDA, and on any device inside ``fused_kernels_everywhere()``."""
    return x.is_cuda or _fused_everywhere


@contextlib.contextmanager
def fused_kernels_everywhere():
    """The CUDA paths of ``runs_fused`` on every device while open: on CPU they run in Triton's interpreter
    (TRITON_INTERPRET=1 set before triton is imported), which is how the tests and ``kalmix bench lm --memory``
    see what a GPU runs and keeps."""
    global _fused_everywhere
    before, _fused_everywhere = _fused_everywhere, True
    try:
        yield
    finally:
        _fused_everywhere = before


def check_int(owner: str, name: str, value, minimum: int = 1, note: str = "") -> int:
    """``value`` as an int >= ``minimum``; a ValueError naming ``owner``, the argument and what it may be otherwise
    (bools and floats are refused, not rounded), ``note`` appended."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{owner}: `{name}` must be an int >= {minimum}{note}, got {value!r}")
    return int(value)


def check_real(owner: str, name: str, value, minimum: float = 0.0, inclusive: bool = False, note: str = "") -> float:
    """``value`` as a finite float > ``minimum`` (>= with ``inclusive``; ``minimum`` = -inf: any finite number);
    a ValueError naming ``owner``, the argument and what it may be otherwise, ``note`` appended."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or not (value >= minimum if inclusive else value > minimum)):
        bound = "" if minimum == -math.inf else f" {'>=' if inclusive else '>'} {minimum}"
        raise ValueError(f"{owner}: `{name}` must be a finite number{bound}{note}, got {value!r}")
    return float(value)


def head_size(owner: str, width_name: str, width: int, num_heads: int) -> int:
    """width / num_heads, the size of each head; a ValueError listing the head counts that divide ``width``
    when ``num_heads`` does not."""
    num_heads = check_int(owner, "num_heads", num_heads)
    if width % num_heads:
        allowed = "a divisor of it"
        if width <= 1 << 20:                    # list them where that is cheap (a few thousand steps at most)
            small = [h for h in range(1, math.isqrt(width) + 1) if width % h == 0]
            allowed = str(sorted(set(small + [width // h for h in small])))
        raise ValueError(f"{owner}: `num_heads` = {num_heads} must divide {width_name} = {width} into equal heads; "
                         f"allowed: {allowed}")
    return width // num_heads


def check_layer(owner: str, d_model, layer_idx, impl) -> None:
    """The arguments every layer takes: d_model >= 1, layer_idx >= 0, impl None or one of the ops' impls."""
    check_int(owner, "d_model", d_model)
    check_int(owner, "layer_idx", layer_idx, 0)
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"{owner}: `impl` must be None or one of {list(IMPLS)}, got {impl!r}")


def check_dt_range(owner: str, dt_min, dt_max) -> None:
    """The range Δ is initialised in: 0 < dt_min <= dt_max."""
    check_real(owner, "dt_min", dt_min)
    check_real(owner, "dt_max", dt_max, dt_min, inclusive=True)


def reads_on_host(x: torch.Tensor) -> bool:
    """Whether value checks of ``x`` are read back on the host (CPU tensors) rather than left to the device."""
    return x.device.type == "cpu"


def require(ok: torch.Tensor, message: str, detail: Callable[[], str] | None = None, assert_on_device: bool = True):
    """A value check that costs no host synchronisation off the CPU. ``ok``: a 0-d bool tensor.

    CPU tensors: ``ValueError(message + detail())`` unless ``ok`` holds (``detail`` runs only then, e.g. to name
    the offending values). Other devices (CUDA): a device-side assertion (``torch._assert_async``) when
    ``assert_on_device``, which queues a kernel and never waits for it: a failure surfaces as a device-side assert
    error at the next synchronisation (it stops the CUDA context; the same call on CPU names the problem);
    without ``assert_on_device``, nothing (for checks the model boundary makes once per forward)."""
    if reads_on_host(ok):
        if not bool(ok):
            raise ValueError(message + (detail() if detail is not None else ""))
    elif assert_on_device:
        torch._assert_async(ok, message)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> fp32; fp32 and fp64 stay as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class ShortConv(nn.Module):
    """Causal depthwise 1-D convolution over time (+ SiLU), with the last ``kernel - 1`` inputs as decode state.

    Input and output [B, T, C]; ``state`` [B, C, kernel - 1] holds the inputs that precede ``x``; ``docs`` marks
    documents packed in one row: their ``doc_pos`` [B, T] (int32 or int64), each token's position in its document
    (0 at the document's first token, then 1, 2, ...), and ``row_starts``, the most tokens of a row that start a
    document (doc_pos 0, or a row's first token), an int on the host (a ``Documents``, which holds both).

    While ``context_split`` is set (a sequence split across ranks, ``kalmix.distributed.context_parallel_model``)
    a call without a state takes the ``kernel - 1`` inputs before its piece from the previous ranks as its state
    (with ``docs``, positions within whole documents, only a document continuing from them sees them).
    """

    context_split = None        # a sequence split across ranks (kalmix.distributed.ContextSplit) or None

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False, activation: bool = True):
        super().__init__()
        check_int("ShortConv", "channels", channels)
        self.kernel_size = check_int("ShortConv", "kernel_size", kernel_size)
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        bound = 1.0 / math.sqrt(kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, docs=None):
        """Returns (y [B, T, C], new state [B, C, kernel - 1]). On CUDA a call without a state (training,
        a first prefill) runs kalmix's fused kernel (``layers/fused.py``) in the [B, T, C] layout.

        With ``docs`` (class docstring), y at token t uses x[t − s] only for s <= doc_pos[t]: every document is
        convolved as if it started a sequence from a zero state, so no ``state`` may be given. The new state is
        still the row's last kernel − 1 inputs, which continue only the row's last document."""
        keep = self.kernel_size - 1
        doc_pos, starts = (None, None) if docs is None else (docs.doc_pos, docs.row_starts)
        if state is None and keep and self.context_split is not None:   # the inputs before this rank's piece
            halo = self.context_split.halo(x, keep)
            if doc_pos is None:
                return self._conv(x, halo.transpose(1, 2), None)
            # the piece behind its halo, the halo's positions counted back from the piece's first token's: a
            # document starting in the piece or in the halo restarts there (the halo holds one start at most)
            before = doc_pos[:, :1] + torch.arange(-keep, 0, device=doc_pos.device, dtype=doc_pos.dtype)
            y, last = self._conv(torch.cat([halo, x], 1), None, torch.cat([before, doc_pos], 1), starts + 1)
            return y[:, keep:], last
        return self._conv(x, state, doc_pos, starts)

    def _conv(self, x: torch.Tensor, state: torch.Tensor | None, doc_pos: torch.Tensor | None,
              max_starts: int | None = None):
        B, T, C = x.shape
        keep = self.kernel_size - 1
        xt = x.transpose(1, 2)                                           # [B, C, T]
        if doc_pos is not None:
            if state is not None:
                raise ValueError("ShortConv: `docs` (their doc_pos) and `state` cannot be given together: documents "
                                 "packed in a row each start from a zero state, a decode state continues one "
                                 "sequence")
            if doc_pos.shape != (B, T) or doc_pos.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"ShortConv: `docs.doc_pos` must be an int32 or int64 [B, T] = {[B, T]} tensor, got "
                                 f"{doc_pos.dtype} of shape {list(doc_pos.shape)}")
        if state is None and (runs_fused(x) or doc_pos is not None):
            last = F.pad(xt[..., T - min(T, keep):], (keep - min(T, keep), 0))
            if runs_fused(x):
                return fused_kernels().short_conv(x, self.weight, self.bias, self.activation, doc_pos), last
            y = self._conv_documents(xt, doc_pos, max_starts)
            return (F.silu(y) if self.activation else y), last
        if state is None:
            state = xt.new_zeros(B, C, keep)
        full = torch.cat([state.to(xt.dtype), xt], dim=-1)              # [B, C, K - 1 + T]
        y = F.conv1d(full, self.weight[:, None, :], self.bias, groups=C)  # [B, C, T]
        y = y.transpose(1, 2)
        if self.activation:
            y = F.silu(y)
        return y, full[..., T:]                                         # the last K - 1 (none for K = 1)

    def _conv_documents(self, xt: torch.Tensor, doc_pos: torch.Tensor, max_starts: int) -> torch.Tensor:
        """The convolution before the activation, xt [B, C, T] -> [B, T, C], of the documents that start where
        doc_pos [B, T] is 0 (and at t = 0), at most ``max_starts`` in a row. Each document goes behind kernel − 1
        zeros of its own in a wider row, so one conv1d computes every document exactly as the zero-state path
        computes it alone (bit for bit with one document per row, in every dtype; a larger ``max_starts`` only adds
        unread columns)."""
        B, C, T = xt.shape
        keep = self.kernel_size - 1
        starts = doc_pos == 0
        starts[:, :1] = True
        at = torch.arange(T, device=xt.device) + keep * starts.cumsum(1)  # [B, T]: each token's wide column
        width = T + keep * max_starts
        wide = xt.new_zeros(B, C, width).scatter_(2, at[:, None].expand(B, C, T), xt)
        y = F.conv1d(wide, self.weight[:, None, :], self.bias, groups=C)  # column j: the window ending at j + keep
        return y.gather(2, (at - keep)[:, None].expand(B, C, T)).transpose(1, 2)


def gated_norm_out(o: torch.Tensor, gate: torch.Tensor, norm: nn.Module, o_proj: nn.Linear) -> torch.Tensor:
    """Per-head gated RMSNorm of o [B, T, H, V] with gate [B, T, H·V], then the output projection."""
    B, T, H, V = o.shape
    return o_proj(norm(o, gate.view(B, T, H, V)).reshape(B, T, H * V))


class _Recompute(torch.autograd.Function):
    """``fn(*tensors)`` saving only ``tensors``; the backward reruns fn under the forward's autocast state and
    differentiates that graph."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        device = tensors[0].device.type
        ctx.fn = fn
        ctx.autocast = device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        ctx.save_for_backward(*tensors)
        return fn(*tensors)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        device, enabled, dtype = ctx.autocast
        tensors = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            out = ctx.fn(*tensors)
        wanted = [t for t in tensors if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return None, *[next(grads) if t.requires_grad else None for t in tensors]


def recompute(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(*tensors)`` (one tensor out) whose backward keeps only ``tensors`` and reruns fn on them (under the
    forward's autocast state) to differentiate it: the same output and gradients, bit for bit, for the saved
    memory of the inputs rather than of fn's intermediates. fn must be deterministic and take every tensor it is
    differentiated by (parameters included) as an argument. Without gradients, plainly ``fn(*tensors)``.

    ``torch.utils.checkpoint`` recomputes the same way, but its non-reentrant form keeps the inputs outside
    autograd's saved tensors (``kalmix.bench.memory`` would not see them) and its reentrant form refuses
    ``torch.autograd.grad``."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return fn(*tensors)
    return _Recompute.apply(fn, *tensors)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dimension times a SiLU gate: ``norm(x) * weight * silu(z)`` (``norm(x) * weight``
    for z = None), computed in fp32 (at least). On CUDA one Triton kernel each way (``layers/fused.py``'s
    ``rms_norm``), keeping x, z and a rstd per row; elsewhere this torch chain, which keeps x and z, not their fp32
    intermediates (``recompute``), a z that is a view of a wider tensor (a split of an input projection) copied
    first so that it does not keep the wider tensor alive."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        if runs_fused(x):
            return fused_kernels().rms_norm(x, self.weight, z, self.eps)
        if z is None:
            return recompute(self._norm, x, self.weight)
        return recompute(self._norm, x, self.weight, z.contiguous())

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        xf = upcast(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * upcast(weight)
        return (y if z is None else y * F.silu(upcast(z))).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``F.normalize(x, dim=-1, eps=eps)`` for x [..., D]; on CUDA one Triton kernel each way (``layers/fused.py``),
    which keeps its output and the norms for the backward."""
    if runs_fused(x):
        return fused_kernels().l2_normalize(x, eps)
    return F.normalize(x, dim=-1, eps=eps)


class DecayGate(nn.Module):
    """Mamba-2 style data-dependent log decay g = −exp(A_log) · softplus(dt + dt_bias), one per head, from the
    pre-activation dt [B, T, H] that the owning layer's input projection computes.

    Init: A ~ U(a_init) (Mamba-2's (1, 16) by default; the released Gated DeltaNet, Kaczmarz and GKA layers draw
    from (0, 16)), Δ log-uniform in [dt_min, dt_max] (stored through the inverse softplus).
    """

    def __init__(self, num_heads: int, dt_min: float = 1e-3, dt_max: float = 0.1,
                 a_init: tuple[float, float] = (1.0, 16.0)):
        super().__init__()
        check_int("DecayGate", "num_heads", num_heads)
        check_dt_range("DecayGate", dt_min, dt_max)
        self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(*a_init).log())
        dt = torch.exp(torch.rand(num_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp_min(1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True

    def forward(self, dt: torch.Tensor) -> torch.Tensor:
        """dt [B, T, H] -> g [B, T, H] (at least fp32, <= 0)."""
        return -upcast(self.A_log).exp() * F.softplus(upcast(dt) + upcast(self.dt_bias))


def activation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a layer hands its op's activations in: autocast's inside an autocast region, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def describe(x) -> str:
    """A value for an error message: a tensor's shape, dtype and device, or anything else's type and repr."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)} on {x.device}"
    return f"{type(x).__name__} {x!r:.60}"


def is_integer(x: torch.Tensor) -> bool:
    """Whether x holds integers (not floating point, complex or bool)."""
    return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


def check_mask(name: str, attention_mask, x: torch.Tensor, past: int = 0) -> None:
    """The shape, dtype and device of a padding mask for the tokens of x [B, T, ...] after ``past`` cached ones: a
    bool, integer or floating tensor [B, past + T] (with a cache it covers the whole context, as ``generate`` passes
    it) on x's device. Its values: ``check_mask_values``."""
    B, T = x.shape[:2]
    want = [B, past + T]
    layout = f"[B, P + T] = {want} (P = {past} cached tokens, T = {T} new ones)" if past else f"[B, T] = {want}"
    if (not isinstance(attention_mask, torch.Tensor) or attention_mask.is_complex()
            or list(attention_mask.shape) != want):
        raise ValueError(f"{name}: `attention_mask` must be a padding mask {layout} (1 = token, 0 = padding), got "
                         f"{describe(attention_mask)}")
    if attention_mask.device != x.device:
        raise ValueError(f"{name}: `attention_mask` is on {attention_mask.device} but the input is on {x.device}; "
                         f"pass both on one device")


def check_mask_values(name: str, attention_mask: torch.Tensor, assert_on_device: bool) -> None:
    """A padding mask holds only 0 (padding) and 1 (token), checked as ``require`` says."""
    if attention_mask.numel():
        require(((attention_mask == 0) | (attention_mask == 1)).all(),
                f"{name}: `attention_mask` must hold only 0 (padding) and 1 (token)",
                lambda: f", got values {attention_mask.unique()[:8].tolist()}", assert_on_device)


def context_mask(name: str, attention_mask: torch.Tensor | None, x: torch.Tensor, past_key_values, layer_idx: int):
    """A layer's padding mask checked (``check_mask``; its 0/1 values on CPU only: the model checks them once per
    forward on every device) against x [B, T, d] and the tokens ``past_key_values`` holds for layer ``layer_idx``
    (none without a cache); returns its columns of this call's tokens [B, T], or None."""
    if attention_mask is None:
        return None
    past = past_key_values.get_seq_length(layer_idx) if past_key_values is not None else 0
    check_mask(name, attention_mask, x, past)
    check_mask_values(name, attention_mask, assert_on_device=False)
    return attention_mask[:, past:]


def keep_where(keep: torch.Tensor, new, old):
    """Per sequence, ``new`` where keep [B] is True and ``old`` elsewhere, for a state or tuple of states [B, ...]."""
    if isinstance(new, torch.Tensor):
        return torch.where(keep.view(-1, *[1] * (new.dim() - 1)), new, old.to(new.dtype))
    return type(new)(keep_where(keep, n, o) for n, o in zip(new, old))


def check_hidden(name: str, x, d_model: int) -> None:
    """A layer's input: a floating-point tensor [B, T, d_model] with B >= 1 (T = 0 is an empty call)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != d_model or not x.is_floating_point():
        raise ValueError(f"{name}: `hidden_states` must be [B, T, {d_model}] (floating point), got {describe(x)}")
    if x.shape[0] == 0:
        raise ValueError(f"{name}: `hidden_states` must hold at least one sequence (B >= 1), got {describe(x)}")


class Packer:
    """Turns a [B, T] padding mask into packed [1, total, ...] tensors with ``cu_seqlens`` and back."""

    def __init__(self, attention_mask: torch.Tensor):
        mask = attention_mask.bool()
        self.shape = mask.shape
        self.indices = mask.flatten().nonzero()[:, 0]
        lengths = mask.sum(1)
        self.cu_seqlens = F.pad(lengths.cumsum(0), (1, 0))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(0, 1)[self.indices][None]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(self.shape[0] * self.shape[1], *x.shape[2:])
        out[self.indices] = x[0]
        return out.view(*self.shape, *x.shape[2:])
