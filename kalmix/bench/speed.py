"""`kalmix speed`: time every kalmix op and layer next to the field's anchors, with the bytes/FLOPs floors.

Rows are long-format: one per (thing timed, mode, dtype, T). Each row carries the median and p20/p80 time
(``triton.testing.do_bench`` on CUDA; a plain timer loop on CPU), the peak memory of one call, achieved GB/s
and TFLOP/s under the cost models of ``kalmix.ops.common.cost`` (each op's from its spec), and their fraction of
the machine ceilings measured in the same run (copy bandwidth, bf16 matmul rate, and for Kalman's elementwise
filter the fp32 FMA rate of the CUDA cores).
"""
from __future__ import annotations

import csv
import inspect
import math
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator

from kalmix import ops
from kalmix.bench.checks import check_builds, check_out
from kalmix.layers import MIXER_SPECS, MIXERS
from kalmix.ops.common.checks import check_device, triton_module
from kalmix.ops.common.cost import DELTA, GATED_DELTA, GLA, SDPA, SIMPLE_GLA, Cost, Shape
from kalmix.ops.common.spec import OpSpec, matrix_heads

MODES = ("fwd", "fwdbwd", "decode")
GKA_ITERS = inspect.signature(ops.gated_kalmanet).parameters["num_iters"].default    # the op's default (30)


@dataclass
class Target:
    """One thing to time. ``build(shape, dtype, device) -> (fn, leaves)``: fn() returns the output to
    backpropagate; leaves are the tensors whose gradients are reset between repetitions."""
    name: str
    impl: str
    kind: str                    # "op", "anchor" or "layer"
    cost: Cost | None            # the bytes/FLOPs model (ops and anchors)
    heads: tuple[int, int, int]  # (H, K, V) it is timed at
    build: Callable
    op_kwargs: dict = field(default_factory=dict)    # keywords the op is called with (GKA's num_iters)


def _rand(shape, dtype, device):
    return torch.randn(shape, device=device).to(dtype)


def _unit(shape, dtype, device):
    return F.normalize(torch.randn(shape, device=device), dim=-1).to(dtype)


def _leaves(*xs):
    return [x.requires_grad_() for x in xs]


def _op(spec: OpSpec, impl: str, check_values: bool, op_kwargs: dict):
    """Inputs drawn like the tests' (the spec's ``inputs``), cast to the timed dtype (time-invariant parameters,
    Kalman's decay and process noise, stay fp32); the op is called with ``op_kwargs``. Ops with a value check run
    it only with ``check_values`` (its read-back is one host synchronisation per call, which fla's ops do not
    make; the layers skip it)."""
    def build(s: Shape, dt, dev):
        xs = spec.inputs(s.B, s.T, s.H, s.K, s.V, torch.float32, torch.Generator().manual_seed(0))
        n_acts = len(xs) - spec.n_params
        xs = [x.to(dev, dt) for x in xs[:n_acts]] + [x.to(dev) for x in xs[n_acts:]]
        leaves = _leaves(*xs)
        fn = spec.fn
        kw = {"check_values": check_values} if "check_values" in inspect.signature(fn).parameters else {}
        return (lambda: fn(*leaves, impl=impl, **kw, **op_kwargs)[0]), leaves
    return build


def _fla_anchor(fn_name):
    def build(s: Shape, dt, dev):
        import fla.ops as fla_ops
        fn = getattr(fla_ops, fn_name)
        q, k = _unit((s.B, s.T, s.H, s.K), dt, dev), _unit((s.B, s.T, s.H, s.K), dt, dev)
        v = _rand((s.B, s.T, s.H, s.V), dt, dev)
        g = F.logsigmoid(torch.randn(s.B, s.T, s.H, device=dev) + 3).to(dt)
        beta = torch.rand(s.B, s.T, s.H, device=dev).to(dt)
        if fn_name == "chunk_delta_rule":
            leaves = _leaves(q, k, v, beta)
        elif fn_name == "chunk_gated_delta_rule":
            leaves = _leaves(q, k, v, g, beta)
        elif fn_name == "chunk_simple_gla":
            leaves = _leaves(q, k, v, g)
        else:
            leaves = _leaves(q, k, v, F.logsigmoid(torch.randn(s.B, s.T, s.H, s.K, device=dev) + 3).to(dt))
        return (lambda: fn(*leaves)[0]), leaves
    return build


