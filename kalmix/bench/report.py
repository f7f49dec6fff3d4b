"""`kalmix bench report RESULTS.jsonl ... --out DIR`: markdown tables and PNG plots from ``kalmix bench run`` rows.

Per recipe, per (grid point, mixer, seed) the learning rate with the best validation score is kept (the sweep's
selection, made on validation data only); its test score is then averaged over seeds (mean ± std, n shown). The
paper's number, where the recipe gives one, is printed beside ours in parentheses. Runs that could not be made
here (``unavailable``, ``error``, ``oom``) or diverged are listed with their reason, never silently dropped.

Beside the scores, what tells a reader whether the budget was enough: the budget as a fraction of the paper's;
per mixer and grid point, the seeds that solve the task (``report.solve_at``) and the median step at which they
do; the chosen learning rates, marked where one is at the edge of the swept grid; and for each seed's kept run
how its training ended (stopped early, solved, or still improving over its last 10% of steps).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from collections import Counter, defaultdict

from pydantic import ValidationError

from kalmix.bench.checks import check_given_once, check_out, validation_lines
from kalmix.bench.synthetic import Recipe, load_recipe, read_rows, recipe_names, resolve_recipe, run_key


def load_rows(paths: list[str]) -> list[dict]:
    """The rows of every results file; each must hold at least one and be given once (its rows would count
    twice)."""
    check_given_once(paths, "results file", "its runs would count twice")
    rows = []
    for path in paths:
        if os.path.isdir(path):
            raise ValueError(f"{path!r} is a folder; give the JSONL files `kalmix bench run` wrote")
        if not os.path.exists(path):
            raise FileNotFoundError(f"results file {path!r} does not exist")
        found = read_rows(path)
        if not found:
            raise ValueError(f"{path}: no result rows (an empty file)")
        rows += found
    return rows


PROSE = ("source", "claim", "deviations")     # the recipe's words, which no run key holds


def current(rows: list[dict]) -> tuple[Recipe, list[dict], int]:
    """The recipe as its newest row ran it, the rows that ran that same version, and how many rows ran an earlier
    version (a changed task, model, mixer or protocol: their keys differ). The recipe's ``train.lrs`` and
    ``train.seeds`` are those of the rows kept (runs of one version may have been started with other lists). Where
    the shipped recipe of that name runs this same version, its prose (``PROSE``) replaces the rows': a description
    edited after the runs shows without rerunning them."""
    recipe = Recipe.model_validate(max(rows, key=lambda r: r["time"])["spec"])
    same = [r for r in rows if _ran(recipe, r)]
    if same:
        ran = {"lrs": sorted({r["lr"] for r in same}), "seeds": sorted({r["seed"] for r in same})}
        recipe = Recipe.model_validate(recipe.model_dump() | {"train": recipe.train.model_dump() | ran})
        if recipe.name in recipe_names():
            shipped = load_recipe(resolve_recipe(recipe.name))
            if all(_ran(shipped, r) for r in same):
                recipe = recipe.model_copy(update={f: getattr(shipped, f) for f in PROSE})
    return recipe, same, len(rows) - len(same)


def _ran(recipe: Recipe, row: dict) -> bool:
    """Whether ``row`` is a run of this version of ``recipe`` (its mixer is the recipe's and its key matches)."""
    return row["mixer"] in recipe.mixers and row["key"] == run_key(recipe.at(row["point"]), row["point"],
                                                                   row["mixer"], row["lr"], row["seed"])


def _key(point: dict) -> str:
    return json.dumps(point, sort_keys=True, default=str)


def summarise(recipe: Recipe, rows: list[dict]) -> dict:
    """``{"cells": {(mixer, point_key, length): [per-seed values]}, "failures": [...], "meta": ...}`` from the rows
    of one recipe: per (point, mixer, seed) the run of the best validation score (ties: the smaller lr), kept in
    ``"selected"``. ``"cells"`` holds the recipe's metric, ``"by_metric"`` it and each of ``report.also``."""
    best: dict[tuple, dict] = {}
    failures, ran, devices, steps, swept = [], defaultdict(set), set(), defaultdict(list), defaultdict(set)
    for row in rows:
        if row["status"] != "ok" or row.get("val") is None:
            failures.append(row)
            continue
        swept[(row["mixer"], _key(row["point"]))].add(row["lr"])
        k = (row["mixer"], _key(row["point"]), row["seed"])
        if k not in best or (row["val"], -row["lr"]) > (best[k]["val"], -best[k]["lr"]):
            best[k] = row
    by_metric = {m: defaultdict(list) for m in [recipe.metric, *recipe.report.also]}
    step_s = defaultdict(list)
    for (mixer, pkey, _), row in best.items():
        for length, metrics in row["test"].items():
            for m, cells in by_metric.items():
                cells[(mixer, pkey, int(length))].append(metrics[m])
        ran[mixer].add(row["ran"])
        devices.add(row["device"])
        steps[mixer].append(row["steps_run"])
        step_s[mixer].append(row["train_s"] / row["steps_run"])
    return {"cells": by_metric[recipe.metric], "by_metric": by_metric, "selected": best, "step_s": step_s,
            "rows": rows,
            "swept": swept,
            "failures": failures, "ran": ran, "devices": devices, "steps": steps,
            "seeds": {r["seed"] for r in best.values()}, "lrs": {r["lr"] for r in rows if r["status"] == "ok"},
            "points": {_key(r["point"]): r["point"] for r in rows}}


def _stat(values: list[float]) -> tuple[float, float, int]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0), len(values)


