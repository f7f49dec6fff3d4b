"""`python -m kalmix.bench.tables`: the generated tables of README.md and docs/ equal their commands' output on the
committed results, a stale or broken block is named, and the table commands read their files or say why not."""
import csv
import glob
import json
import os

import pytest

from kalmix.bench import tables

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEED_COLUMNS = ["op", "impl", "kind", "mode", "dtype", "B", "T", "tokens", "ms_p50", "status", "torch", "device_name",
                 "triton", "fla", "git"]


def test_committed_tables_match_their_commands():
    """Every marked table of README.md and docs/, and the bench report, is its command's output on docs/results."""
    assert tables.update(ROOT, check=True) == []


def test_readme_and_docs_have_their_generated_tables():
    blocks = {}
    for name in ["README.md", "docs/speed.md", "docs/results.md", "docs/training.md", "docs/multigpu.md"]:
        with open(os.path.join(ROOT, name)) as f:
            blocks[name] = [m["command"] for m in tables.blocks(f.read(), name)]
    assert len(blocks["README.md"]) >= 3 and all(blocks.values())
    results = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs/results/bench/**/*.jsonl"),
                                                                   recursive=True))
    shown = " ".join(blocks["docs/results.md"])
    assert results and [r for r in results if r not in shown] == []     # every committed recipe result has its table


def _speed_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, SPEED_COLUMNS)
        w.writeheader()
        for op, impl, mode, T, ms, status in rows:
            w.writerow({"op": op, "impl": impl, "kind": "op", "mode": mode, "dtype": "bf16", "B": 32768 // T, "T": T,
                        "tokens": 32768, "ms_p50": ms, "status": status, "torch": "2.11", "device_name": "GPU X",
                        "triton": "3.6", "fla": "0.6.0", "git": "abc1234"})


ROWS = [("mine", "triton", "fwd", 2048, 1.0, "ok"), ("mine", "triton", "fwdbwd", 2048, 3.0, "ok"),
        ("ref", "fla", "fwd", 2048, 0.5, "ok"), ("ref", "fla", "fwdbwd", 2048, 2.0, "ok"),
        ("mine", "triton", "fwdbwd", 4096, float("nan"), "OOM"), ("ref", "fla", "fwdbwd", 4096, 2.5, "ok")]


def test_speed_table(tmp_path):
    path = tmp_path / "speed.csv"
    _speed_csv(path, ROWS)
    text = tables.speed_table(str(path), ["fwd", "fwdbwd"], ratio_to="ref")
    lines = text.splitlines()
    assert lines[0] == ("| op (impl) | fwd T=2048 | fwd+bwd T=2048 | ÷ ref | fwd T=4096 | fwd+bwd T=4096 | ÷ ref |")
    assert lines[2] == "| mine (triton) | 1.000 | 3.000 | 1.50 |  | OOM |  |"
    assert lines[3] == "| ref (fla) | 0.500 | 2.000 | 1.00 |  | 2.500 | 1.00 |"
    assert lines[-1] == ("ms per call (p50), bf16, 32,768 tokens per call. Measured at commit abc1234 on GPU X (torch "
                         "2.11, triton 3.6, fla 0.6.0).")


def test_speed_table_refuses_what_it_cannot_read(tmp_path):
    path = tmp_path / "speed.csv"
    _speed_csv(path, ROWS)
    with pytest.raises(ValueError, match=r"--ratio-to 'nope': not an op of .*; it has mine, ref"):
        tables.speed_table(str(path), ["fwd"], ratio_to="nope")
    with pytest.raises(ValueError, match=r"no fp32 rows of mode\(s\) fwd"):
        tables.speed_table(str(path), ["fwd"], dtype="fp32")
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a `kalmix speed` CSV"):
        tables.speed_table(str(other), ["fwd"])


