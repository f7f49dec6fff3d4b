"""`kalmix bench lm`: training throughput of whole language models side by side, at matched parameter counts.

Each row times one model's training step — forward, backward and a fused AdamW step, under bf16 autocast with fp32
weights (as ``kalmix train`` runs it: ``build_model``, ``kalmix.train.optim``) — on B × T tokens, B = tokens // T:

* the models: a ``KalmixForCausalLM`` of every kalmix mixer (attention, gdn, kaczmarz, gka, vla, kalman), a hybrid
  (gka with softmax attention in every 4th layer), fla's own ``DeltaNetForCausalLM`` (CUDA only) and transformers'
  ``LlamaForCausalLM`` with ``attn_implementation="sdpa"``; every one with SwiGLU MLPs and tied embeddings;
* parameter counts matched: each model is counted on the meta device before it is built; one whose count differs
  from Llama's by more than the tolerance is sized — its SwiGLU width set to the multiple of 64 that brings the
  count nearest to Llama's, for Kalman with its paper's layer (expand 2) first, then with expand 1 — and a set
  that still misses is refused (``ParamMismatchError``);
* plain rows, and packed rows: documents laid end to end in each row (``packed_cu_seqlens``: lengths drawn from a
  log-normal distribution of median ``doc_median`` tokens and σ = 1, seed 0, the last document of a row cut at its
  end; the same documents for every model). kalmix models take ``cu_seqlens``, fla's model its packed layout
  [1, B·T] with ``cu_seqlens``, Llama ``position_ids`` that restart at each document (transformers' padding-free
  convention, a block-diagonal mask under SDPA);
* metrics: tokens/s from the median of ``steps`` timed steps after ``warmup`` (CUDA events on a GPU), MFU under the
  trainer's FLOP model (``lm_flops_per_token``: attention counts a row's whole causal triangle, packed or not; fla's
  DeltaNet as the delta rule, Llama's attention as causal SDPA) against the GPU's bf16 dense peak, peak memory
  (``torch.cuda.max_memory_allocated``, reset before each row's model is built: weights, gradients, optimizer state
  and activations), and tokens/s as a ratio to fla's DeltaNet and to Llama at the same T and packing. A row that
  runs out of memory is "oom"; the run goes on.

``--prefill`` adds rows timing the forward alone (no gradients; the last position's logits), as a prompt's prefill.
``--longest`` times one row of T tokens per step (B = 1, plain rows) at each T, shortest first, and tries a model
no longer once its step ran out of memory: the longest T each model trains at (``longest_table``, ``plot_longest``).
``--activation-checkpointing`` recomputes each block in the backward, as ``kalmix train`` can.
``--memory`` accounts what a training forward saves for the backward instead of timing (``kalmix.bench.memory``);
``--profile`` records steps with torch.profiler and splits their time into categories (``kalmix.bench.profile``).
"""
from __future__ import annotations

import gc
import importlib.util
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn as nn
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kalmix.bench.checks import check_out
from kalmix.bench.models import lm_flops_per_token
from kalmix.bench.speed import read_csvs, versions, write_csv
from kalmix.layers import MIXER_SPECS
from kalmix.ops.common.checks import check_device
from kalmix.ops.common.cost import DELTA, SDPA, Shape

KALMIX_MODELS = tuple(name for name, spec in MIXER_SPECS.items() if spec.headline)
MODELS = (*KALMIX_MODELS, "hybrid", "fla_deltanet", "llama")
HYBRID_ATTENTION_EVERY = 4                # the hybrid: gka, softmax attention in layers 3, 7, ...
RECOMPUTE = "+recompute"                  # a kalmix model's variant with KalmixConfig(recompute_mixers=True)
RECOMPUTABLE = (*(m for m in KALMIX_MODELS if m != "attention"), "hybrid")
REFERENCES = ("fla_deltanet", "llama")    # tokens/s ratios are taken against these; Llama's count is the target
# the model shapes: the issue's (8 blocks of width 1024, 8 heads of 128), `kalmix train gpu-125m`'s and that of
# benchmarks/scaling.py's `--size 1b` (18 blocks of width 2048, 16 heads of 128)
PRESETS = {"default": dict(layers=8, d_model=1024, vocab_size=32000, num_heads=8, attention_heads=8),
           "125m": dict(layers=12, d_model=768, vocab_size=32768, num_heads=6, attention_heads=12),
           "1b": dict(layers=18, d_model=2048, vocab_size=32768, num_heads=16, attention_heads=16)}
_MLP_MULTIPLE = 64


class ParamMismatchError(ValueError):
    """A set of models whose parameter counts are not within the tolerance of Llama's."""


