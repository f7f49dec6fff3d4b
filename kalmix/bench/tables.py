"""The generated tables of the README and the docs, and the commands that print them from committed results.

Every table of README.md and docs/ that reports a measurement sits between two markers::

    <!-- table: COMMAND -->
    ...COMMAND's output: the table, then the commit and GPU that produced its rows...
    <!-- /table -->

COMMAND is ``python -m MODULE ARGS``, ``python FILE.py ARGS`` or ``kalmix ARGS`` on result files committed under
docs/results/; it runs in this process from the repository root (an argument holding ``*`` is expanded as the shell
would), and its standard output is the block's content.

    python -m kalmix.bench.tables update             # rewrite every block from its command
    python -m kalmix.bench.tables update --check     # exit 1 naming each block that differs from its command's output
    python -m kalmix.bench.tables speed CSV [--modes fwd fwdbwd] [--ratio-to OP]   # op timings of `kalmix speed`
    python -m kalmix.bench.tables train RUN_DIR ... [--commit C] [--gpu G]         # `kalmix train` runs side by side
    python -m kalmix.bench.tables recipe RESULTS.jsonl ...                         # `kalmix bench run` score tables
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import difflib
import glob
import importlib
import io
import json
import os
import re
import runpy
import shlex
import shutil
import statistics
import sys
import tempfile
from collections import Counter, defaultdict

from kalmix.train.plot import read_metrics

BLOCK = re.compile(r"^<!-- table: (?P<command>.+?) -->\n(?P<body>.*?)^<!-- /table -->$", re.S | re.M)
OPEN, CLOSE = "<!-- table:", "<!-- /table -->"        # markers count only at the start of a line
DOCS = ("README.md", "docs/**/*.md")          # the files `update` reads, relative to the repository root
REPORTS = {"docs/results/bench/report": "docs/results/bench/*.jsonl"}   # `kalmix bench report` folders: their rows
MODE_NAMES = {"fwd": "fwd", "fwdbwd": "fwd+bwd", "decode": "decode"}


# ---- the blocks -----------------------------------------------------------------------------------------------

def run_command(command: str, root: str) -> str:
    """The standard output of a table COMMAND, run in this process with ``root`` as the working directory:
    ``python -m M ARGS`` calls ``M.main(ARGS)``, ``python F.py ARGS`` runs the file as ``__main__`` with ARGS in
    ``sys.argv``, ``kalmix ARGS`` is ``python -m kalmix.cli ARGS``."""
    words = shlex.split(command)
    if words[:1] == ["kalmix"]:
        words = ["python", "-m", "kalmix.cli", *words[1:]]
    if words[:2] == ["python", "-m"] and len(words) > 2:
        target, args = words[2], words[3:]
        main = getattr(importlib.import_module(target), "main", None)
        if not callable(main):
            raise ValueError(f"table command {command!r}: {target} has no main(argv) to call")

        def run():
            sys.exit(main(sys.argv[1:]))
    elif words[:1] == ["python"] and len(words) > 1 and words[1].endswith(".py"):
        target, args = words[1], words[2:]

        def run():
            runpy.run_path(target, run_name="__main__")
    else:
        raise ValueError(f"table command {command!r}: it must start with `python -m MODULE`, `python FILE.py` "
                         "or `kalmix`")
    out, argv = io.StringIO(), sys.argv
    with contextlib.chdir(root):
        expanded = []
        for a in args:
            found = sorted(glob.glob(a)) if "*" in a else [a]
            if not found:
                raise ValueError(f"table command {command!r}: {a!r} matches no file")
            expanded += found
        sys.argv = [target, *expanded]
        try:
            with contextlib.redirect_stdout(out):
                run()
        except SystemExit as e:
            if e.code not in (None, 0):
                raise ValueError(f"table command {command!r} failed: {e.code}") from None
        finally:
            sys.argv = argv
    return out.getvalue()


def blocks(text: str, name: str) -> list[re.Match]:
    """The table blocks of one file; an opening marker without its closing one is an error naming its line."""
    found = list(BLOCK.finditer(text))
    opens = [m.start() for m in re.finditer("^" + re.escape(OPEN), text, re.M)]
    starts = {m.start() for m in found}
    for pos in opens:
        if pos not in starts:
            line = text.count("\n", 0, pos) + 1
            raise ValueError(f"{name}:{line}: `{OPEN} COMMAND -->` must be one line followed by the table and a "
                             f"`{CLOSE}` line")
    return found


def update(root: str = ".", check: bool = False, files: list[str] | None = None) -> list[str]:
    """Regenerate every table block of ``files`` (default: README.md and docs/**/*.md under ``root``) and, without
    ``files``, the ``kalmix bench report`` folders of ``REPORTS``. Returns one entry per block or report whose
    content differed from its command's output (``file:line: command`` and the first lines of the difference); with
    ``check`` nothing is written."""
    paths = files or [p for pattern in DOCS for p in sorted(glob.glob(os.path.join(root, pattern), recursive=True))]
    stale = [] if files else [s for out, rows in REPORTS.items() if (s := _update_report(root, out, rows, check))]
    for path in paths:
        name = os.path.relpath(path, root)
        with open(path) as f:
            text = f.read()
        parts, last = [], 0
        for m in blocks(text, name):
            body = run_command(m["command"], root).rstrip("\n") + "\n"
            if body != m["body"]:
                line = text.count("\n", 0, m.start()) + 1
                diff = difflib.unified_diff(m["body"].splitlines(), body.splitlines(), "committed", "generated",
                                            n=0, lineterm="")
                stale.append(f"{name}:{line}: {m['command']}\n" + "\n".join(list(diff)[2:12]))
            parts += [text[last:m.start("body")], body]
            last = m.end("body")
        new = "".join(parts) + text[last:]
        if new != text and not check:
            with open(path, "w") as f:
                f.write(new)
    return stale


def _update_report(root: str, out: str, rows: str, check: bool) -> str | None:
    """Rewrite the report folder ``out`` from the rows ``rows`` (a glob) where its README.md differs from
    ``kalmix bench report``'s; the difference, or None."""
    from kalmix.bench import report
    paths = sorted(glob.glob(os.path.join(root, rows)))
    if not paths:
        raise ValueError(f"the bench report {out} is made from {rows}, which matches no file")
    with tempfile.TemporaryDirectory() as tmp:
        text = report.report(paths, tmp)
        path = os.path.join(root, out, "README.md")
        old = open(path).read() if os.path.exists(path) else ""
        if text == old:
            return None
        if not check:
            shutil.copytree(tmp, os.path.join(root, out), dirs_exist_ok=True)
    diff = difflib.unified_diff(old.splitlines(), text.splitlines(), "committed", "generated", n=0, lineterm="")
    return f"{out}/README.md: kalmix bench report {rows} --out {out}\n" + "\n".join(list(diff)[2:12])