def _run_dir(path, tok_s, val_loss=None, versions=None, world_size=1):
    os.makedirs(path)
    rows = [{"kind": "start", "step": 0, "params": 1_500_000, "tokens_per_step": 4096, "world_size": world_size}]
    if versions is not None:
        rows[0]["versions"] = versions
    rows += [{"kind": "train", "step": 10 * (i + 1), "loss": 5.0, "tok_s": t, "mfu": t / 1e6, "mem_gib": 1.0 + i}
             for i, t in enumerate(tok_s)]
    if val_loss is not None:
        rows.append({"kind": "eval", "step": 10 * len(tok_s), "val_loss": val_loss, "val_ppl": 2.718 ** val_loss,
                     "loss_by_position": []})
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_train_table_averages_the_windows_after_the_first(tmp_path):
    _run_dir(tmp_path / "gka", [10.0, 2000.0, 4000.0], val_loss=3.0)
    lines = tables.train_table([str(tmp_path / "gka")], ["abc1234"], ["GPU X"]).splitlines()
    assert lines[2] == "| gka | 1.5M | 1 × GPU X | 3.000 | 20.1 | 3,000 | 0.3% | 3.0 |"
    assert lines[-1].startswith("30 steps of 4,096 tokens; ") and lines[-1].endswith("Commit abc1234.")
    lines = tables.train_table([str(tmp_path / "gka")], ["abc1234"], ["GPU X"], throughput_only=True).splitlines()
    assert lines[0] == "| run | params | GPUs | tokens/s | MFU | peak GiB |"


def test_train_table_reads_each_runs_commit_and_gpu(tmp_path):
    """Runs that record their commit and GPU need neither option; others take theirs from RUN=VALUE or VALUE."""
    _run_dir(tmp_path / "new", [1.0, 2.0], 2.0, versions={"device_name": "NVIDIA H200", "git": "1234abc"})
    _run_dir(tmp_path / "old", [1.0, 2.0], 2.0, world_size=4)
    _run_dir(tmp_path / "older", [1.0, 2.0], 2.0)
    runs = [str(tmp_path / n) for n in ("new", "old", "older")]
    lines = tables.train_table(runs, ["old=0ldc0mm", "defa017"], ["old=H100", "A100"]).splitlines()
    assert lines[2].startswith("| new | 1.5M | 1 × H200 |")
    assert lines[3].startswith("| old | 1.5M | 4 × H100 |") and lines[4].startswith("| older | 1.5M | 1 × A100 |")
    assert lines[-1].endswith("Commits 1234abc (new); 0ldc0mm (old); defa017 (older).")
    assert tables.train_table(runs[:1]).splitlines()[-1].endswith("Commit 1234abc.")
    with pytest.raises(ValueError, match="record no gpu; give --gpu VALUE or --gpu old=VALUE"):
        tables.train_table(runs[1:], ["c"], ["older=H100"])
    with pytest.raises(ValueError, match="--commit 'nope=1': no run named 'nope' among new, old, older"):
        tables.train_table(runs, ["nope=1"], ["g"])
    with pytest.raises(ValueError, match="--gpu: two values for every run"):
        tables.train_table(runs, ["c"], ["g", "h"])


def test_train_table_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        tables.train_table([str(tmp_path)], ["c"], ["g"])
    _run_dir(tmp_path / "short", [10.0, 20.0])
    with pytest.raises(ValueError, match="an evaluation .it has 2 windows, 0 evaluations"):
        tables.train_table([str(tmp_path / "short")], ["c"], ["g"])


def test_train_table_names_the_line_it_cannot_read(tmp_path):
    """A metrics.jsonl cut off mid-line (a run killed while writing) or holding a line that is not an object: the
    file and line, not json's bare message or an AttributeError traceback."""
    _run_dir(tmp_path / "cut", [10.0, 20.0], 2.0)
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')
    with pytest.raises(ValueError, match=r"cut.metrics.jsonl:5: not a JSON line \(Unterminated string"):
        tables.train_table([str(tmp_path / "cut")], ["c"], ["g"])
    os.makedirs(tmp_path / "list")
    (tmp_path / "list" / "metrics.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"list.metrics.jsonl:1: not a JSON object"):
        tables.train_table([str(tmp_path / "list")], ["c"], ["g"])


def test_train_table_refuses_a_cpu_run(tmp_path):
    """A CPU run logs mfu and mem_gib as null: one message naming the file, not fmean's TypeError."""
    _run_dir(tmp_path / "cpu", [10.0, 20.0], 2.0)
    path = tmp_path / "cpu" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        if r["kind"] == "train":
            r["mfu"] = r["mem_gib"] = None
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"metrics.jsonl: its training windows record no mfu \(a CPU run, or a GPU "
                       r"of unknown peak without log.peak_tflops\); the table is of GPU runs"):
        tables.train_table([str(tmp_path / "cpu")], ["c"], ["g"], throughput_only=True)