class LMBenchConfig(BaseModel):
    """One run; every field is a CLI flag (kebab-case). Shape fields left None come from ``preset``."""

    model_config = ConfigDict(extra="forbid")

    models: list[str] = Field(default_factory=lambda: list(MODELS), min_length=1,
                              description=f"models to time, any of {', '.join(MODELS)} (default: all; hybrid: gka "
                              f"with attention in every {HYBRID_ATTENTION_EVERY}th layer; fla_deltanet needs CUDA; "
                              f"MODEL{RECOMPUTE}, e.g. gdn{RECOMPUTE}: that kalmix model with its mixers recomputed "
                              f"in the backward, KalmixConfig(recompute_mixers=True))")
    preset: Literal["default", "125m", "1b"] = Field(
        "default", description="model shape: default (8 blocks, width 1024, 8 heads of 128, vocabulary 32,000), 125m "
        "(12 blocks, width 768, vocabulary 32,768: `kalmix train gpu-125m`'s) or 1b (18 blocks, width 2048, 16 "
        "heads of 128, vocabulary 32,768: attention 977.9M parameters, gdn sized to 977.1M)")
    layers: int | None = Field(None, ge=1, description="blocks (none: the preset's)")
    d_model: int | None = Field(None, ge=8, description="width (none: the preset's)")
    vocab_size: int | None = Field(None, ge=2, description="vocabulary (none: the preset's)")
    num_heads: int | None = Field(None, ge=1, description="heads of the recurrent mixers and fla's DeltaNet (none: "
                                  "the preset's)")
    attention_heads: int | None = Field(None, ge=1, description="heads of softmax attention: Llama's, kalmix "
                                        "attention's (none: the preset's)")
    seq_lens: list[int] = Field([2048, 16384, 65536], min_length=1, description="row lengths T; each must divide "
                                "--tokens (with --longest: any, tried shortest first)")
    tokens: int = Field(65536, ge=1, description="tokens per step: B = tokens // T rows (not with --longest)")
    longest: bool = Field(False, description="the longest row each model trains at: B = 1 row of T tokens per step "
                          "at every --seq-lens T, shortest first, plain rows; a model out of memory at T is not tried "
                          "at longer T (those rows read 'skipped (oom at T)')")
    activation_checkpointing: bool = Field(False, description="recompute each block in the backward of the "
                                           "training steps, as `kalmix train` does with train.activation_checkpointing")
    packing: list[Literal["plain", "packed"]] = Field(["plain", "packed"], min_length=1, description="plain rows "
                                                      "and/or packed rows (documents end to end, their boundaries "
                                                      "passed to the model)")
    doc_median: int = Field(1024, ge=1, description="median document length of the packed rows (log-normal, σ = 1, "
                            "seed 0)")
    prefill: bool = Field(False, description="also time the forward alone (no gradients)")
    warmup: int = Field(3, ge=0, description="untimed steps per row")
    steps: int = Field(10, ge=1, description="timed steps per row (tokens/s from their median)")
    tolerance: float = Field(0.05, gt=0, lt=1, description="largest relative difference of a model's parameter "
                             "count from Llama's")
    size: bool = Field(True, description="size outliers to Llama's count (Kalman's expand, the SwiGLU width); "
                       "--no-size: refuse them instead")
    device: str = Field("cuda", description="torch device (cuda; cpu runs tiny models)")
    peak_tflops: float | None = Field(None, gt=0, description="peak TFLOP/s for MFU (none: the bf16 dense peak of "
                                      "a known GPU; none on CPU)")
    impl: Literal["torch", "triton"] | None = Field(None, description="the kalmix mixers' op backend (none: triton on "
                                                   "CUDA, torch elsewhere; triton on CPU needs TRITON_INTERPRET=1)")
    memory: bool = Field(False, description="instead of timing, account what one training forward saves for the "
                         "backward, per module and dtype in bytes per token (memory.csv; any device)")
    profile: bool = Field(False, description="instead of timing, record --steps steps (after --warmup) of each row "
                          "with torch.profiler: GPU (CPU) time per category, the top kernels and a Chrome trace "
                          "(profile.csv, kernels.txt, trace_*.json.gz; kalmix.bench.profile)")
    out: str = Field("runs/bench_lm", description="output folder: lm.csv and lm_<mode>.png")
    plots: bool = Field(True, description="draw the PNG plot")

    @model_validator(mode="after")
    def _check(self):
        if self.memory and self.profile:
            raise ValueError("bench lm: --memory (what a forward saves) and --profile (where a step's time goes) are "
                             "two runs; pass one of them")
        for flag, on in (("--longest", self.longest), ("--activation-checkpointing", self.activation_checkpointing)):
            if on and (self.memory or self.profile):
                raise ValueError(f"bench lm: {flag} applies to the timed steps; --memory and --profile do not take it")
        if self.longest:
            if "tokens" in self.model_fields_set:
                raise ValueError(f"bench lm: --longest runs B = 1 row of T tokens per step, so --tokens "
                                 f"{self.tokens} does not apply; pass one of --longest and --tokens")
            if "packing" in self.model_fields_set and "packed" in self.packing:
                raise ValueError("bench lm: --longest times plain rows only; --packing packed does not apply with it")
            self.packing = ["plain"]
            self.seq_lens = sorted(set(self.seq_lens))
        unknown = [m for m in self.models if m not in MODELS and not (m.endswith(RECOMPUTE)
                                                                      and m.removesuffix(RECOMPUTE) in RECOMPUTABLE)]
        if unknown:
            raise ValueError(f"bench lm: unknown model(s) {unknown}; expected any of {', '.join(MODELS)}, or one of "
                             f"{', '.join(RECOMPUTABLE)} followed by {RECOMPUTE} (its mixers recomputed in the "
                             f"backward)")
        for T in self.seq_lens:
            if T < 2:
                raise ValueError(f"bench lm: T = {T} is too short; a row holds T >= 2 tokens")
            if not self.longest and self.tokens % T:
                raise ValueError(f"bench lm: T = {T} does not divide the {self.tokens} tokens per step (B = tokens "
                                 f"// T rows of T tokens); pick T among the divisors of --tokens")
        s = self.shape()
        for heads, what in ((s.num_heads, "num_heads"), (s.attention_heads, "attention_heads")):
            if s.d_model % heads or (s.d_model // heads) % 2:
                raise ValueError(f"bench lm: {what} = {heads} must split d_model = {s.d_model} into heads of an "
                                 f"even size")
        return self

    def shape(self) -> "LMShape":
        """The preset's shape with the fields given here."""
        return LMShape(**{k: getattr(self, k) if getattr(self, k) is not None else v
                          for k, v in PRESETS[self.preset].items()})

    def rows(self, T: int) -> int:
        """B, the rows of T tokens per step: 1 with ``longest``, else tokens // T."""
        return 1 if self.longest else self.tokens // T


@dataclass(frozen=True)
class LMShape:
    """Blocks, width, vocabulary; heads of the recurrent mixers and fla's DeltaNet (head size d_model / num_heads)
    and of softmax attention (Llama's, kalmix attention's, the hybrid's)."""
    layers: int
    d_model: int
    vocab_size: int
    num_heads: int
    attention_heads: int

    def __str__(self) -> str:
        return (f"{self.layers} blocks, width {self.d_model}, {self.num_heads} heads (attention "
                f"{self.attention_heads}), vocabulary {self.vocab_size:,}")


@dataclass
class Spec:
    """One benchmarked model: ``source`` "kalmix" (a ``KalmixForCausalLM`` of ``mixer``, attention every
    ``attention_every``-th layer if set), "fla" or "transformers"; SwiGLU width ``intermediate_size``; ``sized``
    says what matching the parameter count changed."""
    name: str
    source: str
    intermediate_size: int
    mixer: str | None = None
    attention_every: int | None = None
    mixer_kwargs: dict = field(default_factory=dict)
    sized: str = ""
    recompute: bool = False

    def layers(self, shape: LMShape) -> str:
        """What its blocks hold, e.g. "gka ×6, attention ×2"."""
        if self.source == "fla":
            return f"fla DeltaNet ×{shape.layers}"
        if self.source == "transformers":
            return f"Llama SDPA attention ×{shape.layers}"
        n_attn = shape.layers // self.attention_every if self.attention_every else 0
        return (f"{self.mixer} ×{shape.layers - n_attn}" + (" recomputed" if self.recompute else "")
                + (f", attention ×{n_attn}" if n_attn else ""))


def specs(shape: LMShape, names=MODELS) -> dict[str, Spec]:
    """The unsized models of ``names`` (Llama is always among them: its count is the target). The recurrent mixers
    and fla's DeltaNet get ``num_heads`` heads, softmax attention ``attention_heads``; Kalman its paper's layer
    (expand 2, N = 16, H = 1)."""
    from kalmix.models import KalmixConfig
    width = KalmixConfig(hidden_size=shape.d_model).intermediate_size       # 8/3 · d rounded up to 64, everywhere
    attn = {"num_heads": shape.attention_heads}
    out = {}
    for name in dict.fromkeys([*names, "llama"]):
        if name.endswith(RECOMPUTE):
            out[name] = replace(specs(shape, [name.removesuffix(RECOMPUTE)])[name.removesuffix(RECOMPUTE)],
                                name=name, recompute=True)
        elif name in KALMIX_MODELS:
            heads = shape.attention_heads if name == "attention" else shape.num_heads
            out[name] = Spec(name, "kalmix", width, mixer=name,
                             mixer_kwargs={name: MIXER_SPECS[name].size_kwargs(heads=heads)})
        elif name == "hybrid":
            out[name] = Spec(name, "kalmix", width, mixer="gka", attention_every=HYBRID_ATTENTION_EVERY,
                             mixer_kwargs={"gka": {"num_heads": shape.num_heads}, "attention": attn})
        elif name == "fla_deltanet":
            out[name] = Spec(name, "fla", width)
        else:
            out[name] = Spec(name, "transformers", width)
    return out


def build(spec: Spec, shape: LMShape, max_len: int = 65536, impl: str | None = None) -> nn.Module:
    """The model of ``spec`` (fp32 weights on torch's current default device; ``with torch.device("meta")`` to
    count it); ``impl``: the kalmix mixers' op backend (None: by device)."""
    if spec.source == "kalmix":
        from kalmix.train.config import TrainConfig
        from kalmix.train.loop import build_model
        model = dict(mixer=spec.mixer, attention_every=spec.attention_every, hidden_size=shape.d_model,
                     num_hidden_layers=shape.layers, intermediate_size=spec.intermediate_size,
                     mixer_kwargs=spec.mixer_kwargs, impl=impl, recompute_mixers=spec.recompute)
        return build_model(TrainConfig(model=model), shape.vocab_size)
    if spec.source == "fla":
        from fla.models import DeltaNetConfig, DeltaNetForCausalLM
        return DeltaNetForCausalLM(DeltaNetConfig(
            vocab_size=shape.vocab_size, hidden_size=shape.d_model, num_hidden_layers=shape.layers,
            num_heads=shape.num_heads, intermediate_size=spec.intermediate_size, tie_word_embeddings=True,
            norm_eps=1e-5))
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.d_model, num_hidden_layers=shape.layers,
        num_attention_heads=shape.attention_heads, num_key_value_heads=shape.attention_heads,
        intermediate_size=spec.intermediate_size, tie_word_embeddings=True, rms_norm_eps=1e-5,
        max_position_embeddings=max_len, attn_implementation="sdpa", use_cache=False))


