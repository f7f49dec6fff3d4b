"""Data-parallel scaling of `kalmix train` on the GPUs of one host: each (mixer, parallelism, GPU count) trains the
``gpu-125m`` preset (or ``--size 1b``) for a few steps under torchrun at the same global batch (the preset's 32
rows; one GPU accumulates micro-batches), or with ``--rows-per-gpu N`` at the same work per GPU (one micro-batch
of N rows on each GPU, N × GPUs rows per step), and the table gives tokens/s (median of the logged windows after
the first), scaling efficiency against one GPU of the same batch setting, MFU and peak memory.

    python benchmarks/scaling.py run OUT --mixers gdn gka --gpus 1 2 4 --parallel ddp fsdp [--steps 40]
    python benchmarks/scaling.py table OUT/scaling.jsonl            # the markdown table, from committed rows

``run`` launches the runs (one-GPU runs side by side, one per free GPU), appends one JSON row per run to
OUT/scaling.jsonl (skipping runs already there, so a cut call resumes) and prints the table. ``--profile N``
records N steps of every run with torch.profiler (each process's table in OUT/<run>/profile/), which says where
a multi-GPU step's time goes that the one-GPU step does not spend. Every run shares
one data cache (OUT/data: the standard library's sources, the preset's 32,768-token BPE), prepared first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = {  # extra `kalmix train` flags per model size (the gpu-125m preset underneath)
    "125m": [],
    "1b": ["--model.hidden_size", "2048", "--model.num_hidden_layers", "18", "--train.micro_batch_size", "4",
           "--model.mixer_kwargs", "{attention: {num_heads: 16}, gdn: {num_heads: 16}, kaczmarz: {num_heads: 16}, "
           "gka: {num_heads: 16}, vla: {num_heads: 16}, kalman: {d_state: 16, expand: 1, num_heads: 1}}"],
}


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cmd(out: Path, mixer: str, size: str, parallel: str, gpus: int, steps: int, run_dir: Path,
         profile: int = 0, rows_per_gpu: int | None = None) -> list[str]:
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
            "-m", "kalmix.cli"] if gpus > 1 else [sys.executable, "-m", "kalmix.cli"]
    return base + ["train", "gpu-125m", "--model.mixer", mixer, "--run_dir", str(run_dir),
                   "--data_dir", str(out / "data"), "--data.source", "stdlib", "--data.val_fraction", "0.05", "--train.steps", str(steps),
                   "--train.parallel", parallel, "--log.every", "10", "--log.progress", "false",
                   "--eval.every", "100000", "--eval.rows", "64", "--checkpoint.every", "100000",
                   "--optim.warmup_steps", "10", "--resume", "never", "--log.profile", str(profile)] + SIZES[size] + (
        [] if rows_per_gpu is None else ["--train.micro_batch_size", str(rows_per_gpu),
                                         "--train.global_batch_size", str(rows_per_gpu * gpus)])


def _summary(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    start = next(r for r in rows if r["kind"] == "start")
    train = [r for r in rows if r["kind"] == "train"][1:]            # the first window holds compilation
    if not train:
        raise RuntimeError(f"{run_dir}: no timed window after the first; train longer")
    profile = next(({k: r.get(k) for k in ("steps", "step_ms", "busy_ms", "host_ms", "idle_fraction", "launches")}
                    for r in rows if r["kind"] == "profile"), None)
    return {"params": start["params"], "tok_s": statistics.median(r["tok_s"] for r in train),
            "mfu": statistics.median(r["mfu"] for r in train) if train[0]["mfu"] is not None else None,
            "mem_gib": max(r["mem_gib"] or 0 for r in train), "loss": train[-1]["loss"],
            "tokens_per_step": start["tokens_per_step"], **({"profile": profile} if profile else {})}


def prepare(out: Path) -> None:
    """The shared data cache OUT/data (tokenizer and shards), made once by a one-step CPU run of a tiny model."""
    _check_out(out)
    if (out / "data" / "shards" / "meta.json").exists():
        return
    code = subprocess.run(_cmd(out, "gdn", "125m", "ddp", 1, 1, out / "prepare") + [
        "--train.device", "cpu", "--model.hidden_size", "64", "--model.num_hidden_layers", "1",
        "--train.seq_len", "64", "--train.global_batch_size", "8", "--train.micro_batch_size", "8",
        "--train.dtype", "fp32", "--model.mixer_kwargs", "{gdn: {num_heads: 1}}"]).returncode
    if code:
        raise SystemExit(f"scaling.py: preparing {out / 'data'} failed: `kalmix train` exited with status {code} "
                         "(its message is above)")


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT {str(out)!r} is a file; give a folder")


ROW_KEYS = ("mixer", "size", "parallel", "gpus", "commit", "gpu")


def read_rows(path) -> list[dict]:
    """The rows of a scaling.jsonl (blank lines skipped); a ValueError naming the file (and line) when it cannot be
    read or holds a line that is not a row of ``run``."""
    from kalmix.bench.checks import read_jsonl_rows
    return read_jsonl_rows(path, ROW_KEYS, "not a row of `scaling.py run`",
                           unreadable="give the scaling.jsonl that `run` wrote")


def run(args) -> None:
    out = Path(args.out)
    _check_out(out)
    results = out / "scaling.jsonl"
    done = set()
    if results.exists():
        done = {(r["mixer"], r["size"], r["parallel"], r["gpus"], r.get("rows_per_gpu")) for r in read_rows(results)}
    import torch
    n_gpus = torch.cuda.device_count()
    if max(args.gpus) > n_gpus:
        raise SystemExit(f"scaling.py: --gpus {max(args.gpus)} asked for but {n_gpus} GPU(s) are visible")
    out.mkdir(parents=True, exist_ok=True)
    prepare(out)
    todo = [(m, s, p, g) for s in args.size for p in args.parallel for g in sorted(args.gpus) for m in args.mixers
            if (m, s, p, g, args.rows_per_gpu) not in done]
    commit, gpu = args.commit or _git("rev-parse", "--short", "HEAD"), torch.cuda.get_device_name(0)
    while todo:
        batch, free = [], n_gpus                                    # runs that fit the free GPUs, side by side
        for job in list(todo):
            if job[3] <= free:
                batch.append((job, n_gpus - free))
                free -= job[3]
                todo.remove(job)
        procs = []
        for (mixer, size, parallel, gpus), first in batch:
            run_dir = out / (f"{mixer}-{size}-{parallel}-{gpus}"
                             + (f"-{args.rows_per_gpu}rows" if args.rows_per_gpu else ""))
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(first + i) for i in range(gpus)))
            cmd = _cmd(out, mixer, size, parallel, gpus, args.steps, run_dir, args.profile, args.rows_per_gpu)
            log = open(out / f"{run_dir.name}.log", "w")
            procs.append(((mixer, size, parallel, gpus), run_dir, subprocess.Popen(cmd, stdout=log, stderr=log,
                                                                                   env=env), time.time()))
        for key, run_dir, proc, t0 in procs:
            code = proc.wait()
            row = {"mixer": key[0], "size": key[1], "parallel": key[2], "gpus": key[3],
                   "rows_per_gpu": args.rows_per_gpu, "commit": commit, "gpu": gpu,
                   "wall_s": round(time.time() - t0, 1)}
            try:
                row.update(_summary(run_dir) if code == 0 else {"error": f"exit {code}, see {run_dir.name}.log"})
            except (OSError, RuntimeError, StopIteration) as e:
                row["error"] = str(e)
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    print(table(results))


def table(path) -> str:
    """The markdown table of a scaling.jsonl: one line per run, its efficiency against the one-GPU run of the same
    mixer, size and batch setting (the same parallelism where there is one); "batch" is the global batch in rows,
    or N/GPU for the runs at N rows per GPU."""
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"{path}: no rows (an empty file)")
    one = {(r["mixer"], r["size"], r.get("rows_per_gpu"), r["parallel"]): r for r in rows
           if r["gpus"] == 1 and "tok_s" in r}
    one_any = {(r["mixer"], r["size"], r.get("rows_per_gpu")): r for r in rows if r["gpus"] == 1 and "tok_s" in r}
    lines = ["| mixer | size | params | parallel | batch (rows) | GPUs | tokens/s | scaling efficiency | MFU | "
             "peak memory (GiB) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["size"], r["mixer"], r.get("rows_per_gpu") or 0, r["parallel"],
                                         r["gpus"])):
        per = r.get("rows_per_gpu")
        batch = f"{per}/GPU" if per else "32"
        if "tok_s" not in r:
            lines.append(f"| {r['mixer']} | {r['size']} | | {r['parallel']} | {batch} | {r['gpus']} | {r['error']} "
                         f"| | | |")
            continue
        base = one.get((r["mixer"], r["size"], per, r["parallel"])) or one_any.get((r["mixer"], r["size"], per))
        eff = f"{r['tok_s'] / (r['gpus'] * base['tok_s']):.0%}" if base else "–"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "–"
        lines.append(f"| {r['mixer']} | {r['size']} | {r['params'] / 1e6:.0f}M | {r['parallel']} | {batch} | "
                     f"{r['gpus']} | {r['tok_s']:,.0f} | {eff} | {mfu} | {r['mem_gib']:.1f} |")
    stamp = sorted({(r["commit"], r["gpu"]) for r in rows})
    lines.append("")
    lines.append("Measured at " + "; ".join(f"commit {c} on {g}" for c, g in stamp) + ".")
    return "\n".join(lines)


def _whole(least: int):
    """An argparse type: a whole number >= ``least``."""
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {least}; got {text!r}")
        return int(text)
    return parse


def main(argv=None) -> None:
    from kalmix.layers import ALL_MIXERS
    p = argparse.ArgumentParser(prog="scaling.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("--mixers", nargs="+", choices=sorted(ALL_MIXERS),
                   default=["attention", "gdn", "kaczmarz", "gka", "vla", "kalman"])
    r.add_argument("--gpus", nargs="+", type=_whole(1), default=[1, 2, 4])
    r.add_argument("--parallel", nargs="+", choices=["ddp", "fsdp"], default=["ddp"])
    r.add_argument("--size", nargs="+", choices=list(SIZES), default=["125m"])
    r.add_argument("--steps", type=_whole(1), default=40)
    r.add_argument("--rows-per-gpu", type=_whole(1), default=None, help="the same work per GPU: one micro-batch of this "
                   "many rows on each GPU, rows × GPUs per step (default: the preset's 32 rows per step on any "
                   "number of GPUs, one GPU accumulating micro-batches)")
    r.add_argument("--profile", type=_whole(0), default=0, help="record this many steps of each run with torch.profiler "
                   "(`kalmix train --log.profile`): OUT/<run>/profile/rank<R>.txt, and the rank-0 figures in "
                   "its row")
    r.add_argument("--commit", default=None, help="the commit the rows are stamped with (default: git's HEAD; "
                   "give it where the tree was copied without its history)")
    pr = sub.add_parser("prepare")
    pr.add_argument("out")
    t = sub.add_parser("table")
    t.add_argument("results")
    args = p.parse_args(argv)
    try:
        if args.what == "run":
            run(args)
        elif args.what == "prepare":
            prepare(Path(args.out))
        else:
            print(table(args.results))
    except ValueError as e:
        sub.choices[args.what].error(str(e))


if __name__ == "__main__":
    main()
