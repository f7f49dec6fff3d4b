"""`kalmix bench lm --profile`: where the time of each model's training step goes, from ``torch.profiler``.

For every model, T and packing of an ``LMBenchConfig`` (and mode, with ``--prefill``) the step of ``kalmix bench lm``
(``lm.make_step``: the same model, tokens, autocast and optimizer) runs ``warmup`` times, then ``steps`` times while
``torch.profiler`` records the GPU's kernels (on CUDA) or the CPU's ops (elsewhere). Each step is a
``kalmix.bench.step`` range; each module's forward is a range of its class and name (hooks held only while
recording); kalmix layers mark their op call (``kalmix.mixer_op``, ``MixerLayer.run_op``), and autograd Functions
and torch's optimizers name their own ranges.

Every kernel's time (on CPU every op's self time: its time less its children's, so that the parts add up to the
step) goes to the first category of ``RULES`` that matches, case-insensitively, either the *leaf* — the kernel's name
and the op that launched it (on CPU the op itself) — or the *scope* — the leaf and every op and range around its
launch; in the backward also those around the forward op that made its autograd node (matched by sequence number),
so that a norm's backward counts as normalisation and the mixer op's backward as the mixer op. A GEMM inside the
mixer op is the op's; one elsewhere (projections, MLP, the LM head, also inside a fused loss) is a GEMM.

Per row: the categories' milliseconds per step, the step's wall time, the host's time to issue it, the fraction of
the step the GPU is idle (host-bound; the recording's own overhead included) and the host synchronisations per
step; the top kernels; a Chrome trace.
"""
from __future__ import annotations

import contextlib
import gzip
import math
import os
import re
import shutil
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from kalmix.layers.base import MIXER_OP_RANGE

STEP_RANGE = "kalmix.bench.step"
REFERENCE = "fla_deltanet"                    # each category's difference is taken to this model's
TOP_KERNELS = 20
# (category, where its pattern is looked for: "leaf" or "scope", pattern); the first match wins, else "other"
RULES = (
    ("optimizer", "scope", r"^Optimizer\."),
    ("mixer_op", "scope", rf"^{re.escape(MIXER_OP_RANGE)}$|scaled_dot_product|flash|efficient_attention|varlen_attn"
                          r"|^(Chunk|FusedRecurrent)\w*Function"),          # kalmix's range, SDPA, fla's ops
    ("gemm", "leaf", r"gemm|cutlass|cublas|nvjet|xmma|wgmma|^aten::(mm|bmm|addmm|baddbmm|addbmm|matmul|linear"
                     r"|_addmm_activation)$"),
    ("norm", "scope", r"norm"),
    ("short_conv", "scope", r"conv"),
    ("loss", "scope", r"cross_?entropy|nll_loss"),
    ("other", "scope", r"^aten::embedding"),                                   # the token embedding's gather
    ("copy_cast", "leaf", r"copy|memcpy|^aten::(to|_to_copy|contiguous|clone|cat|stack)$"),
    ("elementwise", "leaf", r"^aten::|elementwise|_kernel|^triton_"),
)
CATEGORIES = ("mixer_op", "gemm", "norm", "elementwise", "short_conv", "loss", "optimizer", "copy_cast", "other")
_COMPILED = tuple((cat, where, re.compile(pattern, re.IGNORECASE)) for cat, where, pattern in RULES)
_BACKWARD = "autograd::engine::evaluate_function: "
_LAUNCHES = re.compile(r"^cu(da)?[A-Z]")               # the host's CUDA runtime and driver calls
_SYNCS = re.compile(r"^cuda(Stream|Device|Event)Synchronize$|^cudaMemcpy$")
_KERNEL_LAUNCHES = re.compile(r"^cu(da)?LaunchKernel")


def categorise(leaf: list[str], scope: list[str]) -> str:
    """The category of a kernel (or CPU op) from its ``leaf`` names and its ``scope`` names (``RULES``)."""
    for cat, where, pattern in _COMPILED:
        if any(pattern.search(name) for name in (leaf if where == "leaf" else scope)):
            return cat
    return "other"