def count_params(spec: Spec, shape: LMShape) -> int:
    """Parameters of ``spec``'s model (tied embeddings once), built on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build(spec, shape).parameters())


def size_to(spec: Spec, shape: LMShape, target: int, tolerance: float) -> Spec:
    """``spec`` sized to ``target`` parameters: for each mixer variant in turn (its layer as given, then its compact
    variant if it has one, ``MixerSpec.compact``; Kalman: its paper's layer, then expand 1), the SwiGLU width (a
    multiple of 64, at least 64) nearest to the target; the first variant within ``tolerance`` (else the
    nearest)."""
    best = None
    compact = MIXER_SPECS[spec.mixer].compact if spec.mixer is not None else {}
    for variant in ({}, compact) if compact else ({},):
        s = spec
        if variant:
            s = replace(spec, mixer_kwargs={**spec.mixer_kwargs, spec.mixer: {**spec.mixer_kwargs[spec.mixer],
                                                                              **variant}})
        n0 = count_params(s, shape)
        per_step = count_params(replace(s, intermediate_size=s.intermediate_size + _MLP_MULTIPLE), shape) - n0
        width = max(_MLP_MULTIPLE, s.intermediate_size + _MLP_MULTIPLE * round((target - n0) / per_step))
        changes = [f"{k}={v}" for k, v in variant.items()]
        if width != spec.intermediate_size:
            changes.append(f"intermediate_size {spec.intermediate_size} -> {width}")
        s = replace(s, intermediate_size=width, sized=", ".join(changes))
        miss = abs(count_params(s, shape) - target)
        if miss <= tolerance * target:
            return s
        if best is None or miss < best[0]:
            best = (miss, s)
    return best[1]


def check_matched(counts: dict[str, int], target: int, tolerance: float) -> None:
    """Raise ``ParamMismatchError`` naming every model whose count is not within ``tolerance`` of ``target``."""
    off = {k: n for k, n in counts.items() if abs(n - target) > tolerance * target}
    if off:
        listed = ", ".join(f"{k} {n:,} ({n / target:.3f}×)" for k, n in off.items())
        raise ParamMismatchError(f"bench lm: parameter counts must be within {tolerance:.1%} of Llama's {target:,}; "
                                 f"{listed} are not (--size sizes outliers by Kalman's expand and the SwiGLU width; "
                                 f"--tolerance sets the limit)")


def matched_specs(cfg: LMBenchConfig) -> tuple[dict[str, Spec], dict[str, int]]:
    """The models of ``cfg`` sized to Llama's count (if ``cfg.size``) and their counts; ``ParamMismatchError``
    if a count is not within ``cfg.tolerance``."""
    shape = cfg.shape()
    out = specs(shape, cfg.models)
    target = count_params(out["llama"], shape)
    counts = {}
    for name, spec in out.items():
        n = count_params(spec, shape)
        if cfg.size and abs(n - target) > cfg.tolerance * target:
            out[name] = spec = size_to(spec, shape, target, cfg.tolerance)
            n = count_params(spec, shape)
        counts[name] = n
    check_matched(counts, target, cfg.tolerance)
    return {k: out[k] for k in cfg.models}, counts


def packed_cu_seqlens(B: int, T: int, doc_median: int, seed: int = 0) -> torch.Tensor:
    """Documents of a packed [B, T] batch -> cu_seqlens int32 [N + 1] over the flattened B·T tokens: each row filled
    with documents whose lengths are drawn from LogNormal(ln doc_median, 1) (rounded, at least 1 token; ``seed``
    fixes them), the last one cut at the row's end."""
    g = torch.Generator().manual_seed(seed)
    bounds = [0]
    for row in range(B):
        pos = 0
        while pos < T:
            length = max(1, round(doc_median * math.exp(torch.randn((), generator=g).item())))
            pos = min(T, pos + length)
            bounds.append(row * T + pos)
    return torch.tensor(bounds, dtype=torch.int32)