def _sdpa(s: Shape, dt, dev):
    q, k, v = (_rand((s.B, s.H, s.T, s.K), dt, dev) for _ in range(3))
    leaves = _leaves(q, k, v)

    def fn():
        if dev.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(*leaves, is_causal=True)
        return F.scaled_dot_product_attention(*leaves, is_causal=True)
    return fn, leaves


def layer_kwargs(name: str, heads: int, head_dim: int, d_state: int) -> dict:
    """Constructor arguments of a timed layer: the sizes its mixer takes (``MixerSpec.size_kwargs``): matrix-state
    mixers ``heads`` × ``head_dim``; Kalman ``d_state`` slots in its paper's layer (expand 2, H = 1)."""
    return MIXER_SPECS[name].size_kwargs(heads=heads, head_dim=head_dim, d_state=d_state)


def layer_impls(name: str, device: torch.device) -> list[str]:
    """The impls a layer is timed with on ``device``: those of its op but the token loop ("-": no kalmix op,
    softmax attention)."""
    op = MIXER_SPECS[name].op
    return ["-"] if op is None else [i for i in op.runnable_impls(device) if i != "naive"]


def _selected(name: str, ops_filter) -> bool:
    return not ops_filter or any(f in name for f in ops_filter)


def _layer(name, impl, d_model, heads, head_dim, d_state):
    def build(s: Shape, dt, dev):
        if name == "fla_gdn":
            from fla.layers import GatedDeltaNet as FlaGDN
            layer = FlaGDN(hidden_size=d_model, num_heads=heads, head_dim=head_dim, expand_v=1, layer_idx=0)
        else:
            layer = MIXERS[name](d_model, impl=impl, **layer_kwargs(name, heads, head_dim, d_state))
        layer = layer.to(dev, dt)
        x = _rand((s.B, s.T, d_model), dt, dev).requires_grad_()
        return (lambda: layer(x)[0]), [x, *layer.parameters()]
    return build


def targets(ops_filter, impls_filter, d_model, heads, head_dim, d_state, device, check_values: bool = False,
            gka_iters: tuple = (GKA_ITERS,)) -> list[Target]:
    """Everything ``kalmix speed`` can time on this device (fla's kernels only on CUDA); ``check_values``: the
    ops run their value checks; ``gka_iters``: gated_kalmanet's Chebyshev steps, one row each (named
    ``gated_kalmanet[num_iters=N]`` but for the op's default)."""
    out = []
    sizes = (heads, head_dim, d_model, d_state)
    matrix = matrix_heads(*sizes)
    sweeps = {"num_iters": gka_iters}         # the values of each keyword an op's spec sweeps (OpSpec.sweep)
    for spec in (s for s in ops.SPECS.values() if s.timed):
        name, variants = spec.fn.__name__, [(spec.fn.__name__, {})]
        if spec.sweep is not None:
            default = inspect.signature(spec.fn).parameters[spec.sweep].default
            variants = [(name if n == default else f"{name}[{spec.sweep}={n}]", {spec.sweep: n})
                        for n in sweeps[spec.sweep]]
        for impl in spec.runnable_impls(device):
            for label, kw in variants:
                out.append(Target(label, impl, "op", spec.cost, spec.bench_heads(*sizes),
                                  _op(spec, impl, check_values, kw), kw))
    if device.type == "cuda":
        for fn_name, cost in (("chunk_delta_rule", DELTA), ("chunk_gated_delta_rule", GATED_DELTA),
                              ("chunk_simple_gla", SIMPLE_GLA), ("chunk_gla", GLA)):
            out.append(Target(f"fla.{fn_name}", "fla", "anchor", cost, matrix, _fla_anchor(fn_name)))
    out.append(Target("sdpa_causal", "flash" if device.type == "cuda" else "sdpa", "anchor", SDPA, matrix, _sdpa))
    for name in MIXERS:
        op = MIXER_SPECS[name].op           # a layer is timed at its op's shape (softmax attention: the matrix one)
        layer_heads = matrix if op is None else op.bench_heads(*sizes)
        for impl in layer_impls(name, device):
            out.append(Target(f"layer.{name}", impl, "layer", None, layer_heads,
                              _layer(name, None if impl == "-" else impl, d_model, heads, head_dim, d_state)))
    if device.type == "cuda":
        out.append(Target("layer.fla_gdn", "fla", "layer", None, matrix,
                          _layer("fla_gdn", None, d_model, heads, head_dim, d_state)))
    # the token loops take seconds to minutes per call at these budgets: only when asked for by --impls
    return [t for t in out if _selected(t.name, ops_filter)
            and (t.impl in impls_filter if impls_filter else t.impl != "naive")]