def _axis_value(recipe: Recipe, point: dict, length: int, axis: str):
    return length if axis == "eval_length" else point[axis]


def series(recipe: Recipe, summary: dict, metric: str | None = None) -> dict:
    """{panel: {mixer: {x: (mean, std, n)}}} over the cells of ``metric`` (default: the recipe's); at the training
    length unless x is eval_length."""
    out = defaultdict(lambda: defaultdict(dict))
    rep = recipe.report
    for (mixer, pkey, length), values in summary["by_metric"][metric or recipe.metric].items():
        point = summary["points"][pkey]
        if rep.x != "eval_length" and length != recipe.at(point).task.length():
            continue
        panel = _fmt(point[rep.panel]) if rep.panel else ""
        x = _axis_value(recipe, point, length, rep.x)
        out[panel][mixer][x] = _stat(values)
    return out


def reference_of(recipe: Recipe, mixer: str, panel: str, x) -> float | None:
    rep = recipe.report
    for ref in recipe.references:
        if ref.mixer != mixer or ref.at.get(rep.x) != x:
            continue
        if rep.panel and _fmt(ref.at.get(rep.panel)) != panel:
            continue
        return ref.value
    return None


def min_depths(recipe: Recipe, summary: dict, metric: str | None = None) -> dict:
    """{mixer: {x: smallest depth at which some seed reaches the threshold in ``metric`` (default: the recipe's), or
    None}} (the Kalman paper's rule: solved if at least one seed reaches it), with the depths tried."""
    rep = recipe.report
    solved, tried = defaultdict(dict), defaultdict(lambda: defaultdict(set))
    for (mixer, pkey, length), values in summary["by_metric"][metric or recipe.metric].items():
        point = summary["points"][pkey]
        if length != recipe.at(point).task.length():
            continue
        x, depth = point[rep.x], point[rep.depth]
        tried[mixer][x].add(depth)
        if max(values) >= rep.threshold:
            solved[mixer][x] = min(depth, solved[mixer].get(x, math.inf))
    return {m: {x: (solved[m].get(x), sorted(d)) for x, d in xs.items()} for m, xs in tried.items()}


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _cell(stat, ref, seeds: int) -> str:
    if stat is None:
        text = "–"
    else:
        mean, std, n = stat
        text = f"{100 * mean:.1f}" + (f" ± {100 * std:.1f}" if n > 1 else "") + (f" [{n} of {seeds} seeds]"
                                                                                  if n < seeds else "")
    return text + (f" ({100 * ref:.1f})" if ref is not None else "")