def flops_per_token(model: nn.Module, spec: Spec, T: int) -> float:
    """Training FLOPs (forward + backward) per token on rows of T tokens, under the trainer's model: kalmix models
    by ``lm_flops_per_token``; fla's and Llama's likewise, 6 per linear weight plus each layer's op (the delta rule;
    causal SDPA) from ``op_flops``."""
    if spec.source == "kalmix":
        return lm_flops_per_token(model, T)
    flops = 6.0 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    for layer in model.model.layers:
        if spec.source == "fla":
            a = layer.attn
            s, cost = Shape(1, T, a.num_heads, a.head_k_dim, a.head_v_dim), DELTA
        else:
            heads, hd = model.config.num_attention_heads, layer.self_attn.head_dim
            s, cost = Shape(1, T, heads, hd, hd), SDPA
        flops += cost.flops(s, "fwdbwd") / T
    return flops


def _inputs(spec: Spec, ids: torch.Tensor, cu_seqlens: torch.Tensor | None) -> dict:
    """The model's keyword arguments for tokens ``ids`` [B, T], packed by ``cu_seqlens`` if given."""
    if cu_seqlens is None:
        return {"input_ids": ids, "use_cache": False}
    if spec.source == "kalmix":
        return {"input_ids": ids, "cu_seqlens": cu_seqlens, "use_cache": False}
    if spec.source == "fla":                                    # fla's packed layout: one row of B·T tokens
        return {"input_ids": ids.reshape(1, -1), "cu_seqlens": cu_seqlens.long(), "use_cache": False}
    from kalmix.layers.documents import Documents
    doc_pos = Documents("bench lm", cu_seqlens, *ids.shape).doc_pos
    return {"input_ids": ids, "position_ids": doc_pos.long(), "use_cache": False}


