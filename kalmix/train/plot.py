"""`kalmix plot RUN...`: the loss curves of several training runs on one PNG, read from their metrics.jsonl."""
from __future__ import annotations

import json
from pathlib import Path

from kalmix.bench.checks import check_given_once, check_out


# the fields ``plot_runs`` reads from each kind of row
_FIELDS = {"train": ("step", "loss"), "eval": ("step", "val_loss", "loss_by_position")}


def read_metrics(run: str | Path) -> list[dict]:
    """The rows of ``RUN/metrics.jsonl`` (or of the file itself); a clear error if there is none, if a line is not
    a JSON object or lacks what the plot reads, or if no training or evaluation has been logged yet."""
    path = Path(run)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{run}: no metrics.jsonl (a kalmix train run directory or its metrics file)")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON line ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{i}: not a JSON object")
            missing = [k for k in _FIELDS.get(row.get("kind"), ()) if k not in row]
            if missing:
                raise ValueError(f"{path}:{i}: a {row['kind']} row without {', '.join(missing)}")
            rows.append(row)
    if not any(r.get("kind") in _FIELDS for r in rows):
        raise ValueError(f"{path}: no train or eval rows yet (a run logs them every log.every / eval.every steps)")
    return rows


def _label(run: str | Path, rows: list[dict]) -> str:
    start = next((r for r in rows if r.get("kind") == "start"), {})
    mixers = start.get("mixers")
    if mixers:
        names = sorted(set(mixers), key=mixers.index)
        return f"{Path(run).name} ({'+'.join(names)}, {start.get('params', 0) / 1e6:.0f}M)"
    return Path(run).name


def plot_runs(runs: list[str], out: str, x: str = "step", log_y: bool = False) -> str:
    """Draw train loss (lines), validation loss (markers) and the last validation's loss by position of each
    run; returns the PNG's path. ``x``: "step" or "tokens" (the tokens seen)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backend_bases import FigureCanvasBase

    if x not in ("step", "tokens"):
        raise ValueError(f"x must be 'step' or 'tokens', got {x!r}")
    check_out(out)
    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(out).suffix[1:].lower() not in formats:
        raise ValueError(f"out {out!r}: the file's suffix names its format, one of {', '.join(sorted(formats))}")
    check_given_once(runs, "run", "its curves would be drawn twice")
    metrics = [read_metrics(run) for run in runs]        # every run checked before drawing
    if x == "tokens":
        for run, rows in zip(runs, metrics):
            if not any(r.get("kind") == "start" and r.get("tokens_per_step") for r in rows):
                raise ValueError(f"{run}: --x tokens needs the tokens_per_step of the run's start row, which its "
                                 f"metrics.jsonl lacks; plot it with --x step")
    fig, (ax, axp) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, (run, rows) in enumerate(zip(runs, metrics)):
        color = f"C{i % 10}"
        label = _label(run, rows)
        # a resumed run logs the steps after its checkpoint again: the later row of a step wins
        train = sorted({r["step"]: r for r in rows if r.get("kind") == "train"}.values(), key=lambda r: r["step"])
        evals = sorted({r["step"]: r for r in rows if r.get("kind") == "eval"}.values(), key=lambda r: r["step"])
        per_step = next((r["tokens_per_step"] for r in rows if r.get("kind") == "start" and
                         "tokens_per_step" in r), None)
        scale = per_step if (x == "tokens" and per_step) else 1
        if train:
            ax.plot([r["step"] * scale for r in train], [r["loss"] for r in train], color=color, lw=1.2, label=label)
        if evals:
            ax.plot([r["step"] * scale for r in evals], [r["val_loss"] for r in evals], "o", color=color, ms=4)
            buckets = [b for b in evals[-1]["loss_by_position"] if b["loss"] is not None]
            axp.plot([(b["from"] + b["to"]) / 2 for b in buckets], [b["loss"] for b in buckets], "o-",
                     color=color, label=f"{label}, step {evals[-1]['step']}")
    ax.set_xlabel("tokens" if x == "tokens" else "optimizer step")
    ax.set_ylabel("loss (nats/token); dots: validation")
    ax.set_title("training loss")
    axp.set_xlabel("position of the predicted token in its document")
    axp.set_ylabel("validation loss")
    axp.set_title("validation loss by position")
    for a in (ax, axp):
        a.grid(alpha=0.3)
        if log_y:
            a.set_yscale("log")
    for a in (ax, axp):
        if a.lines:
            a.legend(fontsize=8)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
