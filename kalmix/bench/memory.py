"""`kalmix bench lm --memory`: what autograd saves for the backward of a training step, per module and dtype.

A training step's activation memory is what its forward saves for the backward. ``saved_tensors`` runs a forward
under ``torch.autograd.graph.saved_tensors_hooks`` and module hooks and attributes every saved tensor to the
innermost module running when it was saved (the autograd Functions of the Triton kernels included: what their
``ctx.save_for_backward`` keeps). Each storage is counted once, at its first save, with its whole size (a saved
view keeps all of it); a later save of the same storage is counted as "shared" at no cost, and a save of a
parameter's own storage costs nothing. The tensor inputs of a ``torch.utils.checkpoint.checkpoint`` region (a
recomputing mixer's, ``KalmixConfig.recompute_mixers``), which the checkpoint keeps outside autograd's saved
tensors until its backward, count as saved by the module that opens the region; what the region saves does not
(it is recomputed).

``account`` runs the forward at T and at 2T tokens per row and splits each module's bytes into bytes per token
(the growth from T to 2T over the B·T tokens added) and fixed bytes (what does not grow with T: bf16 casts of the
weights under autocast, initial and final states, the LM head's gradient the fused loss keeps). They are
device-independent for the same impl and shapes. With ``--impl triton`` on CPU the ops run their Triton kernels
and the layers and the loss their fused ones (``kalmix.layers.common.fused_kernels_everywhere``), all under
``TRITON_INTERPRET=1``: what a GPU keeps. With ``--impl torch`` everything runs the torch chains of the CPU path.
"""
from __future__ import annotations

import contextlib
import os
import re
from collections import defaultdict
from typing import Callable

import torch
import torch.nn as nn
import torch.utils.checkpoint

from kalmix.bench.speed import read_csvs

_LAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)(?:\.([^.]+))?")
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
           torch.int64: "int64", torch.int32: "int32", torch.bool: "bool"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPES.get(dtype, str(dtype).removeprefix("torch."))


def saved_tensors(model: nn.Module, forward: Callable[[], object]) -> list[dict]:
    """Run ``forward()`` (which calls ``model`` with gradients enabled) and account every tensor autograd saves
    for its backward.

    Returns one row per (module, dtype) that saved anything, in the order first saved: ``module`` (its qualified
    name in ``model``, "" for code outside every submodule, e.g. the loss), ``type`` (its class), ``dtype``,
    ``tensors`` (saves), ``bytes`` (of the storages first saved there), ``shared`` (saves of a storage already
    counted, or of a parameter's), ``shared_with`` (the modules that counted them; "(parameter)"), ``shapes`` (the
    shapes saved, with counts). The forward's result is dropped (its graph freed) before returning."""
    if not torch.is_grad_enabled():
        raise ValueError("saved_tensors: gradients are disabled (torch.no_grad); autograd saves nothing to count")
    names = {m: n for n, m in model.named_modules()}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[nn.Module] = []
    seen: dict[tuple, str] = {}
    rows: dict[tuple, dict] = {}
    keep: list[torch.Tensor] = []            # the saved tensors, alive until the end: no storage address reused

    def pack(t: torch.Tensor):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return t
        owner = stack[-1] if stack else model
        name = names.get(owner, "")
        row = rows.setdefault((name, t.dtype), dict(
            module=name, type=type(owner).__name__, dtype=dtype_name(t.dtype), tensors=0, bytes=0, shared=0,
            shared_with=set(), shapes=defaultdict(int)))
        row["tensors"] += 1
        row["shapes"][tuple(t.shape)] += 1
        keep.append(t)
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if storage.data_ptr() in params:
            row["shared"] += 1
            row["shared_with"].add("(parameter)")
        elif key in seen:
            row["shared"] += 1
            if seen[key] != name:
                row["shared_with"].add(seen[key] or "(model)")
        else:
            seen[key] = name
            row["bytes"] += storage.nbytes()
        return t

    def enter(module, args):
        stack.append(module)

    def leave(module, args, out):
        stack.pop()

    checkpoint = torch.utils.checkpoint.checkpoint

    def counted_checkpoint(fn, *args, **kwargs):    # a region's inputs stay alive until its backward reruns it
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                pack(a)
        return checkpoint(fn, *args, **kwargs)

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(enter),
                                                     m.register_forward_hook(leave, always_call=True))]
    torch.utils.checkpoint.checkpoint = counted_checkpoint
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
    finally:
        torch.utils.checkpoint.checkpoint = checkpoint
        for h in handles:
            h.remove()
    del keep
    out = []
    for row in rows.values():
        row["shared_with"] = " ".join(sorted(row["shared_with"]))
        row["shapes"] = " ".join(f"{list(s)}×{n}" if n > 1 else str(list(s)) for s, n in row["shapes"].items())
        out.append(row)
    return out