def time_steps(fn, device: torch.device, warmup: int, steps: int) -> list[float]:
    """Milliseconds of each of ``steps`` calls of fn after ``warmup`` untimed ones (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return times
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def make_step(spec: Spec, shape: LMShape, mode: str, B: int, T: int, cu_seqlens: torch.Tensor | None,
              cfg: LMBenchConfig, device: torch.device):
    """Build the model and one step of ``mode`` on B × T random tokens (packed by ``cu_seqlens`` if given): "train"
    (forward with labels under bf16 autocast, backward, AdamW step; each block recomputed in the backward with
    ``cfg.activation_checkpointing``) or "prefill" (forward without gradients, the last position's logits) ->
    (model, step: a function of no arguments)."""
    from kalmix.train.config import OptimSection
    from kalmix.train.loop import activation_checkpointing
    from kalmix.train.optim import Optimization, autocast
    torch.manual_seed(0)
    with torch.device(device):
        model = build(spec, shape, max(cfg.seq_lens), cfg.impl)
    ids = torch.randint(0, shape.vocab_size, (B, T), device=device)
    kw = _inputs(spec, ids, None if cu_seqlens is None else cu_seqlens.to(device))
    if mode == "train":
        model.train()
        if cfg.activation_checkpointing:
            activation_checkpointing(model)
        opt = Optimization(model, OptimSection(), cfg.warmup + cfg.steps, device, "bf16").optimizer

        def step():
            with autocast(device.type, "bf16"):
                loss = model(**kw, labels=kw["input_ids"]).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        model.eval()

        @torch.no_grad()
        def step():
            with autocast(device.type, "bf16"):
                model(**kw, logits_to_keep=1)
    return model, step


def measure(spec: Spec, shape: LMShape, mode: str, B: int, T: int, cu_seqlens: torch.Tensor | None,
            cfg: LMBenchConfig, device: torch.device) -> dict:
    """Build the model, time ``cfg.steps`` steps of ``mode`` ("train" or "prefill", ``make_step``) on B × T random
    tokens (packed by ``cu_seqlens`` if given): -> {ms_median, tokens_per_s, flops_per_token, peak_GiB}."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, step = make_step(spec, shape, mode, B, T, cu_seqlens, cfg, device)
    ms = statistics.median(time_steps(step, device, cfg.warmup, cfg.steps))
    return {"ms_median": ms, "tokens_per_s": B * T / ms * 1e3,
            "flops_per_token": flops_per_token(model, spec, T) if mode == "train" else math.nan,
            "peak_GiB": torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else math.nan}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(cfg: LMBenchConfig, progress: bool | None = None) -> list[dict]:
    """Time every (model, T, packing, mode) of ``cfg``; write ``lm.csv`` (after every row) and the plots under
    ``cfg.out``; print the table; return the rows. ``progress``: a tqdm bar (None: on a terminal). With
    ``cfg.longest`` each model's lengths run shortest first, and once a model's step of a mode runs out of memory at
    T its longer rows of that mode are not run: their status reads "skipped (oom at T)".

    Raises ValueError before anything is timed: a device this machine lacks, matplotlib missing for the plots, or
    ``ParamMismatchError``."""
    from tqdm.auto import tqdm

    device = check_device(cfg.device)
    if cfg.plots and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("bench lm draws its plot with matplotlib, which is not installed: pip install "
                         "'kalmix[plots]' (or matplotlib), or pass --no-plots")
    shape = cfg.shape()
    models, counts = matched_specs(cfg)
    target = counts["llama"]
    from kalmix.train.loop import peak_flops
    peak = peak_flops(device, cfg.peak_tflops)
    meta = versions()
    modes = ["train", "prefill"] if cfg.prefill else ["train"]
    os.makedirs(cfg.out, exist_ok=True)
    csv_path = os.path.join(cfg.out, "lm.csv")
    plan = [(m, T, p, mode) for m in models for T in cfg.seq_lens for p in cfg.packing for mode in modes]
    rows = []
    oom_at = {}                                 # --longest: (model, mode) -> the T its step ran out of memory at
    bar = tqdm(plan, desc="bench lm", disable=None if progress is None else not progress, dynamic_ncols=True)
    for name, T, packing, mode in bar:
        bar.set_postfix_str(f"{name} T={T} {packing} {mode}")
        spec, B = models[name], cfg.rows(T)
        cu = packed_cu_seqlens(B, T, cfg.doc_median) if packing == "packed" else None
        row = {"model": name, "source": spec.source, "layers": spec.layers(shape), "mode": mode, "packing": packing,
               "T": T, "B": B, "tokens": B * T, "documents": len(cu) - 1 if cu is not None else B,
               "params": counts[name], "params_vs_llama": counts[name] / target,
               "intermediate_size": spec.intermediate_size, "sized": spec.sized, "steps": cfg.steps,
               "ms_median": math.nan, "tokens_per_s": math.nan, "mfu": math.nan, "peak_GiB": math.nan,
               "vs_fla_deltanet": math.nan, "vs_llama": math.nan, "status": None}
        if spec.source == "fla" and device.type != "cuda":
            row["status"] = "unavailable: needs CUDA (fla's Triton kernels)"
        elif (name, mode) in oom_at:
            row["status"] = f"skipped (oom at {oom_at[name, mode]})"
        else:
            try:
                m = measure(spec, shape, mode, B, T, cu, cfg, device)
                row.update(ms_median=m["ms_median"], tokens_per_s=m["tokens_per_s"], peak_GiB=m["peak_GiB"],
                           mfu=m["tokens_per_s"] * m["flops_per_token"] / peak if peak else math.nan, status="ok")
            except torch.OutOfMemoryError:
                row["status"] = "oom"
                if cfg.longest:
                    oom_at[name, mode] = T
            except Exception as err:  # noqa: BLE001 (reported in the row and the exit status; the run goes on)
                first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
                row["status"] = f"error: {type(err).__name__}: {first}"
            _free(device)
        rows.append({**row, "peak_TFLOPs": peak / 1e12 if peak else math.nan, "dtype": "bf16 autocast",
                     "longest": cfg.longest, "activation_checkpointing": cfg.activation_checkpointing,
                     "preset": cfg.preset, "shape": str(shape), "device": device.type,
                     "device_name": meta["device_name"], "git": meta["git"], "torch": meta["torch"],
                     "triton": meta["triton"], "fla": meta["fla"]})
        add_ratios(rows)
        write_csv(rows, csv_path)                         # after every row: an interrupted run keeps its rows
    if cfg.plots:
        plot(rows, cfg.out)
    print(format_table(rows))
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Set each row's tokens/s ratios to fla's DeltaNet and Llama at the same mode, T and packing (NaN where that
    reference did not run)."""
    ok = {(r["model"], r["mode"], r["T"], r["packing"]): r["tokens_per_s"] for r in rows if r["status"] == "ok"}
    for r in rows:
        for ref in REFERENCES:
            base = ok.get((ref, r["mode"], r["T"], r["packing"]))
            r[f"vs_{ref}"] = r["tokens_per_s"] / base if base and r["status"] == "ok" else math.nan


def _fmt(x, spec: str) -> str:
    return format(x, spec) if x == x else "-"


def _setup(r: dict) -> str:
    """What the run held fixed beside the model and T: B or tokens per step, the preset, activation checkpointing."""
    text = "B = 1 row per step (--longest)" if r["longest"] else f"{int(r['tokens']):,} tokens per step"
    if r["preset"]:
        text += f", preset {r['preset']} ({r['shape']})"
    return text + (", activation checkpointing" if r["activation_checkpointing"] else "")


def format_table(rows: list[dict]) -> str:
    """The printed table: one line per row, with the versions, GPU and commit of the run."""
    r0 = rows[0]
    lines = [f"{r0['device_name']}  torch {r0['torch']}  triton {r0['triton']}  fla {r0['fla']}  git {r0['git']}  "
             f"{_setup(r0)}, bf16 autocast, AdamW (fused on CUDA)"]
    if r0["device"] == "cpu":
        lines.append("NOTE: CPU run - these times say nothing about GPU speed.")
    head = (f"{'model':13s} {'params':>8s} {'×llama':>6s} {'mode':7s} {'packing':7s} {'T':>6s} {'B':>4s} "
            f"{'tokens/s':>11s} {'MFU %':>5s} {'peak GiB':>8s} {'×fla':>5s} {'×llama':>6s}  status")
    lines += [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:13s} {r['params'] / 1e6:7.2f}M {r['params_vs_llama']:6.3f} {r['mode']:7s} "
                     f"{r['packing']:7s} {r['T']:>6d} {r['B']:>4d} {_fmt(r['tokens_per_s'], ',.0f'):>11s} "
                     f"{_fmt(100 * r['mfu'], '.1f'):>5s} {_fmt(r['peak_GiB'], '.1f'):>8s} "
                     f"{_fmt(r['vs_fla_deltanet'], '.2f'):>5s} {_fmt(r['vs_llama'], '.2f'):>6s}  {r['status']}")
    sized = [f"{r['model']}: {r['sized']}" for r in {r["model"]: r for r in rows}.values() if r["sized"]]
    if sized:
        lines.append("sized to Llama's parameter count: " + "; ".join(sized))
    return "\n".join(lines)


def _matplotlib():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    return plt, matplotlib.ticker


def _log_t_axis(ax, ticker, lengths) -> None:
    ax.set_xscale("log")
    ax.set_xticks(sorted(lengths), [str(t) for t in sorted(lengths)])
    ax.xaxis.set_minor_locator(ticker.NullLocator())


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """tokens/s against T per model, one PNG per mode: plain and packed side by side (``lm_train.png``, ...); of
    a --longest run, each model's line up to its longest T with an × where it ran out of memory
    (``lm_longest_train.png``, ...)."""
    if rows[0]["longest"]:
        return plot_longest(rows, out_dir)
    plt, ticker = _matplotlib()
    paths = []
    ok = [r for r in rows if r["status"] == "ok"]
    for mode in dict.fromkeys(r["mode"] for r in ok):
        packings = list(dict.fromkeys(r["packing"] for r in ok if r["mode"] == mode))
        fig, axes = plt.subplots(1, len(packings), figsize=(6 * len(packings), 4.5), squeeze=False, sharey=True)
        for ax, packing in zip(axes[0], packings):
            sel = [r for r in ok if r["mode"] == mode and r["packing"] == packing]
            for name in dict.fromkeys(r["model"] for r in sel):
                pts = sorted((r["T"], r["tokens_per_s"]) for r in sel if r["model"] == name)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                        color=f"C{MODELS.index(name)}", linestyle="--" if name in REFERENCES else "-")
            ax.set(yscale="log", xlabel="T (tokens per row)", ylabel="tokens/s",
                   title=f"{mode}, {packing} rows ({sel[0]['tokens']} tokens per step)")
            _log_t_axis(ax, ticker, {r["T"] for r in sel})
            ax.legend(fontsize=7, loc="best")
        fig.suptitle(f"kalmix bench lm: {ok[0]['device_name']}, git {ok[0]['git']}", fontsize=9)
        paths.append(_save(plt, fig, os.path.join(out_dir, f"lm_{mode}.png")))
    return paths


def _save(plt, fig, path: str) -> str:
    """Lay out, write and close ``fig`` at ``path``; returns the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_longest(rows: list[dict], out_dir: str) -> list[str]:
    """Of a --longest run: tokens/s against T (log x), one line per model, an × at the foot of the axes at the T
    where the model's step ran out of memory; one PNG per mode (``lm_longest_train.png``, ...)."""
    plt, ticker = _matplotlib()
    paths = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        sel = [r for r in rows if r["mode"] == mode]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        foot = ax.get_xaxis_transform()                         # x in data, y in axes coordinates
        for name in dict.fromkeys(r["model"] for r in sel):
            color, style = f"C{MODELS.index(name)}", "--" if name in REFERENCES else "-"
            pts = sorted((r["T"], r["tokens_per_s"]) for r in sel if r["model"] == name and r["status"] == "ok")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, color=color, linestyle=style)
            for r in sel:
                if r["model"] == name and r["status"] == "oom":
                    ax.plot([r["T"]], [0.03], marker="x", markersize=9, color=color, transform=foot, clip_on=False)
        ax.set(yscale="log", xlabel="T (tokens in the one row of a step)", ylabel="tokens/s",
               title=f"{'training step' if mode == 'train' else 'prefill'}, B = 1: up to the longest T that ran "
                     f"(×: out of memory)")
        _log_t_axis(ax, ticker, {r["T"] for r in sel})
        ax.legend(fontsize=7, loc="best")
        r0 = sel[0]
        fig.suptitle(f"kalmix bench lm --longest: {r0['device_name']}, git {r0['git']}"
                     + (f", preset {r0['preset']}" if r0["preset"] else "")
                     + (", activation checkpointing" if r0["activation_checkpointing"] else ""), fontsize=9)
        paths.append(_save(plt, fig, os.path.join(out_dir, f"lm_longest_{mode}.png")))
    return paths