def test_recipe_tables_are_stamped():
    text = tables.recipe_tables([os.path.join(ROOT, "docs", "results", "bench", "gka_mqar.jsonl")])
    assert "| gka | 2.8 | 80.1 |" in text.splitlines()
    assert text.splitlines()[-1] == ("gka_mqar: commit 89ef598 on NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, "
                                     "triton 3.6.0).")


def _doc(tmp_path, body):
    _speed_csv(tmp_path / "speed.csv", ROWS)
    doc = tmp_path / "doc.md"
    doc.write_text(f"# doc\n\ntext\n<!-- table: python -m kalmix.bench.tables speed speed.csv --modes fwd -->\n{body}"
                   "<!-- /table -->\n\nafter\n")
    return doc


def test_update_rewrites_a_stale_block_and_check_names_it(tmp_path):
    doc = _doc(tmp_path, "| an old table |\n")
    stale = tables.update(str(tmp_path), check=True, files=[str(doc)])
    assert len(stale) == 1 and stale[0].startswith("doc.md:4: python -m kalmix.bench.tables speed speed.csv")
    assert "-| an old table |" in stale[0]
    assert "| an old table |" in doc.read_text()                          # --check writes nothing
    tables.update(str(tmp_path), files=[str(doc)])
    text = doc.read_text()
    assert "| mine (triton) | 1.000 |" in text and text.startswith("# doc\n\ntext\n") and text.endswith("after\n")
    assert tables.update(str(tmp_path), check=True, files=[str(doc)]) == []


def test_check_exits_1_and_update_0(tmp_path, capsys, monkeypatch):
    _speed_csv(tmp_path / "speed.csv", ROWS)
    os.makedirs(tmp_path / "docs")
    (tmp_path / "README.md").write_text("<!-- table: python -m kalmix.bench.tables speed speed.csv -->\n"
                                        "stale\n<!-- /table -->\n")
    monkeypatch.setattr(tables, "REPORTS", {})                             # no bench report in this tree
    assert tables.main(["update", "--check", "--root", str(tmp_path)]) == 1
    assert "1 table(s) differ" in capsys.readouterr().err
    assert tables.main(["update", "--root", str(tmp_path)]) == 0
    assert tables.main(["update", "--check", "--root", str(tmp_path)]) == 0


@pytest.mark.parametrize("text, message", [
    ("<!-- table: python -m kalmix.bench.tables speed speed.csv -->\nno end\n",
     r"doc.md:1: `<!-- table: COMMAND -->` must be one line followed by the table and a `<!-- /table -->` line"),
    ("<!-- table: ls speed.csv -->\n<!-- /table -->\n", r"table command 'ls speed.csv': it must start with"),
    ("<!-- table: python -m kalmix.bench.tables speed nothing*.csv -->\n<!-- /table -->\n",
     r"'nothing\*.csv' matches no file"),
    ("<!-- table: python -m json x -->\n<!-- /table -->\n", r"json has no main\(argv\) to call"),
    ("<!-- table: python -m kalmix.bench.tables speed missing.csv -->\n<!-- /table -->\n",
     r"table command 'python -m kalmix.bench.tables speed missing.csv' failed: 2"),
])
def test_broken_blocks_are_named(tmp_path, text, message):
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    with pytest.raises(ValueError, match=message):
        tables.update(str(tmp_path), files=[str(doc)])


def test_a_report_without_rows_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "REPORTS", {"docs/report": "docs/rows/*.jsonl"})
    with pytest.raises(ValueError, match="the bench report docs/report is made from docs/rows/.*, which matches no"):
        tables.update(str(tmp_path), check=True)


def test_a_marker_inside_a_line_is_prose(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("each table sits in a `<!-- table: COMMAND -->` block\n")
    assert tables.update(str(tmp_path), check=True, files=[str(doc)]) == []


def test_command_line_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tables.main(["speed", str(tmp_path / "missing.csv")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m kalmix.bench.tables: error: [Errno 2] No such file or directory") and \
        "Traceback" not in err
    _run_dir(tmp_path / "run", [1.0, 2.0], 2.0)
    with pytest.raises(SystemExit) as e:
        tables.main(["train", str(tmp_path / "run"), "--gpu", "H100"])
    assert e.value.code == 2 and "record no commit; give --commit VALUE" in capsys.readouterr().err
