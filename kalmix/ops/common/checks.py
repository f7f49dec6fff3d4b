"""Input validation and backend resolution shared by every op.

Every failure is a ``ValueError`` naming the op, the argument, what was expected and what was given.
"""
from __future__ import annotations

import functools
import importlib
import math
import os
import re
from typing import Callable, Mapping, NamedTuple, Sequence

import torch

IMPLS = ("naive", "torch", "triton")


def fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def check_tensor(op: str, name: str, x, shape: Sequence, desc: str) -> None:
    """Check that ``x`` is a floating tensor of ``shape`` (entries may be None = any size).

    ``desc`` spells the expected layout for the message, e.g. ``"[B, T, H, N]"``.
    """
    if not isinstance(x, torch.Tensor):
        fail(op, f"`{name}` must be a tensor of shape {desc}, got {type(x).__name__}")
    if not x.is_floating_point():
        fail(op, f"`{name}` must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() != len(shape) or any(s is not None and s != xs for s, xs in zip(shape, x.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        fail(op, f"`{name}` must have shape {desc} = {want}, got {list(x.shape)}")
    if 0 in x.shape:
        fail(op, f"`{name}` must not be empty, got shape {list(x.shape)}")


def check_qkv(op: str, q, k, v, key: str = "K", value: str = "V") -> tuple[int, int, int, int, int]:
    """q, k [B, T, H, key] and v [B, T, H, value] (``check_tensor`` each) -> (B, T, H, key size, value size)."""
    check_tensor(op, "q", q, (None, None, None, None), f"[B, T, H, {key}]")
    B, T, H, K = q.shape
    check_tensor(op, "k", k, (B, T, H, K), f"[B, T, H, {key}] like q")
    check_tensor(op, "v", v, (B, T, H, None), f"[B, T, H, {value}]")
    return B, T, H, K, v.shape[-1]


def check_same(op: str, ref_name: str, ref: torch.Tensor, named: Mapping[str, torch.Tensor | None],
               dtype: bool = True) -> None:
    """All given tensors live on ``ref``'s device (and share its dtype when ``dtype``)."""
    for name, x in named.items():
        if x is None:
            continue
        if x.device != ref.device:
            fail(op, f"`{name}` is on {x.device} but `{ref_name}` is on {ref.device}; all inputs must share a device")
        if dtype and x.dtype != ref.dtype:
            fail(op, f"`{name}` has dtype {x.dtype} but `{ref_name}` has {ref.dtype}; activations must share a dtype")


def check_gates(op: str, ref: torch.Tensor, named: Mapping[str, torch.Tensor | None]) -> None:
    """Per-token gates share ``ref``'s device and its dtype, or are fp32 (kept exact beside bf16/fp16
    activations, as fla allows)."""
    check_same(op, "q", ref, named, dtype=False)
    for name, x in named.items():
        if x is not None and x.dtype not in (ref.dtype, torch.float32):
            fail(op, f"`{name}` has dtype {x.dtype}; gates must have q's dtype ({ref.dtype}) or float32")


class Range(NamedTuple):
    """``x`` must be NaN-free with every element in the interval from lo to hi (None = unbounded; open ends
    excluded)."""
    name: str
    x: torch.Tensor
    lo: float | None
    hi: float | None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""               # appended to the message, e.g. which impls take what this one refuses


def reset_range(g: torch.Tensor | None, triton: bool) -> Range:
    """The range of a log-decay g (<= 0). A reset g = -inf is allowed except on the chunked Triton kernels, whose
    in-chunk cumulative sums of g would form -inf - (-inf); there the message names the impls that take it."""
    if not triton:
        return Range("g", g, None, 0.0)
    return Range("g", g, float("-inf"), 0.0, lo_open=True,
                 note="impl='triton' takes no reset g = -inf; impl='torch' and 'naive' do")


def check_ranges(op: str, ranges: Sequence[Range],
                 finite: Mapping[str, torch.Tensor | None] | None = None) -> Callable[[], None]:
    """Check that every ``Range`` holds and every tensor of ``finite`` (name -> tensor or None) has no NaN or Inf;
    returns ``finish()``, which raises with the offending name (and min/max).

    One pass per tensor and one read back to the host for all of them (``defer_check``). An op must call
    ``finish()`` before it returns its outputs."""
    ranges = [r for r in ranges if r.x.numel()]
    if not ranges and not finite:
        return no_check
    ext = torch.stack([v for r in ranges for v in torch.aminmax(r.x.detach())]) if ranges else None
    return defer_check(op, ranges, ext, finite)


def defer_check(op: str, ranges: Sequence[Range], ext: torch.Tensor | None,
                finite: Mapping[str, torch.Tensor | None] | None = None) -> Callable[[], None]:
    """``finish()`` for ``ranges`` from their extremes ``ext`` computed on the device by kernels already queued:
    flat (min, max) per range (NaN propagated), or [P, n, 3] rows of (min, max, NaN count) per range from each of
    P programs, folded on the host; and for ``finite`` (name -> tensor or None: no NaN or Inf allowed), one
    ``isfinite().all()`` flag per tensor, read back together with ``ext`` (one synchronisation for both).

    On CPU it checks now. On CUDA the extremes are copied to pinned memory behind an event: the op enqueues its
    kernels and then calls ``finish()``, so the host waits for the check alone while the GPU still has the op's
    work queued (reading them back up front drained the queue and left the GPU idle while the host launched the
    op)."""
    named = [(name, x) for name, x in (finite or {}).items() if x is not None and x.numel()]
    flags = torch.stack([torch.isfinite(x.detach()).all() for _, x in named]) if named else None
    dev = [x for x in (ext, flags) if x is not None]
    if not dev:
        return no_check
    if dev[0].is_cuda:
        host = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in dev]  # same dtype: no conversion
        for h, x in zip(host, dev):
            h.copy_(x, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()

        def finish():
            ready.synchronize()
            _raise_checked(op, ranges, ext is not None and host[0], named, flags is not None and host[-1])
        return finish
    _raise_checked(op, ranges, ext, named, flags)
    return no_check


def _raise_checked(op: str, ranges: Sequence[Range], ext, named: Sequence, flags) -> None:
    """Raise for the first non-finite tensor of ``named`` (``flags``: isfinite().all() per tensor), then for the
    first range that does not hold (``ext``: ``defer_check``'s extremes)."""
    for (name, _), ok in zip(named, flags.tolist() if named else ()):
        if not ok:
            fail(op, f"`{name}` contains NaN or Inf; it must be finite")
    if ranges:
        _raise_outside(op, ranges, _fold(ext, len(ranges)))


def _fold(ext: torch.Tensor, n: int) -> list:
    """[min, max(, NaN count)] per range from either layout of ``defer_check``."""
    if ext.dim() == 3:                  # numpy on the host copy: torch's CPU ops took ~150 µs here (H100 host)
        a = ext.numpy()
        return [[a[:, i, 0].min(), a[:, i, 1].max(), a[:, i, 2].sum()] for i in range(n)]
    return ext.double().view(n, -1).tolist()


def no_check() -> None:
    """``finish()`` of a check with nothing left to do (or of values not checked)."""


def _raise_outside(op: str, ranges: Sequence[Range], ext: list) -> None:
    for r, (mn, mx, *n_nan) in zip(ranges, ext):
        if math.isnan(mn) or math.isnan(mx) or (n_nan and n_nan[0] > 0):
            fail(op, f"`{r.name}` contains NaN")
        if (r.lo is not None and (mn <= r.lo if r.lo_open else mn < r.lo)) or (
                r.hi is not None and (mx >= r.hi if r.hi_open else mx > r.hi)):
            interval = ("(" if r.lo_open else "[") + f"{'-inf' if r.lo is None else r.lo}, " + (
                f"{'inf' if r.hi is None else r.hi}" + (")" if r.hi_open or r.hi is None else "]"))
            fail(op, f"`{r.name}` must lie in {interval}, got values in [{mn:.4g}, {mx:.4g}]"
                     + (f" ({r.note})" if r.note else ""))


def check_head_sizes(op: str, limits: Mapping[str, tuple[int, str]], **sizes: int) -> None:
    """Refuse a head size (``name=size``) above ``limits[name]`` = (the largest that impl="triton"'s kernels hold,
    what holds it), naming the limit and the size."""
    for name, size in sizes.items():
        limit, why = limits[name]
        if size > limit:
            fail(op, f"impl='triton' takes {name} <= {limit} ({why}), got {name} = {size}; impl='torch' takes any "
                     f"{name}")


def resolve_impl(op: str, impl: str | None, device: torch.device, available: Mapping[str, Callable]) -> Callable:
    """Map ``impl`` (None = "triton" on CUDA, "torch" otherwise) to the function that runs it.

    Never falls back: an impl that cannot run raises, naming the alternatives.
    """
    if impl is None:
        impl = "triton" if device.type == "cuda" else "torch"
    if impl not in IMPLS:
        fail(op, f"unknown impl={impl!r}; expected one of {list(IMPLS)} or None")
    if impl not in available:
        others = [k for k in available if k != impl]
        raise NotImplementedError(
            f"{op}: impl={impl!r} is not available for this op in this version of kalmix "
            f"(it is the default for {device.type} tensors); pass impl= one of {others} explicitly")
    why = device_refusal(impl, device)
    if why is not None:
        fail(op, why)
    return available[impl]


DEVICES = "cpu, cuda or cuda:N"


def check_device(name: str) -> torch.device:
    """``name`` as a ``torch.device``: "cpu", "cuda" or "cuda:N" of a GPU this machine has. Otherwise a ValueError
    naming the value and what is allowed (a CUDA device where torch sees none says so)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not one of {DEVICES}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no CUDA GPU"
            raise ValueError(f"device {name!r}: {why} (torch {torch.__version__}); use cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {name!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def device_refusal(impl: str, device: torch.device) -> str | None:
    """Why ``impl`` cannot run on ``device`` (None when it can): "triton" needs the triton package (and a Triton
    interpreter that runs kalmix's kernels under TRITON_INTERPRET=1), and off CUDA the interpreter."""
    if impl != "triton":
        return None
    why = triton_refusal()
    if why is None and device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        why = f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got tensors on {device}"
    return why


INTERPRETER_MIN_TRITON = (3, 9)     # 3.6, 3.7 fail on kalmix's kernels; 3.8 loses fp64 accuracy in one


@functools.cache
def _triton_version() -> tuple[int, int] | None:
    """(major, minor) of the installed triton; None where it cannot be imported."""
    try:
        import triton
    except ImportError:
        return None
    return tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", triton.__version__).groups())


def triton_refusal() -> str | None:
    """Why kalmix's Triton kernels cannot run here (None when they can): triton is not installed, or
    TRITON_INTERPRET=1 asks for an interpreter older than ``INTERPRETER_MIN_TRITON``."""
    version = _triton_version()
    if version is None:
        return ("impl='triton' and kalmix's fused kernels need the `triton` package, which is not installed "
                "(pip install triton; Linux with a CUDA GPU); impl='torch' and impl='naive' run without it")
    if os.environ.get("TRITON_INTERPRET", "0") == "1" and version < INTERPRETER_MIN_TRITON:
        want = ".".join(map(str, INTERPRETER_MIN_TRITON))
        return (f"TRITON_INTERPRET=1: the interpreter of triton {'.'.join(map(str, version))} cannot run kalmix's "
                f"kernels (triton >= {want} can: pip install 'triton>={want}'); impl='torch' and impl='naive' run "
                "without it, and compiled kernels on a GPU run with any supported triton")
    return None


def triton_module(name: str):
    """The module ``name`` (kalmix's Triton kernels, or triton's own), imported now; ImportError saying why
    where ``triton_refusal`` refuses."""
    why = triton_refusal()
    if why is not None:
        raise ImportError(why)
    return importlib.import_module(name)


class TritonImpl:
    """An op's ``impl="triton"``: ``module.name``, imported at its first call, so that kalmix imports without
    triton (``resolve_impl`` refuses this impl where triton cannot run)."""

    def __init__(self, module: str, name: str):
        self.path, self.name, self.fn = module, name, None

    @property
    def module(self):
        """The module, imported now (e.g. for its ``max_head_sizes``)."""
        return triton_module(self.path)

    def __call__(self, *args, **kwargs):
        if self.fn is None:
            self.fn = getattr(self.module, self.name)
        return self.fn(*args, **kwargs)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 stays fp64; everything else is computed in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