_TABLE_COLUMNS = ("model", "mode", "packing", "T", "tokens", "params", "params_vs_llama", "tokens_per_s", "mfu",
                  "peak_GiB", "vs_fla_deltanet", "vs_llama", "status", "device", "device_name", "git", "torch",
                  "triton", "fla")
# the columns older CSVs lack, at what those runs were: not --longest, no activation checkpointing, no preset named
_LATER_COLUMNS = {"longest": "False", "activation_checkpointing": "False", "preset": "", "shape": ""}
_INTS = ("T", "B", "tokens", "documents", "params", "intermediate_size", "steps")
_FLOATS = ("params_vs_llama", "ms_median", "tokens_per_s", "mfu", "peak_GiB", "vs_fla_deltanet", "vs_llama",
           "peak_TFLOPs")


def read_rows(*csv_paths: str) -> list[dict]:
    """The rows of ``kalmix bench lm`` CSVs joined, typed as ``run`` returns them (numbers, booleans); a ValueError
    unless they are runs of one GPU kind, versions and setup (--longest or the same tokens per step, preset,
    activation checkpointing)."""
    rows = []
    for r in read_csvs(csv_paths, _TABLE_COLUMNS, "bench lm --table", "`kalmix bench lm` CSV"):
        r = {**_LATER_COLUMNS, **r}
        r.update({k: int(r[k]) for k in _INTS if k in r},
                 **{k: float(r[k]) if r[k] != "" else math.nan for k in _FLOATS if k in r},
                 longest=r["longest"] == "True", activation_checkpointing=r["activation_checkpointing"] == "True")
        rows.append(r)
    keys = ["device_name", "torch", "triton", "fla", "longest", "preset", "shape", "activation_checkpointing"]
    for key in keys if rows[0]["longest"] else [*keys, "tokens"]:
        differ = [r for r in rows if r[key] != rows[0][key]]
        if differ:
            raise ValueError(f"bench lm --table: a row has {key} {differ[0][key]!r} where the first has "
                             f"{rows[0][key]!r}; one table joins runs of one GPU kind and setup only")
    return rows