def account(model: nn.Module, forward: Callable[[int], object], B: int, T: int) -> list[dict]:
    """``saved_tensors`` of ``forward(T)`` and ``forward(2 * T)`` (each a forward of ``model`` on B rows of that
    many tokens), joined per (module, dtype): the rows of the run at T (``shapes`` and counts of it) with
    ``bytes_per_token`` = (bytes at 2T − bytes at T) / (B·T) and ``fixed_bytes`` = bytes at T − B·T ·
    bytes_per_token."""
    short = saved_tensors(model, lambda: forward(T))
    long = {(r["module"], r["dtype"]): r["bytes"] for r in saved_tensors(model, lambda: forward(2 * T))}
    rows = []
    for r in short:
        per_token = (long.pop((r["module"], r["dtype"]), 0) - r["bytes"]) / (B * T)
        rows.append({**r, "bytes_per_token": per_token, "fixed_bytes": r["bytes"] - per_token * B * T})
    if long:
        raise ValueError(f"account: the forward at 2T = {2 * T} saved in (module, dtype) {sorted(long)[:4]} that "
                         f"the one at T = {T} did not; the saves must not depend on the length")
    return rows


def part(module: str) -> tuple[str, int | None]:
    """(the part of the model a module belongs to, its layer index or None): "layers.3.mixer.q_proj" ->
    ("mixer", 3); "model.layers.3" -> ("block", 3); "model.norm" -> ("model.norm", None); "" -> ("loss", None)."""
    m = _LAYER.match(module)
    if m:
        return m.group(2) or "block", int(m.group(1))
    return (module or "loss"), None