def time_call(fn: Callable, leaves, device: torch.device, warmup: int, rep: int) -> tuple[float, float, float]:
    """(p20, p50, p80) milliseconds of fn()."""
    if device.type == "cuda":
        do_bench = triton_module("triton.testing").do_bench
        return tuple(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=leaves, quantiles=[0.2, 0.5, 0.8]))
    fn()
    times = []
    for _ in range(max(3, rep // 100)):
        for x in leaves:
            x.grad = None
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    q = torch.tensor(times).quantile(torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64).float())
    return tuple(q.tolist())


def peak_mib(fn: Callable, device: torch.device) -> float:
    """Run fn once; the memory it allocated at its peak above what was live before (NaN off CUDA)."""
    if device.type != "cuda":
        fn()
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def ceilings(device: torch.device, warmup: int, rep: int) -> dict:
    """Copy bandwidth (GB/s, read + write), bf16 (CPU: fp32) matmul rate and, on CUDA, the fp32 FMA rate of the
    CUDA cores (TFLOP/s, 2 per FMA; NaN off CUDA) measured now."""
    n = (1 << 28) if device.type == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    _, copy_ms, _ = time_call(lambda: dst.copy_(src), [], device, warmup, rep)
    m = 8192 if device.type == "cuda" else 512
    mdt = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(m, m, device=device, dtype=mdt), torch.randn(m, m, device=device, dtype=mdt)
    _, mm_ms, _ = time_call(lambda: a @ b, [], device, warmup, rep)
    fp32 = float("nan")
    if device.type == "cuda":
        x = torch.rand(1 << 22, device=device)
        n_iters, unroll = 128, 8
        run_chains = triton_module("kalmix.bench.fma").run_chains
        _, fma_ms, _ = time_call(lambda: run_chains(x, n_iters, unroll), [], device, warmup, rep)
        fp32 = 2 * 4 * n_iters * unroll * x.numel() / fma_ms / 1e9
    return {"copy_GBps": 2 * 4 * n / copy_ms / 1e6, "matmul_TFLOPs": 2 * m ** 3 / mm_ms / 1e9, "fp32_TFLOPs": fp32}


def versions(device: torch.device | None = None) -> dict:
    """torch/triton/fla versions, the git commit of this tree (``$KALMIX_COMMIT`` where the copy has no history) and
    the name of ``device`` (default: the current CUDA device if there is one, else the CPU)."""
    cuda = torch.cuda.is_available() if device is None else device.type == "cuda"
    info = {"torch": torch.__version__, "device_name": torch.cuda.get_device_name(device) if cuda
            else platform.processor() or platform.machine()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        from importlib.metadata import version
        info["fla"] = version("flash-linear-attention")
    except Exception:  # noqa: BLE001 (metadata missing is not an error here)
        info["fla"] = None
    if os.environ.get("KALMIX_COMMIT"):  # a copy of the tree without its git history names its commit here
        info["git"] = os.environ["KALMIX_COMMIT"]
        return info
    try:
        # "-dirty" when the timed code is not the commit's
        info["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                     cwd=os.path.dirname(__file__), timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["git"] = None
    return info


def _is_refusal(err: Exception) -> bool:
    """fla's refusal of gated-chunk backward on Hopper with triton < 3.7.1 (and similar explicit refusals)."""
    msg = str(err).lower()
    return isinstance(err, (NotImplementedError, RuntimeError, AssertionError)) and any(
        w in msg for w in ("not supported", "not implemented", "refuse", "triton", "hopper", "640"))


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# every impl name a row can carry: the ops' backends, fla's kernels, attention's flash / SDPA, "-" (attention layer)
IMPLS = tuple(sorted({i for spec in ops.SPECS.values() for i in spec.impls} | {"fla", "flash", "sdpa", "-"}))


class SpeedConfig(BaseModel):
    """One run; every field is a CLI flag (kebab-case; ``plots``: --no-plots). Construction checks, before any
    work: the device, the sizes, that every selected layer builds, and that ``ops`` / ``impls`` select something."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field("cuda", description="cuda, cuda:N, or cpu for tiny smoke runs")
    out: str = Field("runs/speed", description="output folder for speed.csv and the plots")
    modes: tuple[Literal[MODES], ...] = Field(MODES, min_length=1, description="what to time")
    seq_lens: tuple[PositiveInt, ...] = Field((1024, 2048, 4096, 8192, 16384, 32768, 65536), min_length=1,
                                              description="sequence lengths T")
    tokens: PositiveInt = Field(32768, description="tokens per call: B = tokens // T")
    dtypes: tuple[Literal[tuple(DTYPES)], ...] = Field(("bf16",), min_length=1, description="activation dtypes")
    heads: PositiveInt = Field(8, description="heads of the matrix-state mixers and anchors")
    head_dim: PositiveInt = Field(128, description="K = V of the matrix-state mixers and anchors")
    d_model: PositiveInt = Field(1024, description="layer width (Kalman op: D = 2 * d-model)")
    d_state: PositiveInt = Field(16, description="Kalman state slots N")
    decode_contexts: tuple[PositiveInt, ...] = Field((1024, 4096, 16384, 65536), min_length=1,
                                                     description="context lengths of the decode comparison (KV "
                                                     "cache length of attention)")
    ops: tuple[str, ...] = Field((), description="only targets whose name contains one of these (layer.kalman, "
                                 "fla, sdpa, ...; decode rows too); default: all")
    impls: tuple[Literal[IMPLS], ...] = Field((), description="only these impls; default: all but the naive token "
                                              "loops, which take seconds to minutes per call at 32K tokens; decode "
                                              "rows too (attention: -)")
    naive_max_len: NonNegativeInt = Field(2048, description="skip the token-loop impls above this T (they take "
                                          "seconds per call)")
    warmup: NonNegativeInt = Field(25, description="do_bench warm-up (ms)")
    rep: PositiveInt = Field(100, description="do_bench repetition time (ms)")
    plots: bool = Field(True, description="draw the PNG plots")
    check_values: bool = Field(False, description="time the ops with their value checks on (each reads its result "
                               "back: one host synchronisation per call; the layers, and by default these timings, "
                               "skip them)")
    gka_iters: tuple[NonNegativeInt, ...] = Field((GKA_ITERS,), min_length=1, description="Chebyshev steps of the "
                                                  "gated_kalmanet rows, one row each (named "
                                                  "gated_kalmanet[num_iters=N] but for the op's default)")

    @model_validator(mode="after")
    def _check(self):
        device = check_device(self.device)
        every = [t.name for t in targets((), IMPLS, self.d_model, self.heads, self.head_dim, self.d_state, device)]
        every += [f"layer.{name}" for name in MIXERS] + ["sdpa_kv_cache"]
        for f in self.ops:
            if not any(f in name for name in every):
                raise ValueError(f"ops: {f!r} is in no target's name on {device.type}; the names: "
                                 f"{', '.join(dict.fromkeys(every))}")
        timed = targets(self.ops, self.impls, self.d_model, self.heads, self.head_dim, self.d_state, device)
        if not ((timed and set(self.modes) - {"decode"}) or ("decode" in self.modes and decode_targets(self, device))):
            raise ValueError(f"modes {list(self.modes)}, ops {list(self.ops)} and impls {list(self.impls)} select "
                             f"nothing to time on {device.type}")
        for name in MIXERS:
            if _selected(f"layer.{name}", self.ops):
                kw = layer_kwargs(name, self.heads, self.head_dim, self.d_state)
                check_builds(lambda: MIXERS[name](self.d_model, **kw), f"layer.{name} with {kw}")
        return self


def _measure(call, leaves, device, cfg):
    """Run once (its peak memory is the row's; refusals, OOM and errors become the row's status), then time;
    returns (p20, p50, p80, peak MiB, status)."""
    nan = float("nan")
    try:
        peak = peak_mib(call, device)
    except torch.cuda.OutOfMemoryError:
        return nan, nan, nan, nan, "OOM"
    except Exception as err:  # noqa: BLE001 (reported in the row; one failing target does not end the run)
        if _is_refusal(err):
            return nan, nan, nan, nan, "n/a (refused)"
        first = str(err).strip().splitlines()[0][:100] if str(err).strip() else ""
        return nan, nan, nan, nan, f"error: {type(err).__name__}: {first}"
    p20, p50, p80 = time_call(call, leaves, device, cfg.warmup, cfg.rep)
    return p20, p50, p80, peak, "ok"


def _row(t: Target, mode, dtype_name, s: Shape, timing, ceil, meta, elt) -> dict:
    p20, p50, p80, peak, status = timing
    gbps = tflops = float("nan")
    if t.cost is not None and status == "ok":
        gbps = t.cost.bytes(s, elt, mode) / p50 / 1e6
        tflops = t.cost.flops(s, mode, **t.op_kwargs) / p50 / 1e9
    return {"op": t.name, "impl": t.impl, "kind": t.kind, "mode": mode, "dtype": dtype_name, "B": s.B, "T": s.T,
            "H": s.H, "K": s.K, "V": s.V, "tokens": s.B * s.T, "ms_p20": p20, "ms_p50": p50, "ms_p80": p80,
            "peak_MiB": peak, "GBps": gbps, "TFLOPs": tflops, "frac_copy_bw": gbps / ceil["copy_GBps"],
            "frac_matmul": tflops / ceil["matmul_TFLOPs"] if t.cost and t.cost.ceiling == "matmul" else math.nan,
            "frac_fp32": tflops / ceil["fp32_TFLOPs"] if t.cost and t.cost.ceiling == "fp32" else math.nan,
            "status": status,
            **meta, "copy_GBps_measured": ceil["copy_GBps"], "matmul_TFLOPs_measured": ceil["matmul_TFLOPs"],
            "fp32_TFLOPs_measured": ceil["fp32_TFLOPs"]}


def decode_targets(cfg: SpeedConfig, device: torch.device) -> list[tuple[str, str]]:
    """The (layer, impl) pairs of the decode comparison that ``cfg.ops`` / ``cfg.impls`` select, and
    ("sdpa_kv_cache", "sdpa") unless ``cfg.ops`` leaves it out."""
    pairs = [(name, impl) for name in MIXERS if _selected(f"layer.{name}", cfg.ops)
             for impl in layer_impls(name, device) if not cfg.impls or impl in cfg.impls]
    return pairs + ([("sdpa_kv_cache", "sdpa")] if _selected("sdpa_kv_cache", cfg.ops) else [])


def _decode_rows(cfg, device, dtype_name, ceil, meta) -> list[dict]:
    """Per-token latency of one layer call on one token (B = 1) with a cache of each context, for every impl
    of each layer (its ``step_impl`` runs), against bare attention with a KV cache."""
    dt = DTYPES[dtype_name]
    rows = []
    with torch.no_grad():
        for name, impl in decode_targets(cfg, device):
            if name == "sdpa_kv_cache":
                for L in cfg.decode_contexts:
                    q = _rand((1, cfg.heads, 1, cfg.head_dim), dt, device)
                    kv = [_rand((1, cfg.heads, L, cfg.head_dim), dt, device) for _ in range(2)]
                    timing = _measure(lambda: F.scaled_dot_product_attention(q, *kv), [], device, cfg)
                    rows.append(_row(Target(name, impl, "anchor", None, (), None), "decode", dtype_name,
                                     Shape(1, L, cfg.heads, cfg.head_dim, cfg.head_dim), timing, ceil, meta, 0))
                continue
            kw = layer_kwargs(name, cfg.heads, cfg.head_dim, cfg.d_state)
            layer = MIXERS[name](cfg.d_model, impl=None if impl == "-" else impl, **kw).to(device, dt)
            x1 = _rand((1, 1, cfg.d_model), dt, device)
            timing = None
            for L in cfg.decode_contexts:
                if name == "attention" or timing is None:   # a recurrent step does not depend on the context
                    prompt = L if name == "attention" else 16
                    _, _, cache = layer(_rand((1, prompt, cfg.d_model), dt, device), use_cache=True)
                    timing = _measure(lambda c=cache, m=layer: m(x1, past_key_values=c)[0], [], device, cfg)
                s = Shape(1, L, cfg.heads, cfg.head_dim, cfg.head_dim)
                rows.append(_row(Target(f"layer.{name}", impl, "layer", None, (), None), "decode",
                                 dtype_name, s, timing, ceil, meta, 0))
    for r in rows:
        r["tokens"] = 1
    return rows


def run(cfg: SpeedConfig, progress: bool = True) -> list[dict]:
    """Time everything ``cfg`` selects; write CSV (and plots) under ``cfg.out``; return the rows."""
    from tqdm.auto import tqdm

    check_out(cfg.out, folder=True)
    os.makedirs(cfg.out, exist_ok=True)
    device = torch.device(cfg.device)
    meta = versions()
    ceil = ceilings(device, cfg.warmup, cfg.rep)
    ts = targets(cfg.ops, cfg.impls, cfg.d_model, cfg.heads, cfg.head_dim, cfg.d_state, device, cfg.check_values,
                 cfg.gka_iters)
    meta["check_values"] = cfg.check_values
    rows = []
    csv_path = os.path.join(cfg.out, "speed.csv")
    plan = [(d, T, t) for d in cfg.dtypes for T in cfg.seq_lens for t in ts]
    bar = tqdm(plan, desc="kalmix speed", disable=not progress, dynamic_ncols=True)
    for dtype_name, T, t in bar:
        bar.set_postfix_str(f"{t.name}/{t.impl} {dtype_name} T={T}")
        s = Shape(max(1, cfg.tokens // T), T, *t.heads)
        elt = torch.finfo(DTYPES[dtype_name]).bits // 8
        modes = [m for m in cfg.modes if m != "decode"]
        if t.impl == "naive" and T > cfg.naive_max_len:
            for mode in modes:
                rows.append(_row(t, mode, dtype_name, s, (math.nan,) * 4 + ("skipped (naive, T > naive-max-len)",),
                                 ceil, meta, elt))
            continue
        try:
            fn, leaves = t.build(s, DTYPES[dtype_name], device)
        except torch.cuda.OutOfMemoryError:
            rows.extend(_row(t, m, dtype_name, s, (math.nan,) * 4 + ("OOM",), ceil, meta, elt) for m in modes)
            continue
        for mode in modes:
            if mode == "fwd":
                def call(fn=fn):
                    with torch.no_grad():
                        return fn()
            else:
                def call(fn=fn):
                    out = fn()
                    out.backward(torch.ones_like(out))
            rows.append(_row(t, mode, dtype_name, s, _measure(call, leaves, device, cfg), ceil, meta, elt))
        del fn, leaves
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_csv(rows, csv_path)                        # after every target: an interrupted run keeps its rows
    if "decode" in cfg.modes:
        for dtype_name in cfg.dtypes:
            rows.extend(_decode_rows(cfg, device, dtype_name, ceil, meta))
    write_csv(rows, csv_path)
    if cfg.plots:
        plot(rows, cfg.out)
    print(format_table(rows, ceil, meta, device))
    return rows


def write_csv(rows: list[dict], path: str) -> None:
    fields = list(rows[0]) if rows else []
    with open(path + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    os.replace(path + ".tmp", path)


def read_csvs(paths, columns, command: str, kind: str) -> list[dict]:
    """The rows of the result CSVs ``paths`` joined; a file without rows or lacking one of ``columns``, or a row of
    more or fewer values than the header has columns (a file cut off mid-write), is a ValueError naming ``command``
    and the file (``kind``: what the file should be, e.g. "`kalmix bench lm` CSV")."""
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            part = []
            for row in reader:
                if None in row or None in row.values():      # DictReader's fill for a short or long row
                    n = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None, ()))
                    raise ValueError(f"{command}: {path}:{reader.line_num}: a row of {n} values where the header "
                                     f"has {len(reader.fieldnames)} columns (a file cut off?); complete or remove it")
                part.append(row)
        if not part:
            raise ValueError(f"{command}: {path} holds no rows")
        missing = [c for c in columns if c not in part[0]]
        if missing:
            raise ValueError(f"{command}: {path} is not a {kind}; it lacks the column(s) {missing}")
        rows += part
    return rows


def format_table(rows: list[dict], ceil: dict, meta: dict, device: torch.device) -> str:
    lines = [f"{meta['device_name']}  torch {meta['torch']}  triton {meta['triton']}  fla {meta['fla']}  "
             f"git {meta['git']}  measured ceilings: copy {ceil['copy_GBps']:.0f} GB/s, "
             f"matmul {ceil['matmul_TFLOPs']:.1f} TFLOP/s"
             + (f", fp32 FMA {ceil['fp32_TFLOPs']:.1f} TFLOP/s" if not math.isnan(ceil["fp32_TFLOPs"]) else ""),
             "ops timed " + ("with their value checks (one host synchronisation per call)" if meta.get("check_values")
                             else "with check_values=False, as the layers call them (--check-values: with them)")]
    if device.type != "cuda":
        lines.append("NOTE: CPU run - these times say nothing about GPU speed.")
    head = (f"{'op':34s} {'impl':6s} {'mode':7s} {'dtype':5s} {'B':>4s} {'T':>6s} {'ms p50':>9s} {'Mtok/s':>8s} "
            f"{'GB/s':>7s} {'%bw':>5s} {'TFLOP/s':>8s} {'%mm':>5s} {'%fp32':>5s} {'peak MiB':>9s}  status")
    lines += [head, "-" * len(head)]
    for r in rows:
        tok = r["tokens"] / r["ms_p50"] / 1e3 if r["status"] == "ok" else float("nan")

        def f(x, fmt):
            return format(x, fmt) if x == x else "-"
        lines.append(f"{r['op']:34s} {r['impl']:6s} {r['mode']:7s} {r['dtype']:5s} {r['B']:>4d} {r['T']:>6d} "
                     f"{f(r['ms_p50'], '9.3f')} {f(tok, '8.2f')} {f(r['GBps'], '7.0f')} "
                     f"{f(100 * r['frac_copy_bw'], '5.0f')} {f(r['TFLOPs'], '8.1f')} "
                     f"{f(100 * r['frac_matmul'], '5.0f')} {f(100 * r['frac_fp32'], '5.0f')} "
                     f"{f(r['peak_MiB'], '9.0f')}  {r['status']}")
    return "\n".join(lines)


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """time vs T (log-log) and tokens/s vs T per (mode, dtype); decode latency vs context."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    ok = [r for r in rows if r["status"] == "ok"]
    for mode in ("fwd", "fwdbwd", "decode"):
        for dtype_name in sorted({r["dtype"] for r in ok}):
            sel = [r for r in ok if r["mode"] == mode and r["dtype"] == dtype_name]
            if not sel:
                continue
            fig, axes = plt.subplots(1, 1 if mode == "decode" else 2, figsize=(6 if mode == "decode" else 12, 4.5),
                                     squeeze=False)
            for key in sorted({(r["op"], r["impl"]) for r in sel}):
                pts = sorted((r["T"], r["ms_p50"], r["tokens"]) for r in sel if (r["op"], r["impl"]) == key)
                Ts = [p[0] for p in pts]
                label = f"{key[0]} [{key[1]}]"
                axes[0][0].plot(Ts, [p[1] for p in pts], marker="o", label=label)
                if mode != "decode":
                    axes[0][1].plot(Ts, [p[2] / p[1] / 1e3 for p in pts], marker="o", label=label)
            axes[0][0].set(xscale="log", yscale="log", xlabel="context" if mode == "decode" else "T",
                           ylabel="ms per token" if mode == "decode" else "ms per call",
                           title=f"{mode} {dtype_name}")
            if mode != "decode":
                axes[0][1].set(xscale="log", yscale="log", xlabel="T", ylabel="Mtokens/s",
                               title=f"{mode} {dtype_name} throughput")
            axes[0][-1].legend(fontsize=6, loc="best")
            fig.tight_layout()
            path = os.path.join(out_dir, f"speed_{mode}_{dtype_name}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
    return paths