# ---- the tables ------------------------------------------------------------------------------------------------

def speed_table(path: str, modes: list[str], dtype: str = "bf16", ratio_to: str | None = None) -> str:
    """Milliseconds per call (p50) of a ``kalmix speed`` CSV: one row per (op, impl) in the CSV's order, one column
    per sequence length and mode, and with ``ratio_to`` the last mode's time over that op's at each length."""
    rows = [r for r in _csv_rows(path) if r["dtype"] == dtype and r["mode"] in modes]
    if not rows:
        raise ValueError(f"{path}: no {dtype} rows of mode(s) {', '.join(modes)}")
    seq_lens = sorted({int(r["T"]) for r in rows})
    cell = {(r["op"], r["impl"], int(r["T"]), r["mode"]): r for r in rows}
    ops = list(dict.fromkeys((r["op"], r["impl"]) for r in rows))
    names = sorted({op for op, _ in ops})
    if ratio_to is not None and ratio_to not in names:
        raise ValueError(f"--ratio-to {ratio_to!r}: not an op of {path}; it has {', '.join(names)}")
    head = ["op (impl)"]
    for T in seq_lens:
        head += [f"{MODE_NAMES[m]} T={T}" for m in modes] + ([f"÷ {ratio_to}"] if ratio_to else [])
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for op, impl in ops:
        cells = [f"{op} ({impl})"]
        for T in seq_lens:
            for m in modes:
                r = cell.get((op, impl, T, m))
                cells.append("" if r is None else f"{float(r['ms_p50']):.3f}" if r["status"] == "ok" else r["status"])
            if ratio_to:
                ref = [r for (o, _, t, m), r in cell.items() if o == ratio_to and t == T and m == modes[-1]]
                r = cell.get((op, impl, T, modes[-1]))
                ok = r is not None and ref and r["status"] == ref[0]["status"] == "ok"
                cells.append(f"{float(r['ms_p50']) / float(ref[0]['ms_p50']):.2f}" if ok else "")
        lines.append("| " + " | ".join(cells) + " |")
    tokens = sorted({int(r["tokens"]) for r in rows})
    runs = sorted({(r["git"], r["device_name"], r["torch"], r["triton"], r["fla"]) for r in rows})
    lines += ["", f"ms per call (p50), {dtype}, {' / '.join(f'{t:,}' for t in tokens)} tokens per call. Measured at "
              + "; ".join(f"commit {g} on {d} (torch {t}, triton {tr}, fla {f})" for g, d, t, tr, f in runs) + "."]
    return "\n".join(lines)