def score_tables(recipe: Recipe, summary: dict, metric: str) -> list[str]:
    """The score tables of one metric, in the recipe's layout."""
    rep, name = recipe.report, metric.replace("_", " ")
    lines = []
    if rep.kind == "min_depth":
        depths = min_depths(recipe, summary, metric)
        xs = sorted({x for d in depths.values() for x in d})
        lines += [f"Fewest {rep.depth.rsplit('.', 1)[-1]} at which a seed reaches {100 * rep.threshold:.0f}% test "
                  f"{name} (— : none of the depths tried)", "",
                  "| mixer | " + " | ".join(f"{rep.x.rsplit('.', 1)[-1]} = {_fmt(x)}" for x in xs) + " |",
                  "|---|" + "---|" * len(xs)]
        for mixer in recipe.mixers:
            if mixer in depths:
                cells = []
                for x in xs:
                    got, tried = depths[mixer].get(x, (None, []))
                    cells.append(str(got) if got is not None else f"— (tried {','.join(map(str, tried))})"
                                 if tried else "")
                lines.append(f"| {mixer} | " + " | ".join(cells) + " |")
        lines.append("")
    else:
        data = series(recipe, summary, metric)
        for panel, by_mixer in sorted(data.items()):
            xs = sorted({x for v in by_mixer.values() for x in v}, key=_sort_key)
            title = f"{rep.panel.rsplit('.', 1)[-1]} = {panel}: " if rep.panel else ""
            lines += [f"{title}test {name} (%), mean ± std over seeds; the paper's number in parentheses", "",
                      "| mixer | " + " | ".join(f"{rep.x.rsplit('.', 1)[-1]} = {_fmt(x)}" for x in xs) + " |",
                      "|---|" + "---|" * len(xs)]
            for mixer in recipe.mixers:
                if mixer in by_mixer:
                    refs = (reference_of(recipe, mixer, panel, x) if metric == recipe.metric else None for x in xs)
                    lines.append(f"| {mixer} | " + " | ".join(
                        _cell(by_mixer[mixer].get(x), ref, len(summary["seeds"])) for x, ref in zip(xs, refs))
                        + " |")
            lines.append("")
    return lines


def solve_step(row: dict, threshold: float) -> int | None:
    """The first evaluated step at which the run's validation metric reached ``threshold`` (None: never)."""
    return next((step for step, _, val in row["history"] if val >= threshold), None)


def tail(row: dict, train, solve_at: float | None = None) -> str:
    """How a run's training ended, from its history [step, mean training loss, validation metric]: "solved"
    (reached ``train.stop_at`` or ``solve_at``), "stopped by patience", or over its last 10% of steps (at least its
    last two evaluations) "flat" or "rising" with both changes: rising if validation gained >= 1 point, or the loss
    fell >= 5% while validation is below 99%. A rising run was cut by the budget."""
    hist = row["history"]
    if not hist:
        return "no evaluation"
    best = max(v for *_, v in hist)
    done = [t for t in (train.stop_at, solve_at) if t is not None]
    if done and best >= min(done):
        return "solved"
    if row["steps_run"] < train.steps:
        return "stopped by patience"
    end_step, end_loss, end_val = hist[-1]
    earlier = [h for h in hist[:-1] if h[0] <= 0.9 * end_step] or hist[:-1]
    if not earlier:
        return "one evaluation"
    _, ref_loss, ref_val = earlier[-1]
    d_val = end_val - ref_val
    d_loss = (end_loss - ref_loss) / abs(ref_loss) if ref_loss else 0.0
    if d_val < 0.01 and (d_loss > -0.05 or end_val >= 0.99):
        return "flat"
    return f"rising ({100 * d_val:+.1f} pts, loss {100 * d_loss:+.0f}%)"


