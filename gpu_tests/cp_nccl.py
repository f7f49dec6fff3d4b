"""Context parallelism on GPUs over NCCL, one process per GPU (``torchrun --nproc-per-node N``):

    torchrun --nproc-per-node 4 gpu_tests/cp_nccl.py check      # CP equal to one device (fp32 and bf16)
    torchrun --nproc-per-node 4 gpu_tests/cp_nccl.py speed [T,T,...] [MODELS] [--preset P]   # 1 GPU vs N at each T
    python gpu_tests/cp_nccl.py table docs/results/multigpu/cp_speed.jsonl     # the markdown table of speed's rows

``check``: every kalmix mixer, the baselines and a GDN + attention hybrid, each rank's piece of a [2, 2048]
batch through ``context_parallel_model`` (relay, and combine for the affine ops) on the Triton path, against the
whole batch on one device: logits, loss and the summed parameter gradients (all parameters' gradients as one
vector; the worst single parameter is printed beside), relative error ≤ 1e-5 in fp32
(matmuls without TF32); the hybrid also in bf16 through the flash kernel (≤ 2e-2). ``speed``: forward + backward
+ the gradient all-reduce of an 8-layer d_model 1024 model (bf16 autocast; ``--preset``: the kalmix models of
``kalmix bench lm --preset``) on one sequence of T tokens, on rank 0 alone and then split over all ranks, at each
length given, shortest first: a step out of memory reads "oom" (every rank agrees, ``attempt``) and is not tried at
longer lengths, so one command finds the longest T on one GPU and under CP. It prints each row and appends it to
``$OUT``/cp_speed.jsonl if set (stamped with ``$KALMIX_COMMIT``); ``--gloo`` runs it on CPU processes (tests).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from kalmix.bench.checks import check_out, read_jsonl_rows
from kalmix.bench.lm import PRESETS
from kalmix.distributed import context_parallel_model
from kalmix.models import KalmixConfig, KalmixForCausalLM

KW = {"gdn": {"num_heads": 4}, "kaczmarz": {"num_heads": 4}, "gka": {"num_heads": 4}, "vla": {"num_heads": 4},
      "kalman": {"d_state": 16, "num_heads": 4}, "attention": {"num_heads": 4}, "linear_attention": {"num_heads": 4},
      "gla": {"num_heads": 4}, "mamba2": {"d_state": 16, "head_dim": 64}}
MODELS = {"gdn": ["gdn"] * 2, "kaczmarz": ["kaczmarz"] * 2, "gka": ["gka"] * 2, "vla": ["vla"] * 2,
          "kalman": ["kalman"] * 2, "hybrid": ["gdn", "attention"], "baselines": ["linear_attention", "gla", "mamba2"]}
COMBINE = ("kaczmarz", "gka", "baselines")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def model_of(mixers, d=256, vocab=512, **kw):
    torch.manual_seed(0)
    cfg = KalmixConfig(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=len(mixers),
                       mixers=mixers, mixer_kwargs={m: KW[m] for m in set(mixers)}, **kw)
    return KalmixForCausalLM(cfg).cuda()


def check(rank, world):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    B, T = 2, 2048
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (B, T), generator=gen).cuda()
    piece = T // world
    cut = slice(rank * piece, (rank + 1) * piece)
    cases = [(n, "relay", None) for n in MODELS] + [(n, "combine", None) for n in COMBINE] + \
            [("hybrid", "relay", torch.bfloat16)]
    worst = 0.0
    failed = []
    for name, mode, dtype in cases:
        model = model_of(MODELS[name], fuse_cross_entropy=False)    # the check compares the logits
        params = [p for p in model.parameters() if p.requires_grad]
        ctx = torch.autocast("cuda", dtype=dtype) if dtype else torch.autocast("cuda", enabled=False)
        with ctx:
            ref = model(input_ids=ids, labels=ids, use_cache=False)
        ref_grads = torch.autograd.grad(ref.loss, params)
        with ctx, context_parallel_model(model, mode=mode):
            out = model(input_ids=ids[:, cut], labels=ids[:, cut])
        grads = torch.autograd.grad(out.loss, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        for g in grads:
            dist.all_reduce(g)
        logits = [torch.empty_like(out.logits) for _ in range(world)]
        dist.all_gather(logits, out.logits.contiguous())
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        per = {n: rel(g, r) for n, g, r in zip(names, grads, ref_grads)}
        worst_param = max(per, key=per.get)
        errs = {"logits": rel(torch.cat(logits, 1), ref.logits), "loss": rel(loss, ref.loss.detach()),
                "grads": rel(torch.cat([g.flatten() for g in grads]), torch.cat([r.flatten() for r in ref_grads])),
                "worst param": per[worst_param]}
        tol = 2e-2 if dtype else 1e-5
        label = f"{name} {mode} {'bf16 flash' if dtype else 'fp32'}"
        if rank == 0:
            print(f"cp check world {world}: {label:24s} " + " ".join(f"{k} {v:.1e}" for k, v in errs.items())
                  + f" ({worst_param})", flush=True)
        judged = [errs["logits"], errs["loss"], errs["grads"]]
        if max(judged) > tol or any(v != v for v in errs.values()):
            failed.append(label)
        if not dtype:
            worst = max(worst, *judged)
        del model
    if rank == 0:
        print(f"cp check world {world}: worst fp32 error {worst:.1e}; failed: {failed or 'none'}", flush=True)
    return not failed


def step_time(model, ids, reps, device, split=False):
    """Median ms of forward + backward (+ the gradient all-reduce when split) under bf16 autocast."""
    times = []
    params = [p for p in model.parameters() if p.requires_grad]
    for i in range(reps + 2):
        _sync(device)
        if split:
            dist.barrier()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if split:
                with context_parallel_model(model):
                    loss = model(input_ids=ids, labels=ids).loss
            else:
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if split:                                   # one flat all-reduce of every gradient, as DDP's buckets
            have = [p for p in params if p.grad is not None]
            flat = torch.cat([p.grad.flatten() for p in have])
            dist.all_reduce(flat)
            for p, g in zip(have, flat.split([p.numel() for p in have])):
                p.grad.copy_(g.view_as(p))
        _sync(device)
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
        model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured(model, ids, reps, device, split=False):
    """(step_time's median ms, the peak memory of the steps in GiB; None off CUDA). A step that fails leaves no
    gradients behind."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        ms = step_time(model, ids, reps, device, split)
    finally:
        model.zero_grad(set_to_none=True)
    return ms, torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def attempt(fn, device, runs=True):
    """``fn()`` on this rank if ``runs`` -> (its result, or None unless every rank's attempt fitted in memory;
    whether every one did). Every rank calls this for every attempt, also one it does not run (``runs`` False:
    rank 0 alone times one GPU): a rank out of memory frees what it held, then all join an all-reduce (MIN) of
    one ok-flag, so all agree, skip the same longer lengths and meet at the same collectives next. An attempt
    out of memory on every rank at the same allocation (equal pieces of one model: the same allocations on every
    rank) is caught so; one out of memory on some ranks only, inside the step, leaves the others waiting in the
    step's own collectives, which this cannot undo: the process group's timeout ends the run then."""
    out, ok = None, True
    if runs:
        try:
            out = fn()
        except torch.OutOfMemoryError:
            ok = False
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return (out, True) if flag.item() else (None, False)


SPEED_CONFIGS = {"hybrid gdn+attn/4": ["gdn", "gdn", "gdn", "attention"] * 2, "gdn": ["gdn"] * 8,
                 "attention": ["attention"] * 8, "kaczmarz": ["kaczmarz"] * 8, "gka": ["gka"] * 8,
                 "kalman": ["kalman"] * 8}
SPEED_KW = {"gdn": {"num_heads": 8}, "kaczmarz": {"num_heads": 8}, "gka": {"num_heads": 8},
            "attention": {"num_heads": 8}, "kalman": {"d_state": 16, "num_heads": 8, "expand": 1}}


def speed_models(preset=None, only=None):
    """name -> a function of no arguments building that model (fp32, seed 0, on torch's default device): without
    ``preset`` the 8-block width-1024 models of ``SPEED_CONFIGS`` (vocabulary 32,000); with one, the kalmix models
    of ``kalmix bench lm --preset`` (every mixer and its gka + attention hybrid, sized to Llama's count as bench lm
    sizes them). ``only``: the names to keep (the first word of each)."""
    from kalmix.bench.lm import KALMIX_MODELS, LMBenchConfig, build, matched_specs
    every = list(SPEED_CONFIGS) if preset is None else [*KALMIX_MODELS, "hybrid"]
    short = [name.split()[0] for name in every]
    unknown = [m for m in only or [] if m not in short]
    if unknown:
        raise SystemExit(f"cp_nccl.py speed: error: unknown model(s) {unknown}; expected any of {', '.join(short)}")
    names = [name for name in every if not only or name.split()[0] in only]

    def seeded(fn):
        def make():
            torch.manual_seed(0)
            return fn()
        return make
    if preset is None:
        return {name: seeded(lambda m=SPEED_CONFIGS[name]: KalmixForCausalLM(KalmixConfig(
                    vocab_size=32000, hidden_size=1024, num_hidden_layers=8, mixers=m,
                    mixer_kwargs={k: SPEED_KW[k] for k in set(m)}))) for name in names}
    cfg = LMBenchConfig(preset=preset, models=names)
    specs, _ = matched_specs(cfg)
    return {name: seeded(lambda s=specs[name]: build(s, cfg.shape())) for name in names}


def speed(rank, world, lengths, device, models, preset=None, reps=3):
    """Per model of ``models`` (``speed_models``), at each T of ``lengths`` (shortest first): a training step on one
    sequence of T tokens on rank 0 alone ("1gpu"), then split over every rank ("cp"); either that runs out of memory
    at T reads "oom" there and "skipped (oom at T)" at longer T, where it is not tried. Rank 0 prints each row and
    appends it to ``$OUT``/cp_speed.jsonl as it is measured."""
    path = os.path.join(os.environ["OUT"], "cp_speed.jsonl") if rank == 0 and os.environ.get("OUT") else None
    piece_of = {T: slice(rank * T // world, (rank + 1) * T // world) for T in lengths}
    for name, make in models.items():
        with torch.device(device):
            model = make()
        vocab = model.config.vocab_size
        oom_at = {"1gpu": None, "cp": None}
        for T in lengths:
            ids = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(0)).to(device)
            res = {}
            for where in ("1gpu", "cp"):
                if oom_at[where] is not None:
                    res[where] = (f"skipped (oom at {oom_at[where]})", None, None)
                    continue
                if rank == 0:                                   # a run that hangs or dies shows where
                    print(f"cp speed: {name} T={T} {'1 GPU' if where == '1gpu' else f'{world} GPUs'} ...", flush=True)
                if where == "1gpu":
                    out, ok = attempt(lambda: measured(model, ids, reps, device), device, runs=rank == 0)
                else:
                    out, ok = attempt(lambda: measured(model, ids[:, piece_of[T]], reps, device, split=True), device)
                if not ok:
                    oom_at[where] = T
                res[where] = ("ok" if ok else "oom", *(out or (None, None)))    # (ms, GiB) where it ran
            (s1, ms1, mem1), (sn, msn, memn) = res["1gpu"], res["cp"]
            row = {"model": name, "preset": preset, "params": sum(p.numel() for p in model.parameters()), "T": T,
                   "gpus": world, "commit": os.environ.get("KALMIX_COMMIT", "unknown"),
                   "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "status_1gpu": s1, "status_cp": sn, "ms_1gpu": ms1, "ms_cp": msn,
                   "speedup": ms1 / msn if ms1 and msn else None, "mem_1gpu_gib": mem1, "mem_cp_gib": memn}
            if rank == 0:
                print(f"cp speed {name:18s} T={T} 1 GPU {_cell(row, '1gpu')} ms {_gib(mem1)} GiB | {world} GPUs "
                      f"{_cell(row, 'cp')} ms {_gib(memn)} GiB | speed-up {_speedup(row)}", flush=True)
                if path:
                    with open(path, "a") as f:
                        f.write(json.dumps(row) + "\n")
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _cell(r, where):
    """A row's ms on one GPU or under CP, or what kept it from running (rows before statuses were recorded: ok)."""
    status = r.get(f"status_{where}", "ok")
    if status != "ok":
        return "not tried" if status.startswith("skipped") else status
    return f"{r[f'ms_{where}']:.0f}"


def _gib(x):
    return "-" if x is None else f"{x:.1f}"


def _speedup(r):
    return "-" if r["speedup"] is None else f"{r['speedup']:.2f}×"


def _label(r):
    return r["model"] + (f" ({r['preset']})" if r.get("preset") else "")


ROW_KEYS = ("model", "T", "gpus", "ms_1gpu", "ms_cp", "speedup", "mem_1gpu_gib", "mem_cp_gib", "gpu", "commit")


def read_rows(path: str) -> list[dict]:
    """``speed``'s rows in the JSONL file ``path`` (blank lines skipped); a ValueError naming the file (and line)
    when it cannot be read, is empty, or holds a line that is not one of those rows."""
    rows = read_jsonl_rows(path, ROW_KEYS, "not a row of `cp_nccl.py speed`",
                           unreadable="give the cp_speed.jsonl that `speed` wrote")
    if not rows:
        raise ValueError(f"{path}: no rows (an empty file)")
    return rows


def table(path: str) -> str:
    """The markdown table of ``speed``'s JSON rows, one line per model, GPU count and T; rows of a run over several
    lengths (with statuses) add the longest T that ran per model and GPU count, on one GPU and under CP, with its
    tokens/s ("≥": no length tried ran out of memory)."""
    rows = read_rows(path)
    lines = ["| model | T | GPUs | 1 GPU (ms) | CP (ms) | speed-up | memory 1 GPU / CP per GPU (GiB) |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (_label(r), r["gpus"], r["T"])):
        lines.append(f"| {_label(r)} | {r['T']:,} | {r['gpus']} | {_cell(r, '1gpu')} | {_cell(r, 'cp')} | "
                     f"{_speedup(r)} | {_gib(r['mem_1gpu_gib'])} / {_gib(r['mem_cp_gib'])} |")
    swept = [r for r in rows if "status_cp" in r]
    if swept:
        lines += ["", "| model | GPUs | longest T on 1 GPU (tokens/s) | longest T under CP (tokens/s) |",
                  "|---|---|---|---|"]
        for key in dict.fromkeys(sorted((_label(r), r["gpus"]) for r in swept)):
            mine = [r for r in swept if (_label(r), r["gpus"]) == key]
            lines.append(f"| {key[0]} | {key[1]} | {_longest(mine, '1gpu')} | {_longest(mine, 'cp')} |")
    stamps = sorted({(r["commit"], r["gpu"]) for r in rows})
    return "\n".join(lines + ["", "Measured at " + "; ".join(f"commit {c} on {g}" for c, g in stamps) + "."])


def _longest(rows, where):
    ran = [r for r in rows if r[f"status_{where}"] == "ok"]
    if not ran:
        return "none"
    r = max(ran, key=lambda r: r["T"])
    oom = any(x[f"status_{where}"] == "oom" for x in rows)
    return f"{'' if oom else '≥ '}{r['T']:,} ({r['T'] / r[f'ms_{where}'] * 1e3:,.0f})"


def _lengths(text):
    """"65536,131072" -> [65536, 131072], shortest first; a clear error for anything else."""
    try:
        lengths = sorted({int(t) for t in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"lengths must be comma-separated integers, e.g. 65536,131072; got "
                                         f"{text!r}") from None
    if lengths[0] < 2:
        raise argparse.ArgumentTypeError(f"a length must be at least 2 tokens; got {lengths[0]}")
    return lengths


def _positive(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {text!r}")
    return int(text)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="cp_nccl.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("check", help="CP equal to one device (fp32 and bf16), over NCCL")
    sp = sub.add_parser("speed", help="a training step at each length on one GPU and split over every rank")
    sp.add_argument("lengths", nargs="?", type=_lengths, default=[65536],
                    help="comma-separated T, tried shortest first (default 65536)")
    sp.add_argument("models", nargs="?", default=None, help="comma-separated model names (default: all)")
    sp.add_argument("--preset", choices=list(PRESETS), default=None,
                    help="the kalmix models of `kalmix bench lm --preset` instead of the 8-block width-1024 set")
    sp.add_argument("--reps", type=_positive, default=3, help="timed steps (after two untimed ones); the median is "
                    "kept")
    sp.add_argument("--gloo", action="store_true", help="CPU processes over gloo instead of GPUs over NCCL (tests)")
    tp = sub.add_parser("table", help="the markdown table of speed's JSON rows")
    tp.add_argument("path")
    args = parser.parse_args(argv)
    if args.what == "table":
        try:
            print(table(args.path))
        except ValueError as e:
            tp.error(str(e))
        return
    gloo = args.what == "speed" and args.gloo
    if args.what == "speed":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        uneven = [T for T in args.lengths if T % world]
        if uneven:
            sp.error(f"lengths {uneven} do not divide by the {world} ranks (equal pieces)")
        models = speed_models(args.preset, args.models.split(",") if args.models else None)
        out = os.environ.get("OUT")
        if out:                                     # rank 0 appends a row after each measurement: checked first
            if not os.path.isdir(out):
                sp.error(f"OUT = {out!r} {'is a file' if os.path.exists(out) else 'does not exist'}; speed appends "
                         f"its rows to OUT/cp_speed.jsonl: give an existing folder")
            try:
                check_out(os.path.join(out, "cp_speed.jsonl"), append=True)
            except ValueError as e:
                sp.error(f"OUT = {out!r}: {e}")
    if not gloo and not torch.cuda.is_available():
        raise SystemExit(f"cp_nccl.py {args.what}: error: runs on CUDA GPUs over NCCL, and this machine has no CUDA "
                         f"device{' (speed --gloo runs on CPU processes)' if args.what == 'speed' else ''}")
    if "RANK" not in os.environ:
        raise SystemExit(f"cp_nccl.py {args.what}: error: runs one process per GPU; start it with torchrun "
                         f"--nproc-per-node N gpu_tests/cp_nccl.py {args.what} ...")
    dist.init_process_group("gloo" if gloo else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if gloo:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    ok = True
    try:
        if args.what == "speed":
            speed(rank, world, args.lengths, device, models, preset=args.preset, reps=args.reps)
        else:
            ok = check(rank, world)
    finally:
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