def markdown_table(*csv_paths: str) -> str:
    """The markdown table of ``kalmix bench lm`` CSVs (one run, or several of one GPU kind, setup and versions:
    their rows are joined, the ratios recomputed across them and every commit named), headed by the GPU, commits,
    versions and setup: per mode, one line per model, one column per (T, packing); each cell tokens/s (× fla's
    DeltaNet, × Llama), MFU and peak memory, or the row's status. Of --longest runs, ``longest_table``."""
    rows = read_rows(*csv_paths)
    if rows[0]["longest"]:
        return longest_table(rows)
    add_ratios(rows)
    r0 = rows[0]
    out = [f"`kalmix bench lm` on {r0['device_name']}, commit {_commits(rows)} (torch {r0['torch']}, triton "
           f"{r0['triton']}, fla {r0['fla'] or '-'}); {r0['tokens']:,} tokens per step, bf16 autocast, fp32 "
           f"weights, AdamW (fused on CUDA). Each cell: tokens/s (× fla's DeltaNetForCausalLM, × Llama at the same T "
           f"and packing) · MFU · peak memory." + _setup_note(r0)]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        sel = [r for r in rows if r["mode"] == mode]
        cols = sorted({(r["T"], r["packing"]) for r in sel}, key=lambda c: (c[0], c[1] != "plain"))
        out += ["", f"**{_MODE_TITLES[mode]}**", "",
                "| model | params (× Llama) | " + " | ".join(f"T = {T:,}" + (" packed" if p == "packed" else "")
                                                      for T, p in cols) + " |",
                "|---|---:|" + "---:|" * len(cols)]
        for name in dict.fromkeys(r["model"] for r in sel):
            cells = {(r["T"], r["packing"]): r for r in sel if r["model"] == name}
            line = [name, _params(next(iter(cells.values())))]
            for c in cols:
                r = cells.get(c)
                if r is None:
                    line.append("")
                elif r["status"] != "ok":
                    line.append(r["status"])
                else:
                    line.append(f"{r['tokens_per_s']:,.0f} ({_fmt(r['vs_fla_deltanet'], '.2f')}, "
                                f"{_fmt(r['vs_llama'], '.2f')})" + _mfu_memory(r))
            out.append("| " + " | ".join(line) + " |")
    return "\n".join(out)


