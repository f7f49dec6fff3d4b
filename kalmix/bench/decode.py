"""`kalmix bench decode`: milliseconds per generated token of whole models, eager and CUDA-graphed, next to the
GPU time of the step's kernels (its floor), for each mixer, batch size and context length.

For each (mixer, B, context): a ``KalmixForCausalLM`` of ``layers`` blocks of that mixer (bf16 weights) is
prefilled with ``context`` random tokens per sequence (in chunks, through the cache), then timed per decode step
three ways: ``Decoder``'s static-cache step run eagerly, the same step replayed as a CUDA graph, and the sum of
the durations of the kernels one eager step launches (``torch.profiler``; the GPU time with no launch gaps).
"""
from __future__ import annotations

import csv
import gc
import os
import time
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from kalmix.ops.common.checks import check_device
from kalmix.bench.checks import check_model, check_out
from kalmix.layers import MIXER_SPECS, MIXERS
from kalmix.models import KalmixConfig, KalmixForCausalLM
from kalmix.models.decoding import Decoder


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class DecodeBenchConfig(BaseModel):
    """One run; every field is a CLI flag (kebab-case). Construction checks the device and that every mixer's
    model builds, before any work."""

    model_config = ConfigDict(extra="forbid")

    mixers: list[Literal[tuple(MIXERS)]] = Field(default_factory=lambda: list(MIXERS), min_length=1,
                                                 description="mixers, one model each (attention is the KV-cache "
                                                 "baseline; default: every mixer)")
    batch_sizes: list[PositiveInt] = Field([1, 32], min_length=1, description="batch sizes B")
    contexts: list[PositiveInt] = Field([1024, 8192, 32768], min_length=1,
                                        description="tokens prefilled per sequence before the timed steps")
    layers: PositiveInt = Field(8, description="blocks per model")
    d_model: PositiveInt = Field(1024, description="model width")
    vocab_size: PositiveInt = Field(32000, description="vocabulary")
    num_heads: PositiveInt = Field(8, description="heads of every mixer but Kalman (H = 1)")
    steps: PositiveInt = Field(50, description="decode steps timed")
    prefill_chunk: PositiveInt = Field(65536, description="tokens per prefill call across the batch")
    dtype: Literal[tuple(_DTYPES)] = Field("bf16", description="weights' dtype")
    device: str = Field("cuda", description="torch device: cpu, cuda or cuda:N")
    graph: bool | None = Field(None, description="also time the CUDA graph (none: on CUDA)")
    compile: bool = Field(False, description="run the step through torch.compile before timing and capturing it")
    out: str | None = Field("runs/decode.csv", description="CSV file of the rows (none: no file)")

    @model_validator(mode="after")
    def _check(self):
        device = check_device(self.device)
        if self.graph and device.type != "cuda":
            raise ValueError(f"graph=True (a CUDA graph) needs a CUDA device, got device {self.device!r}")
        for mixer in self.mixers:
            check_model(lambda: lm_config(mixer, self), f"the {mixer} model of width {self.d_model}, {self.layers} "
                        f"layers and vocabulary {self.vocab_size}")
        return self


def lm_config(mixer: str, cfg: DecodeBenchConfig) -> KalmixConfig:
    """``layers`` blocks of ``mixer`` with SwiGLU MLPs, ``num_heads`` heads where the mixer takes them (Kalman: its
    paper's H = 1)."""
    return KalmixConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.layers,
                        mixer=mixer, mixer_kwargs={mixer: MIXER_SPECS[mixer].size_kwargs(heads=cfg.num_heads)})