@dataclass
class Breakdown:
    """One row's recorded steps, per step: ``categories`` {category: ms} (GPU kernel time; CPU: op self time),
    ``kernels`` {(kernel or op name, category): [calls, ms]}, ``step_ms`` (wall time), ``host_ms`` (the host's time
    inside the step ranges), ``busy_ms`` (the categories' sum), ``idle_fraction`` (of the wall time, no kernel
    running; NaN on CPU), ``syncs`` (host synchronisations; NaN on CPU) and ``launches`` (kernel launches the host
    made; NaN on CPU): a step whose GPU idles while the host launches thousands of kernels is host-bound."""
    categories: dict[str, float]
    kernels: dict[tuple[str, str], list[float]] = field(repr=False)
    step_ms: float
    host_ms: float
    busy_ms: float
    idle_fraction: float
    syncs: float
    launches: float


def _chain(e) -> list[str]:
    """The names of e and of the events around it, innermost first."""
    names = []
    while e is not None:
        names.append(e.name)
        e = e.cpu_parent
    return names


class _Scopes:
    """Each CPU event's scope (``_chain``), with the backward's events also in the scope of the forward op whose
    autograd node they run: the last forward event on the node's forward thread with its sequence number (for a
    node run inside another's backward, e.g. a recomputation's, the first enclosing node that has one)."""

    def __init__(self, cpu_events):
        self.forward = {}
        for e in sorted(cpu_events, key=lambda e: e.time_range.start):
            if e.sequence_nr >= 0 and not any(n.startswith(_BACKWARD) for n in _chain(e)):
                self.forward[(e.thread, e.sequence_nr)] = e
        self.cache = {}

    def __call__(self, e) -> list[str]:
        if e is None:
            return []
        if id(e) not in self.cache:
            names, node, fwd = _chain(e), e, None
            while node is not None and fwd is None:
                if node.name.startswith(_BACKWARD):
                    fwd = self.forward.get((node.fwd_thread or node.thread, node.sequence_nr))
                node = node.cpu_parent
            self.cache[id(e)] = names + (_chain(fwd) if fwd is not None else [])
        return self.cache[id(e)]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def breakdown(events, steps: int, device_type: str) -> Breakdown:
    """The ``Breakdown`` of a recording (``prof.events()``) of ``steps`` steps, each in a ``STEP_RANGE`` range:
    the kernels' times on "cuda", the CPU ops' self times otherwise. A kernel's op is the CPU op whose ``kernels``
    lists it (torch links the two by correlation id; kernels of one name and duration are alike here), else the op
    around its launch (the CUDA runtime or driver call with the kernel's id); a kernel with neither counts by its
    name alone."""
    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    step_ranges = [e for e in cpu if e.name == STEP_RANGE]
    if len(step_ranges) != steps:
        raise ValueError(f"breakdown: the recording holds {len(step_ranges)} {STEP_RANGE!r} ranges where {steps} "
                         f"steps were recorded")
    start = min(e.time_range.start for e in step_ranges)
    end = max(e.time_range.end for e in step_ranges)
    host_us = sum(e.time_range.elapsed_us() for e in step_ranges)
    scopes = _Scopes(cpu)
    timed = []                                           # (leaf names, scope names, name, µs)
    if device_type == "cuda":
        launches = {e.id: e for e in cpu if _LAUNCHES.match(e.name)}
        listed = defaultdict(list)                       # (kernel name, µs): the ops whose ``kernels`` list one
        for e in cpu:
            if not _LAUNCHES.match(e.name):
                for kernel in e.kernels:
                    listed[(kernel.name, kernel.duration)].append(e)
        kernels = [e for e in events if e.device_type != DeviceType.CPU
                   and not e.is_user_annotation]         # kernels, copies and sets (not the GPU's annotations)
        for k in kernels:
            ops, launch = listed.get((k.name, k.time_range.elapsed_us())), launches.get(k.id)
            op = ops.pop() if ops else launch.cpu_parent if launch is not None else None
            timed.append(([k.name] + ([op.name] if op is not None else []), [k.name] + scopes(op), k.name,
                          k.time_range.elapsed_us()))
        end = max([end] + [k.time_range.end for k in kernels])
        busy = _union_us([(max(k.time_range.start, start), min(k.time_range.end, end)) for k in kernels
                          if k.time_range.end > start and k.time_range.start < end])
        idle = 1 - busy / (end - start) if end > start else math.nan
        syncs, launches = (sum(1 for e in cpu if pattern.match(e.name) and any(
            r.time_range.start <= e.time_range.start < r.time_range.end for r in step_ranges)) / steps
            for pattern in (_SYNCS, _KERNEL_LAUNCHES))
    else:
        for e in cpu:
            if e.self_cpu_time_total > 0:
                timed.append(([e.name], scopes(e), e.name, e.self_cpu_time_total))
        idle = syncs = launches = math.nan
    categories = dict.fromkeys(CATEGORIES, 0.0)
    per_kernel: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for leaf, scope, name, us in timed:
        cat = categorise(leaf, scope)
        categories[cat] += us / steps / 1e3
        per_kernel[(name, cat)][0] += 1 / steps
        per_kernel[(name, cat)][1] += us / steps / 1e3
    return Breakdown(categories, dict(per_kernel), (end - start) / steps / 1e3, host_us / steps / 1e3,
                     sum(categories.values()), idle, syncs, launches)