def diagnostics(recipe: Recipe, summary: dict) -> list[str]:
    """Per mixer and grid point: seeds that solve the task within the budget (``report.solve_at``) and their median
    step, the learning rates chosen (edge of the grid marked) and how each seed's kept run ended."""
    solve_at = recipe.report.solve_at
    by_cell = defaultdict(list)
    for (mixer, pkey, seed), row in sorted(summary["selected"].items(), key=lambda kv: str(kv[0][2])):
        by_cell[(mixer, pkey)].append(row)
    point_order = {_key(p): i for i, p in enumerate(recipe.points())}
    head = ["mixer", "grid point"]
    if solve_at is not None:
        head += [f"seeds solving (val {recipe.metric.replace('_', ' ')} ≥ {100 * solve_at:g}%)", "median step"]
    head += ["learning rate chosen (per seed)", "end of each seed's run"]
    lines = ["Training diagnostics (the run kept per seed):", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    order = {m: i for i, m in enumerate(recipe.mixers)}
    for (mixer, pkey), rows in sorted(by_cell.items(), key=lambda kv: (order.get(kv[0][0], len(order)),
                                                                       point_order.get(kv[0][1], len(point_order)))):
        at = recipe.at(summary["points"][pkey])
        cells = [mixer, _fmt_point(summary["points"][pkey])]
        if solve_at is not None:
            steps = [s for s in (solve_step(r, solve_at) for r in rows) if s is not None]
            cells += [f"{len(steps)} of {len(rows)}", f"{statistics.median(steps):,.0f}" if steps else "—"]
        grid = sorted(summary["swept"][(mixer, pkey)])
        chosen = Counter(r["lr"] for r in rows)
        text = ", ".join(f"{lr:g} ×{n}" + (" (edge)" if len(grid) > 1 and lr in (grid[0], grid[-1]) else "")
                         for lr, n in sorted(chosen.items()))
        cells.append(text + (" (the only one)" if len(grid) == 1 else ""))
        cells.append("; ".join(tail(r, at.train, solve_at) for r in rows))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def by_lr(recipe: Recipe, rows: list[dict]) -> list[str]:
    """Every learning rate's runs, not only the best per seed: per mixer, grid point and lr, the seeds that solve
    the task (``report.solve_at``), the test metric (mean ± std over all its seeds, unsolved ones included) at the
    training length and at the longest evaluated length, and how the runs ended. It shows whether the rate kept
    per seed sits inside the grid and how much of a mean comes from seeds that never left a plateau."""
    solve_at, metric = recipe.report.solve_at, recipe.metric
    cells = defaultdict(list)
    for row in rows:
        if row["status"] == "ok" and row.get("val") is not None:
            cells[(row["mixer"], _key(row["point"]), row["lr"])].append(row)
    if not cells:
        return []
    name = metric.replace("_", " ")
    head = ["mixer", "grid point", "lr"] + (["seeds solving"] if solve_at is not None else [])
    long_len = max(int(n) for runs in cells.values() for r in runs for n in r["test"])
    head += [f"test {name} (%) at the training length", f"at {long_len}", "ends"]
    lines = ["Every learning rate (all seeds, unsolved ones included):", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    order = {m: i for i, m in enumerate(recipe.mixers)}
    for (mixer, pkey, lr), runs in sorted(cells.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0][1],
                                                                          kv[0][2])):
        point = json.loads(pkey)
        at = recipe.at(point)
        out = [mixer, _fmt_point(point), f"{lr:g}"]
        if solve_at is not None:
            out.append(f"{sum(solve_step(r, solve_at) is not None for r in runs)} of {len(runs)}")
        for length in (at.task.length(), long_len):
            vals = [r["test"][str(length)][metric] for r in runs if str(length) in r["test"]]
            out.append(_cell(_stat(vals), None, len(vals)) if vals else "–")
        ends = Counter(tail(r, at.train, solve_at).split(" (")[0] for r in runs)
        out.append(", ".join(f"{n} {e}" for e, n in sorted(ends.items(), key=lambda kv: -kv[1])))
        lines.append("| " + " | ".join(out) + " |")
    return lines + [""]


def _fmt_point(point: dict) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]} = {_fmt(v)}" for k, v in point.items()) or "–"


def markdown(recipe: Recipe, summary: dict, image: str | None) -> str:
    lines = [f"### {recipe.paper}: {recipe.name}", "", f"**Claim** ({recipe.source}): {recipe.claim}", ""]
    if recipe.deviations:
        lines += [f"**Here**: {recipe.deviations}", ""]
    budgets = {recipe.at(p).budget_line() for p in summary["points"].values()} or {recipe.budget_line()}
    lines += [f"**Budget** per grid point: {b}" for b in sorted(budgets)] + [""]
    for metric in [recipe.metric, *recipe.report.also]:
        lines += score_tables(recipe, summary, metric)
    if summary["selected"]:
        lines += diagnostics(recipe, summary)
    if len(summary["lrs"]) > 1:
        lines += by_lr(recipe, summary["rows"])
    runs = [f"{m} ({'; '.join(sorted(r))}): {_span(summary['steps'][m])} steps, "
            f"{1000 * statistics.fmean(summary['step_s'][m]):.0f} ms/step" for m, r in summary["ran"].items()]
    lines += [f"Ran on {', '.join(sorted(summary['devices']))}; seeds {sorted(summary['seeds'])}, learning rates "
              f"{sorted(summary['lrs'])} (the best on validation kept).", ""]
    lines += [f"- {r}" for r in runs]
    done = {(m, p) for m, p, _ in summary["cells"]}
    failures = [r for r in summary["failures"] if (r["mixer"], _key(r["point"])) not in done]
    if failures:
        lines += ["", "Without a result:"]
        seen = set()
        for row in failures:
            text = f"{row['mixer']} at {_key(row['point'])}: {row['status']}" + (
                f" ({row['reason']})" if row.get("reason") else "")
            if text not in seen:
                seen.add(text)
                lines.append(f"- {text}")
    if summary.get("stale"):
        lines += ["", f"({summary['stale']} rows from earlier versions of this recipe are not counted.)"]
    if image:
        lines += ["", f"![{recipe.name}]({image})"]
    return "\n".join(lines) + "\n"