def kernel_ms(fn, n: int = 5) -> float:
    """Mean GPU time of the kernels ``fn`` launches (summed durations, ms), from ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return total_us / n / 1e3


@torch.no_grad()
def measure(model, mixer: str, B: int, context: int, cfg: DecodeBenchConfig) -> dict:
    """One row: prefill ``context`` random tokens per sequence, then time the decode step (see the module)."""
    device = torch.device(cfg.device)
    row = {"mixer": mixer, "B": B, "context": context, "layers": cfg.layers, "d_model": cfg.d_model,
           "dtype": cfg.dtype, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    dec = Decoder(model, B, context + cfg.steps + 8, graph=False, compile=cfg.compile)
    prompt = torch.randint(0, cfg.vocab_size, (B, context), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    chunk = max(1, cfg.prefill_chunk // B)
    for lo in range(0, context, chunk):                                  # chunked prefill through the cache
        model(prompt[:, lo:lo + chunk], cache=dec.cache, use_cache=True, logits_to_keep=1)
    sync()
    row["prefill_s"] = time.perf_counter() - t0
    snap = dec.cache.snapshot()

    def rewind():
        dec.cache.restore(snap)
        dec.length = context

    rewind()
    row["eager_ms"] = dec.time_step(cfg.steps)
    if device.type == "cuda":
        rewind()
        tok = torch.zeros(B, dtype=torch.long, device=device)
        row["kernel_ms"] = kernel_ms(lambda: dec.step(tok))
        if cfg.graph is not False:
            rewind()
            dec._capture()
            row["graph_ms"] = dec.time_step(cfg.steps)
            row["graph_over_kernels"] = row["graph_ms"] / row["kernel_ms"]
        row["cache_MiB"] = dec.cache.nbytes() / 2 ** 20
        row["peak_GiB"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return row


def run(cfg: DecodeBenchConfig, progress: bool = True) -> list[dict]:
    """Measure every (mixer, B, context) of ``cfg``; print a table; write CSV rows to ``cfg.out``."""
    from tqdm.auto import tqdm
    if cfg.out is not None:
        check_out(cfg.out)
    rows = []
    todo = [(m, B, L) for m in cfg.mixers for B in cfg.batch_sizes for L in cfg.contexts]
    bar = tqdm(todo, disable=not progress, desc="decode")
    model, current = None, None
    for mixer, B, L in bar:
        bar.set_postfix_str(f"{mixer} B={B} context={L}")
        if current != mixer:
            model = None
            gc.collect()
            torch.manual_seed(0)
            model = KalmixForCausalLM(lm_config(mixer, cfg)).to(cfg.device, _DTYPES[cfg.dtype]).eval()
            current = mixer
        if cfg.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            rows.append(measure(model, mixer, B, L, cfg))
        except torch.OutOfMemoryError:
            rows.append({"mixer": mixer, "B": B, "context": L, "status": "OOM"})
        gc.collect()
    print(format_table(rows))
    if cfg.out is not None:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
        keys = sorted({k for r in rows for k in r})
        with open(cfg.out, "w", newline="") as f:
            w = csv.DictWriter(f, keys)
            w.writeheader()
            w.writerows(rows)
    return rows


def format_table(rows: list[dict]) -> str:
    cols = (f"{'mixer':<10} {'B':>3} {'context':>8} {'eager ms':>9} {'graph ms':>9} {'kernels ms':>10} "
            f"{'graph/kern':>10}")
    lines = [cols, "-" * len(cols)]
    fmt = lambda r, k: f"{r[k]:.3f}" if k in r else "-"                  # noqa: E731
    for r in rows:
        if r.get("status") == "OOM":
            lines.append(f"{r['mixer']:<10} {r['B']:>3} {r['context']:>8} OOM")
            continue
        ratio = f"{r['graph_over_kernels']:.2f}" if "graph_over_kernels" in r else "-"
        lines.append(f"{r['mixer']:<10} {r['B']:>3} {r['context']:>8} {fmt(r, 'eager_ms'):>9} "
                     f"{fmt(r, 'graph_ms'):>9} {fmt(r, 'kernel_ms'):>10} {ratio:>10}")
    return "\n".join(lines)