def by_part(rows: list[dict]) -> dict[str, dict[str, float]]:
    """{part: {dtype: bytes per token, "fixed": fixed bytes}} of ``account`` rows, the parts inside the layers
    averaged over the layers that have them ("mixer", "mlp", "mixer_norm", ...), the others whole."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    layers: dict[str, set] = defaultdict(set)
    for r in rows:
        name, layer = part(r["module"])
        totals[name][r["dtype"]] += r["bytes_per_token"]
        totals[name]["fixed"] += r["fixed_bytes"]
        if layer is not None:
            layers[name].add(layer)
    return {name: {k: v / max(1, len(layers[name])) for k, v in d.items() if v} for name, d in totals.items()}


def step_peak_bytes(step: Callable[[], object]) -> int:
    """The peak of CPU memory allocated during ``step()`` above what was allocated before it, from torch.profiler's
    memory events (allocations at their op's start, frees as they happen)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def run(cfg) -> int:
    """``kalmix bench lm --memory``: for every model of ``cfg`` (an ``LMBenchConfig``), each T and packing, the
    ``account`` of a training forward (bf16 autocast, training mode, labels) on B × T tokens: writes
    ``memory.csv`` (one row per model, T, packing, module and dtype) under ``cfg.out`` and prints bytes per token
    by part and dtype. Returns 0 (1 if a model failed)."""
    from kalmix.bench.lm import _inputs, build, matched_specs, packed_cu_seqlens
    from kalmix.bench.speed import versions, write_csv
    from kalmix.layers.common import fused_kernels_everywhere
    from kalmix.ops.common.checks import check_device
    from kalmix.train.optim import autocast
    device = check_device(cfg.device)
    shape = cfg.shape()
    models, _ = matched_specs(cfg)
    meta = versions()
    os.makedirs(cfg.out, exist_ok=True)
    rows, failed = [], 0
    lines = [f"saved for the backward of a training forward (bf16 autocast, labels): bytes per token, per layer "
             f"inside the layers, and bytes that do not grow with T; impl {cfg.impl or 'by device'}, {device}", ""]
    for (name, spec), T, packing in ((m, T, p) for m in models.items() for T in cfg.seq_lens for p in cfg.packing):
        B = cfg.tokens // T
        head = f"{name} ({spec.layers(shape)}), B × T = {B} × {T}, {packing} rows"
        if spec.source == "fla" and device.type != "cuda":
            lines += [f"{head}: unavailable: needs CUDA (fla's Triton kernels)", ""]
            continue
        torch.manual_seed(0)
        try:
            with torch.device(device):
                model = build(spec, shape, 2 * max(cfg.seq_lens), cfg.impl).train()

            def forward(length: int):
                ids = torch.randint(0, shape.vocab_size, (B, length), device=device)
                cu = packed_cu_seqlens(B, length, cfg.doc_median).to(device) if packing == "packed" else None
                kw = _inputs(spec, ids, cu)
                fused = fused_kernels_everywhere() if cfg.impl == "triton" else contextlib.nullcontext()
                with autocast(device.type, "bf16"), fused:
                    return model(**kw, labels=kw["input_ids"]).loss
            saved = account(model, forward, B, T)
        except Exception as err:  # noqa: BLE001 (reported in the output and the exit status; the run goes on)
            failed += 1
            lines += [f"{head}: error: {type(err).__name__}: {str(err).strip()[:160]}", ""]
            continue
        rows += [{"model": name, "layers": spec.layers(shape), "impl": cfg.impl or "default", "packing": packing,
                  "T": T, "B": B, "d_model": shape.d_model, "num_heads": shape.num_heads,
                  "attention_heads": shape.attention_heads, "vocab_size": shape.vocab_size, **r,
                  "device": device.type, "device_name": meta["device_name"], "git": meta["git"],
                  "torch": meta["torch"]} for r in saved]
        lines += [head, format_parts(by_part(saved)), ""]
        del model
    if rows:
        write_csv(rows, os.path.join(cfg.out, "memory.csv"))
    print("\n".join(lines))
    return 1 if failed else 0


def format_parts(parts: dict[str, dict[str, float]]) -> str:
    """One line per part, largest first: its bytes per token, in all and by dtype, and its fixed bytes."""
    width = max(len(p) for p in parts) if parts else 4
    out = []
    for name, d in sorted(parts.items(), key=lambda kv: -sum(v for k, v in kv[1].items() if k != "fixed")):
        per = {k: v for k, v in d.items() if k != "fixed" and abs(v) >= 0.05}
        by = ", ".join(f"{dt} {v:,.1f}" for dt, v in sorted(per.items(), key=lambda kv: -kv[1]))
        out.append(f"  {name:{width}s} {sum(per.values()):>10,.1f} B/token ({by or '-'})"
                   + (f", fixed {d.get('fixed', 0) / 2 ** 20:,.2f} MiB" if abs(d.get("fixed", 0)) >= 1024 else ""))
    return "\n".join(out) if out else "  (nothing saved)"


_TABLE_COLUMNS = ("model", "impl", "packing", "T", "B", "d_model", "num_heads", "module", "dtype", "bytes_per_token",
                  "fixed_bytes", "device", "git", "torch")
_MIXER_PARTS = ("mixer", "self_attn", "attn")          # kalmix's, Llama's and fla's name for a layer's mixer


def markdown_table(*csv_paths: str) -> str:
    """The markdown table of ``kalmix bench lm --memory`` CSVs: one line per model, impl, packing and T; bytes per
    token of one layer's mixer (by dtype), MLP and norms, the layer in all, and what the model saves outside its
    layers (loss, final norm, embedding); headed by the shapes, device, torch version and commits."""
    rows = read_csvs(csv_paths, _TABLE_COLUMNS, "bench lm --memory --table", "`kalmix bench lm --memory` CSV")
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["model"], r["impl"], r["packing"], int(r["T"]), int(r["B"]), int(r["d_model"]),
                int(r["num_heads"]))].append(
            {**r, "bytes_per_token": float(r["bytes_per_token"]), "fixed_bytes": float(r["fixed_bytes"])})
    r0 = rows[0]
    shapes = sorted({(k[5], k[6], k[3], k[4]) for k in groups})
    out = [f"`kalmix bench lm --memory` on {r0['device']} (torch {r0['torch']}), commit "
           f"{', '.join(dict.fromkeys(r['git'] for r in rows))}: bytes saved for the backward per token of a "
           f"training forward under bf16 autocast with labels, at "
           + "; ".join(f"d_model = {d} ({h} heads of {d // h}), B × T = {B} × {T} and {B} × {2 * T}"
                       for d, h, T, B in shapes) + ".", "",
           "| model | impl | rows | mixer (per layer) | MLP | norms | one layer | loss, final norm, embedding |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    for (model, impl, packing, *_), group in groups.items():
        parts = by_part(group)
        per = {name: sum(v for k, v in d.items() if k != "fixed") for name, d in parts.items()}
        inside = {part(r["module"])[0] for r in group if part(r["module"])[1] is not None}
        mixer = {k: v for name in _MIXER_PARTS for k, v in parts.get(name, {}).items() if k != "fixed"}
        by = ", ".join(f"{dt} {v:,.0f}" for dt, v in sorted(mixer.items(), key=lambda kv: -kv[1]) if v >= 0.5)
        norms = sum(v for name, v in per.items() if name in inside and "norm" in name)
        out.append(f"| {model} | {impl} | {packing} | {sum(mixer.values()):,.0f} ({by}) | {per.get('mlp', 0):,.0f} | "
                   f"{norms:,.0f} | {sum(v for name, v in per.items() if name in inside):,.0f} | "
                   f"{sum(v for name, v in per.items() if name not in inside):,.0f} |")
    return "\n".join(out)