def _csv_rows(path: str) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    need = {"op", "impl", "mode", "dtype", "T", "tokens", "ms_p50", "status", "git", "device_name", "torch",
            "triton", "fla"}
    if not rows or need - set(rows[0]):
        raise ValueError(f"{path}: not a `kalmix speed` CSV (it needs the columns {', '.join(sorted(need))})")
    return rows


def _per_run(what: str, values: list[str], names: list[str]) -> dict[str, str]:
    """``--commit``/``--gpu`` values -> {run name: value}: ``RUN=VALUE`` names one run, a bare ``VALUE`` every other."""
    default, named = None, {}
    for value in values:
        run, eq, v = value.partition("=")
        if not eq:
            if default is not None:
                raise ValueError(f"--{what}: two values for every run ({default!r}, {value!r}); name a run as RUN=VALUE")
            default = value
        elif run not in names:
            raise ValueError(f"--{what} {value!r}: no run named {run!r} among {', '.join(names)}")
        else:
            named[run] = v
    return {n: named.get(n, default) for n in names}


def train_table(run_dirs: list[str], commit: list[str] | None = None, gpu: list[str] | None = None,
                throughput_only: bool = False) -> str:
    """One row per ``kalmix train`` run (named by its folder): parameters, the processes and GPU that ran it, the
    last validation loss and perplexity, tokens/s and MFU (the mean of the logged training windows after the first,
    which holds compilation and warm-up) and the peak memory. Each run's commit and GPU come from its metrics.jsonl
    where its start rows record them (``versions``), else from ``commit``/``gpu``: values ``VALUE`` (every such run)
    or ``RUN=VALUE`` (the run of that folder name)."""
    head = ["run", "params", "GPUs"] + ([] if throughput_only else ["val loss", "val ppl"]) + [
        "tokens/s", "MFU", "peak GiB"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    given_commit, given_gpu = _per_run("commit", commit or [], names), _per_run("gpu", gpu or [], names)
    steps, commits = set(), defaultdict(list)
    for run_dir, name in zip(run_dirs, names):
        path = os.path.join(run_dir, "metrics.jsonl")
        rows = read_metrics(run_dir)
        starts = [r for r in rows if r.get("kind") == "start"]
        train = [r for r in rows if r.get("kind") == "train"]
        evals = [r for r in rows if r.get("kind") == "eval"]
        if not starts or len(train) < 2 or (not evals and not throughput_only):
            raise ValueError(f"{path}: needs a start row, two logged training windows and, for the validation "
                             f"columns, an evaluation (it has {len(train)} windows, {len(evals)} evaluations)")
        for key in ("mfu", "mem_gib"):
            if any(r.get(key) is None for r in train):
                why = "a CPU run, or a GPU of unknown peak without log.peak_tflops" if key == "mfu" else "a CPU run"
                raise ValueError(f"{path}: its training windows record no {key} ({why}); the table is of GPU runs")
        recorded = [s["versions"] for s in starts if s.get("versions")]
        devices = sorted({v["device_name"].removeprefix("NVIDIA ") for v in recorded}) or [given_gpu[name]]
        shas = sorted({v["git"] for v in recorded if v.get("git")}) or [given_commit[name]]
        if None in devices or None in shas:
            missing = "--gpu" if None in devices else "--commit"
            raise ValueError(f"{path}: its start rows record no {missing[2:]}; give {missing} VALUE or "
                             f"{missing} {name}=VALUE")
        for sha in shas:
            commits[sha].append(name)
        timed = train[1:]
        worlds = sorted({s.get("world_size", "?") for s in starts}, key=str)
        cells = [name, f"{starts[0]['params'] / 1e6:.1f}M", f"{'/'.join(map(str, worlds))} × {', '.join(devices)}"]
        if not throughput_only:
            cells += [f"{evals[-1]['val_loss']:.3f}", f"{evals[-1]['val_ppl']:.1f}"]
        cells += [f"{statistics.fmean(r['tok_s'] for r in timed):,.0f}",
                  f"{100 * statistics.fmean(r['mfu'] for r in timed):.1f}%", f"{max(r['mem_gib'] for r in train):.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
        steps.add((train[-1]["step"], starts[0]["tokens_per_step"]))
    runs = "; ".join(f"{s} steps of {t:,} tokens" for s, t in sorted(steps))
    if len(commits) == 1:
        which = f"Commit {next(iter(commits))}"
    else:
        which = "Commits " + "; ".join(f"{sha} ({', '.join(ns)})" for sha, ns in commits.items())
    lines += ["", f"{runs}; GPUs: processes × GPU; tokens/s (of all processes) and MFU: the mean of the logged "
              f"windows after the first. {which}."]
    return "\n".join(lines)


def recipe_tables(paths: list[str]) -> str:
    """The score tables of ``kalmix bench report`` for the recipes in ``paths``, each stamped with the commits,
    GPUs and versions of the rows it counts and the number of rows that recorded no result, by status."""
    from kalmix.bench import report
    by_recipe = defaultdict(list)
    for row in report.load_rows(paths):
        by_recipe[row["recipe"]].append(row)
    out = []
    for rows in by_recipe.values():
        recipe, rows, _ = report.current(rows)
        summary = report.summarise(recipe, rows)
        lines = report.score_tables(recipe, summary, recipe.metric)
        if len(summary["lrs"]) > 1:
            lines += report.by_lr(recipe, rows)
        runs = sorted({(r["git"], r["device"], r["torch"], r["triton"]) for r in rows})
        failed = Counter(r["status"] for r in summary["failures"])
        lines.append(f"{recipe.name}: " + "; ".join(f"commit {g} on {d} (torch {t}, triton {tr})"
                                                    for g, d, t, tr in runs) + "."
                     + (f" Rows recording no result: {', '.join(f'{n} {s}' for s, n in sorted(failed.items()))}."
                        if failed else ""))
        out.append("\n".join(lines))
    return "\n\n".join(out)


# ---- the command line ------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kalmix.bench.tables", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    u = sub.add_parser("update", help="regenerate every table block of README.md and docs/ from its command")
    u.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each block that differs")
    u.add_argument("--root", default=".", help="the repository root")
    s = sub.add_parser("speed", help="ms per call of a `kalmix speed` CSV")
    s.add_argument("csv")
    s.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=list(MODE_NAMES))
    s.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    s.add_argument("--ratio-to", default=None, metavar="OP", help="add the last mode's time over this op's")
    t = sub.add_parser("train", help="`kalmix train` runs side by side")
    t.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    t.add_argument("--commit", nargs="+", metavar="[RUN=]COMMIT", help="for runs whose metrics.jsonl records none: "
                   "the commit that ran them or, where that is unknown, the one that added their rows")
    t.add_argument("--gpu", nargs="+", metavar="[RUN=]GPU", help="for runs whose metrics.jsonl records none: the GPU "
                   "they ran on")
    t.add_argument("--throughput-only", action="store_true", help="leave out the validation columns")
    r = sub.add_parser("recipe", help="the score tables of `kalmix bench run` results")
    r.add_argument("results", nargs="+", metavar="RESULTS.jsonl")
    args = p.parse_args(argv)
    try:
        if args.what == "update":
            stale = update(args.root, check=args.check)
            for entry in stale:
                print(entry if args.check else "rewrote " + entry.split("\n")[0], file=sys.stderr)
            if args.check and stale:
                print(f"{len(stale)} table(s) differ from their commands' output; run `python -m kalmix.bench.tables "
                      "update`", file=sys.stderr)
                return 1
        elif args.what == "speed":
            print(speed_table(args.csv, args.modes, args.dtype, args.ratio_to))
        elif args.what == "train":
            print(train_table(args.run_dirs, args.commit, args.gpu, args.throughput_only))
        else:
            print(recipe_tables(args.results))
    except (OSError, ValueError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