@contextmanager
def module_ranges(model: torch.nn.Module):
    """While open, each module's forward in ``model`` is a profiler range "module: <class> <qualified name>"
    (forward hooks, removed on exit)."""
    opened = []
    handles = []
    for name, m in model.named_modules():
        label = f"module: {type(m).__name__} {name}".rstrip()
        handles.append(m.register_forward_pre_hook(
            lambda mod, args, label=label: opened.append(record_function(label).__enter__())))
        handles.append(m.register_forward_hook(lambda mod, args, out: opened.pop().__exit__(None, None, None),
                                               always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class Recording:
    """A ``torch.profiler`` recording of ``steps`` steps of ``model`` on ``device``, each run inside ``step()``
    (a ``STEP_RANGE`` range), with every module's forward a range (``module_ranges``). ``finish(trace)`` writes the
    Chrome trace (gzipped JSON) and returns the ``Breakdown``."""

    def __init__(self, model: torch.nn.Module, device: torch.device, steps: int):
        self.device, self.steps, self.done = device, steps, 0
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self._sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(module_ranges(model))
        self.prof = self._stack.enter_context(profile(activities=activities))

    @contextmanager
    def step(self):
        """One recorded step; an exception out of it (an interrupted run) ends the recording: the profiler stops
        and the module ranges' hooks come off the model."""
        try:
            with record_function(STEP_RANGE):
                yield
        except BaseException:
            self._stack.close()
            raise
        self.done += 1

    def finish(self, trace: str) -> Breakdown:
        self._sync()
        self._stack.close()
        plain = trace.removesuffix(".gz")
        self.prof.export_chrome_trace(plain)
        with open(plain, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(plain)
        return breakdown(self.prof.events(), self.done, self.device.type)


def record(model: torch.nn.Module, step, device: torch.device, warmup: int, steps: int, trace: str) -> Breakdown:
    """Run ``step`` ``warmup`` times, then record ``steps`` more; write the Chrome trace to ``trace`` (gzipped
    JSON) and return their ``Breakdown``."""
    for _ in range(warmup):
        step()
    recording = Recording(model, device, steps)
    for _ in range(steps):
        with recording.step():
            step()
    return recording.finish(trace)


def format_breakdown(b: Breakdown, device_type: str, title: str) -> str:
    """One recording's milliseconds per step by category, its wall, host and idle figures and host syncs, then its
    ``TOP_KERNELS`` kernels (``format_table`` and ``format_kernels`` for one row)."""
    what = "GPU kernel time" if device_type == "cuda" else "CPU op self time"
    lines = [f"{title}: ms per step by category ({what})"]
    lines += [f"  {_SHORT[c]:12s}{b.categories[c]:10.3f}" for c in CATEGORIES]
    lines += [f"  {'busy':12s}{b.busy_ms:10.3f}", f"  {'step':12s}{b.step_ms:10.3f}",
              f"  {'host':12s}{b.host_ms:10.3f}", f"  {'idle %':12s}{_fmt(100 * b.idle_fraction, 10)}",
              f"  {'syncs':12s}{_fmt(b.syncs, 10)}", f"  {'launches':12s}{_fmt(b.launches, 10)}", "",
              f"top {TOP_KERNELS} {'kernels by GPU time' if device_type == 'cuda' else 'ops by CPU self time'}:"]
    return "\n".join(lines + _top_kernels(b)) + "\n"


def run(cfg) -> int:
    """``kalmix bench lm --profile``: the ``Breakdown`` of every row of ``cfg`` (an ``LMBenchConfig``): writes
    ``profile.csv`` (one line per row and category), ``kernels.txt`` (each row's top kernels) and a Chrome trace
    per row under ``cfg.out``; prints the side-by-side table and the top kernels. Returns 0 (1 if a row failed)."""
    from kalmix.bench.lm import _free, make_step, matched_specs, packed_cu_seqlens
    from kalmix.bench.speed import versions, write_csv
    from kalmix.ops.common.checks import check_device
    device = check_device(cfg.device)
    shape = cfg.shape()
    models, _ = matched_specs(cfg)
    meta = versions()
    os.makedirs(cfg.out, exist_ok=True)
    modes = ["train", "prefill"] if cfg.prefill else ["train"]
    results: dict[tuple, Breakdown | str] = {}
    for name, T, packing, mode in ((m, T, p, mode) for m in models for T in cfg.seq_lens for p in cfg.packing
                                   for mode in modes):
        spec, B = models[name], cfg.tokens // T
        key = (name, T, packing, mode)
        if spec.source == "fla" and device.type != "cuda":
            results[key] = "unavailable: needs CUDA (fla's Triton kernels)"
            continue
        cu = packed_cu_seqlens(B, T, cfg.doc_median) if packing == "packed" else None
        try:                                             # (no name holds the model past its row)
            results[key] = record(*make_step(spec, shape, mode, B, T, cu, cfg, device), device, cfg.warmup,
                                  cfg.steps, os.path.join(cfg.out, f"trace_{name}_T{T}_{packing}_{mode}.json.gz"))
        except torch.OutOfMemoryError:
            results[key] = "oom"
        except Exception as err:  # noqa: BLE001 (reported in the output and the exit status; the run goes on)
            first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
            results[key] = f"error: {type(err).__name__}: {first}"
        _free(device)
    rows = []
    for (name, T, packing, mode), b in results.items():
        if isinstance(b, str):
            continue
        ref = results.get((REFERENCE, T, packing, mode))
        for cat, ms in b.categories.items():
            rows.append({"model": name, "layers": models[name].layers(shape), "mode": mode, "packing": packing,
                         "T": T, "B": cfg.tokens // T, "tokens": cfg.tokens, "steps": cfg.steps, "category": cat,
                         "ms_per_step": ms, "share": ms / b.busy_ms if b.busy_ms else math.nan,
                         "vs_fla_deltanet_ms": ms - ref.categories[cat] if isinstance(ref, Breakdown) else math.nan,
                         "busy_ms": b.busy_ms, "step_ms": b.step_ms, "host_ms": b.host_ms,
                         "idle_fraction": b.idle_fraction, "syncs_per_step": b.syncs, "impl": cfg.impl or "default",
                         "device": device.type, "device_name": meta["device_name"], "git": meta["git"],
                         "torch": meta["torch"], "triton": meta["triton"], "fla": meta["fla"]})
    if rows:
        write_csv(rows, os.path.join(cfg.out, "profile.csv"))
    kernels = format_kernels(results, device.type)
    with open(os.path.join(cfg.out, "kernels.txt"), "w") as f:
        f.write(kernels + "\n")
    print(format_table(results, cfg.tokens, device.type))
    print()
    print(kernels)
    return 1 if any(isinstance(b, str) and b.startswith("error") for b in results.values()) else 0


_SHORT = {"mixer_op": "mixer op", "gemm": "GEMM", "norm": "norm", "elementwise": "elemwise", "short_conv": "conv",
          "loss": "loss", "optimizer": "optim", "copy_cast": "copy/cast", "other": "other"}


def format_table(results: dict, tokens: int, device_type: str) -> str:
    """Per (T, packing, mode): one line per model of ms per step by category, the busy time, the step's wall and
    host time, the GPU's idle share and host syncs per step; under it ("- fla"), where fla's DeltaNet ran, the
    differences to its line."""
    what = "GPU kernel time" if device_type == "cuda" else "CPU op self time; a CPU run says nothing of a GPU's"
    lines = [f"ms per step by category ({what}): busy = their sum, step = wall time, host = the host's time "
             f"issuing the step, idle = share of the step with no kernel running"]
    head = (f"{'model':13s}" + "".join(f"{_SHORT[c]:>10s}" for c in CATEGORIES)
            + f"{'busy':>10s}{'step':>10s}{'host':>10s}{'idle %':>8s}{'syncs':>7s}")
    for T, packing, mode in dict.fromkeys((k[1], k[2], k[3]) for k in results):
        lines += ["", f"{mode}, {packing} rows, T = {T} (B = {tokens // T})", head, "-" * len(head)]
        ref = results.get((REFERENCE, T, packing, mode))
        for (name, T_, packing_, mode_), b in results.items():
            if (T_, packing_, mode_) != (T, packing, mode):
                continue
            if isinstance(b, str):
                lines.append(f"{name:13s} {b}")
                continue
            lines.append(f"{name:13s}" + "".join(f"{b.categories[c]:10.3f}" for c in CATEGORIES)
                         + f"{b.busy_ms:10.3f}{b.step_ms:10.3f}{b.host_ms:10.3f}"
                         + f"{_fmt(100 * b.idle_fraction, 8)}{_fmt(b.syncs, 7)}")
            if isinstance(ref, Breakdown) and name != REFERENCE:
                lines.append(f"{'  - fla':13s}"
                             + "".join(f"{b.categories[c] - ref.categories[c]:+10.3f}" for c in CATEGORIES)
                             + f"{b.busy_ms - ref.busy_ms:+10.3f}{b.step_ms - ref.step_ms:+10.3f}"
                             + f"{b.host_ms - ref.host_ms:+10.3f}")
    return "\n".join(lines)


def _fmt(x: float, width: int) -> str:
    return f"{x:{width}.1f}" if x == x else f"{'-':>{width}s}"


def format_kernels(results: dict, device_type: str) -> str:
    """Each row's ``TOP_KERNELS`` kernels (CPU: ops) by time: ms and calls per step, share of the busy time,
    category, name (cut at 100 characters)."""
    unit = "kernels by GPU time" if device_type == "cuda" else "ops by CPU self time"
    out = []
    for (name, T, packing, mode), b in results.items():
        if isinstance(b, str):
            continue
        out += ["", f"{name}, {mode}, {packing} rows, T = {T}: top {TOP_KERNELS} {unit} (busy {b.busy_ms:.3f} ms "
                    f"per step)", *_top_kernels(b)]
    return "\n".join(out).lstrip("\n")


def _top_kernels(b: Breakdown) -> list[str]:
    """A header and one line per kernel (op) of ``b``'s ``TOP_KERNELS``: ms and calls per step, share of the busy
    time, category, name (cut at 100 characters)."""
    top = sorted(b.kernels.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    return [f"{'ms/step':>9s} {'calls':>6s} {'share':>6s}  {'category':11s} name"] + [
        f"{ms:9.3f} {calls:6.1f} {100 * ms / b.busy_ms:5.1f}%  {cat:11s} {kernel[:100]}"
        for (kernel, cat), (calls, ms) in top]