def _span(values: list[int]) -> str:
    return f"{min(values)}" if min(values) == max(values) else f"{min(values)}–{max(values)}"


def _sort_key(x):
    return (0, x) if isinstance(x, (int, float)) else (1, str(x))


def plot(recipe: Recipe, summary: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rep = recipe.report
    if rep.kind == "min_depth":
        depths = min_depths(recipe, summary)
        top = max(max(tried) for by_x in depths.values() for _, tried in by_x.values()) + 1
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for i, (mixer, by_x) in enumerate(depths.items()):
            xs = sorted(by_x)
            ys = [by_x[x][0] if by_x[x][0] is not None else top for x in xs]
            ax.plot(xs, [y + 0.06 * (i - len(depths) / 2) for y in ys], marker="o", label=mixer)
        ax.set_xscale("log", base=2)
        xs = sorted({x for by_x in depths.values() for x in by_x})
        ax.set_xticks(xs, [_fmt(x) for x in xs])
        ax.minorticks_off()
        ax.set_yticks(range(1, top + 1), [str(d) for d in range(1, top)] + [f"none ≤ {top - 1}"])
        ax.set_ylim(0.5, top + 0.5)
        ax.set_xlabel(rep.x.rsplit(".", 1)[-1])
        ax.set_ylabel(f"fewest {rep.depth.rsplit('.', 1)[-1]} reaching {100 * rep.threshold:.0f}%")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(recipe.name, fontsize=10)
    else:
        data = series(recipe, summary)
        panels = sorted(data)
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 1, 3.8), squeeze=False)
        for ax, panel in zip(axes[0], panels):
            for i, mixer in enumerate(m for m in recipe.mixers if m in data[panel]):
                pts = data[panel][mixer]
                xs = sorted(pts, key=_sort_key)
                pos = list(range(len(xs))) if rep.kind == "table" else xs
                means = [100 * pts[x][0] for x in xs]
                stds = [100 * pts[x][1] for x in xs]
                line = ax.errorbar(pos, means, yerr=stds, marker="o", capsize=3, label=mixer)
                refs = [(p, reference_of(recipe, mixer, panel, x)) for p, x in zip(pos, xs)]
                refs = [(p, 100 * r) for p, r in refs if r is not None]
                if refs:
                    ax.plot(*zip(*refs), linestyle="none", marker="x", markersize=8, color=line[0].get_color())
                if rep.kind == "table":
                    ax.set_xticks(pos, [_fmt(x) for x in xs], rotation=30, ha="right", fontsize=8)
            if rep.log_x and rep.kind != "table":
                ax.set_xscale("log", base=2)
                ticks = sorted({x for m in data[panel].values() for x in m})
                ax.set_xticks(ticks, [_fmt(x) for x in ticks])
                ax.minorticks_off()
            ax.set_xlabel(rep.x.rsplit(".", 1)[-1])
            ax.set_ylabel(f"test {recipe.metric.replace('_', ' ')} (%)")
            ax.set_ylim(-2, 102)
            ax.grid(alpha=0.3)
            ax.set_title(f"{rep.panel.rsplit('.', 1)[-1]} = {panel}" if rep.panel else recipe.name, fontsize=10)
        axes[0][-1].legend(fontsize=8, title="x: paper", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(paths: list[str], out_dir: str) -> str:
    """Write ``out_dir/README.md`` and one PNG per recipe; returns the markdown."""
    check_out(out_dir, folder=True)
    rows = load_rows(paths)
    by_recipe = defaultdict(list)
    for row in rows:
        by_recipe[row["recipe"]].append(row)
    versions = {}
    for name, rs in by_recipe.items():
        try:
            versions[name] = current(rs)
        except ValidationError as e:
            raise ValueError(f"recipe {name}: the recipe its newest row ran is not valid here: "
                             f"{'; '.join(validation_lines(e))}") from None
    os.makedirs(out_dir, exist_ok=True)
    parts = []
    for name, (recipe, rs, stale) in versions.items():
        summary = summarise(recipe, rs)
        summary["stale"] = stale
        image = None
        if summary["cells"]:
            image = f"{name}.png"
            plot(recipe, summary, os.path.join(out_dir, image))
        parts.append(markdown(recipe, summary, image))
    text = "# kalmix bench results\n\n" + "\n".join(parts)
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(text)
    return text
