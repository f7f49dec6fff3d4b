"""Input validation and backend resolution shared by every op.

Every failure is a ``ValueError`` naming the op, the argument, what was expected and what was given.
"""
from __future__ import annotations

import math
import os
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


def check_ranges(op: str, ranges: Sequence[Range]) -> Callable[[], None]:
    """Check that every ``Range`` holds; returns ``finish()``, which raises with the offending min/max.

    One min/max pass per tensor and one read back to the host for all of them (``defer_check``). An op must call
    ``finish()`` before it returns its outputs."""
    ranges = [r for r in ranges if r.x.numel()]
    if not ranges:
        return no_check
    return defer_check(op, ranges, torch.stack([v for r in ranges for v in torch.aminmax(r.x.detach())]))


def defer_check(op: str, ranges: Sequence[Range], ext: torch.Tensor) -> Callable[[], None]:
    """``finish()`` for ``ranges`` from their extremes ``ext`` computed on the device by kernels already queued:
    flat (min, max) per range (NaN propagated), or [P, n, 3] rows of (min, max, NaN count) per range from each of
    P programs, folded on the host.

    On CPU it checks now. On CUDA the extremes are copied to pinned memory behind an event: the op enqueues its
    kernels and then calls ``finish()``, so the host waits for the check alone while the GPU still has the op's
    work queued (reading them back up front drained the queue and left the GPU idle while the host launched the
    op)."""
    if ext.is_cuda:
        host = torch.empty(ext.shape, dtype=ext.dtype, pin_memory=True)     # same dtype: no conversion kernel
        host.copy_(ext, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()

        def finish():
            ready.synchronize()
            _raise_outside(op, ranges, _fold(host, len(ranges)))
        return finish
    _raise_outside(op, ranges, _fold(ext, len(ranges)))
    return no_check


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
            fail(op, f"`{r.name}` must lie in {interval}, got values in [{mn:.4g}, {mx:.4g}]")


def check_cu_seqlens(op: str, cu_seqlens, batch: int, seq_len: int, device: torch.device) -> int:
    """Validate packed-sequence offsets; returns the number of sequences."""
    if cu_seqlens is None:
        return batch
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
        fail(op, f"`cu_seqlens` must be a 1-D integer tensor [N + 1], got {cu_seqlens!r:.80}")
    if batch != 1:
        fail(op, f"`cu_seqlens` requires packed inputs with batch size 1, got B = {batch}")
    if cu_seqlens.device != device:
        fail(op, f"`cu_seqlens` is on {cu_seqlens.device} but the inputs are on {device}")
    cs = cu_seqlens.tolist()
    if len(cs) < 2 or cs[0] != 0 or cs[-1] != seq_len or any(b < a for a, b in zip(cs, cs[1:])):
        fail(op, f"`cu_seqlens` must be non-decreasing, start at 0 and end at T = {seq_len}, got {cs}")
    return len(cs) - 1


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


def device_refusal(impl: str, device: torch.device) -> str | None:
    """Why ``impl`` cannot run on ``device`` (None when it can): off CUDA, "triton" needs the interpreter."""
    if device.type == "cuda":
        return None
    if impl == "triton" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got tensors on {device}"
    return None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 stays fp64; everything else is computed in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