def longest_table(rows: list[dict]) -> str:
    """The long-context table of --longest rows (typed, ``read_rows``): per mode, one line per model: its longest
    T that ran ("≥ T" when no length tried ran out of memory), then at each T tokens/s, MFU and peak memory, or
    "oom", or "not tried" past an oom; headed by the GPU, commits, versions, preset and activation checkpointing."""
    r0 = rows[0]
    out = [f"`kalmix bench lm --longest` on {r0['device_name']}, commit {_commits(rows)} (torch {r0['torch']}, "
           f"triton {r0['triton']}, fla {r0['fla'] or '-'}); one row of T tokens per step (B = 1), bf16 autocast, "
           f"fp32 weights, AdamW (fused on CUDA)." + _setup_note(r0) + " Longest T: the longest that ran (≥: no "
           "length tried ran out of memory). Each cell: tokens/s · MFU · peak memory; oom: out of memory; not tried: "
           "longer than an oom."]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        sel = [r for r in rows if r["mode"] == mode]
        lengths = sorted({r["T"] for r in sel})
        out += ["", f"**{_MODE_TITLES[mode]}**", "",
                "| model | params (× Llama) | longest T | " + " | ".join(f"T = {T:,}" for T in lengths) + " |",
                "|---|---:|---:|" + "---:|" * len(lengths)]
        for name in dict.fromkeys(r["model"] for r in sel):
            cells = {r["T"]: r for r in sel if r["model"] == name}
            ran = [T for T, r in cells.items() if r["status"] == "ok"]
            oom = any(r["status"] == "oom" for r in cells.values())
            longest = f"{'' if oom else '≥ '}{max(ran):,}" if ran else "none"
            line = [name, _params(next(iter(cells.values()))), longest]
            for T in lengths:
                r = cells.get(T)
                if r is None:
                    line.append("")
                elif r["status"] == "ok":
                    line.append(f"{r['tokens_per_s']:,.0f}" + _mfu_memory(r))
                else:
                    line.append("not tried" if r["status"].startswith("skipped") else r["status"])
            out.append("| " + " | ".join(line) + " |")
    return "\n".join(out)


_MODE_TITLES = {"train": "training step", "prefill": "prefill (forward)"}


def _commits(rows: list[dict]) -> str:
    return ", ".join(dict.fromkeys(r["git"] for r in rows))


def _setup_note(r: dict) -> str:
    """The table heading's preset and activation checkpointing (nothing for older CSVs, which name neither)."""
    return ((f" Preset {r['preset']}: {r['shape']}." if r["preset"] else "")
            + (f" Activation checkpointing {'on' if r['activation_checkpointing'] else 'off'}."
               if r["preset"] or r["activation_checkpointing"] else "")
            + (" A CPU run: these times say nothing about GPU speed." if r["device"] == "cpu" else ""))


def _params(r: dict) -> str:
    return f"{r['params'] / 1e6:.2f}M ({r['params_vs_llama']:.2f})"


def _mfu_memory(r: dict) -> str:
    return ((f" · {100 * r['mfu']:.0f}%" if r["mfu"] == r["mfu"] else "")
            + (f" · {r['peak_GiB']:.1f} GiB" if r["peak_GiB"] == r["peak_GiB"] else ""))


def plot_csvs(csv_paths, out_dir: str) -> list[str]:
    """The plots (``plot``) of ``kalmix bench lm`` CSVs joined (``read_rows``), written to ``out_dir``."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("bench lm --table --out draws the plots with matplotlib, which is not installed: pip install "
                         "'kalmix[plots]' (or matplotlib)")
    check_out(out_dir, folder=True)
    os.makedirs(out_dir, exist_ok=True)
    return plot(read_rows(*csv_paths), out_dir)


def main(cfg: LMBenchConfig) -> int:
    """``kalmix bench lm``: 1 if a row failed with an error, else 0. With ``cfg.memory`` the saved-tensor account
    of ``kalmix.bench.memory`` instead of timing, with ``cfg.profile`` the profile of ``kalmix.bench.profile``."""
    check_out(cfg.out, folder=True)
    if cfg.memory:
        from kalmix.bench.memory import run as account
        return account(cfg)
    if cfg.profile:
        from kalmix.bench.profile import run as profile
        return profile(cfg)
    rows = run(cfg)
    failed = [r for r in rows if r["status"].startswith("error")]
    if failed:
        print(f"bench lm: {len(failed)} row(s) failed; their status in the table says why", file=sys.stderr)
        return 1
    return 0
