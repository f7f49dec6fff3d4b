"""`kalmix bench lm --longest` and `--activation-checkpointing` on CPU at tiny sizes: one row per step at each T,
shortest first, a model out of memory (simulated) not tried at longer T; the long-context table and plot from the
CSV; the 1b preset; the flags' refusals; checkpointed blocks giving the same loss and gradients."""
import csv
import io
import re
from contextlib import redirect_stdout

import matplotlib.figure
import pytest
import torch

from kalmix.bench import lm
from kalmix.bench.lm import LMBenchConfig, longest_table, markdown_table, matched_specs, read_rows
from kalmix.bench.speed import write_csv
from kalmix.cli import main
from kalmix.train.loop import activation_checkpointing

TINY = ["--device", "cpu", "--layers", "2", "--d-model", "64", "--vocab-size", "256", "--num-heads", "2",
        "--attention-heads", "2", "--warmup", "0", "--steps", "1", "--tolerance", "0.1"]


@pytest.fixture(scope="module")
def longest_run(tmp_path_factory):
    """`--longest --prefill` over T = 128, 32, 64 (given out of order) for attention and Llama, attention's training
    step out of memory at T = 64 (raised in place of its measurement). -> (rows of lm.csv, measured (model, mode, B,
    T) in order, out folder, printed output)."""
    out = tmp_path_factory.mktemp("longest")
    calls, real = [], lm.measure

    def measure(spec, shape, mode, B, T, *rest):
        calls.append((spec.name, mode, B, T))
        if (spec.name, mode, T) == ("attention", "train", 64):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(spec, shape, mode, B, T, *rest)

    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(buf):
        mp.setattr(lm, "measure", measure)
        rc = main(["bench", "lm", *TINY, "--longest", "--prefill", "--models", "attention", "llama", "--seq-lens",
                   "128", "32", "64", "--out", str(out)])
    assert rc == 0
    with open(out / "lm.csv", newline="") as f:
        return list(csv.DictReader(f)), calls, out, buf.getvalue()


def test_longest_runs_one_row_shortest_first_and_skips_past_an_oom(longest_run):
    rows, calls, out, printed = longest_run
    got = [(r["model"], r["mode"], r["T"], r["status"]) for r in rows]
    assert got == [("attention", "train", "32", "ok"), ("attention", "prefill", "32", "ok"),
                   ("attention", "train", "64", "oom"), ("attention", "prefill", "64", "ok"),
                   ("attention", "train", "128", "skipped (oom at 64)"), ("attention", "prefill", "128", "ok"),
                   ("llama", "train", "32", "ok"), ("llama", "prefill", "32", "ok"),
                   ("llama", "train", "64", "ok"), ("llama", "prefill", "64", "ok"),
                   ("llama", "train", "128", "ok"), ("llama", "prefill", "128", "ok")]
    assert ("attention", "train", 1, 128) not in calls                   # skipped: not measured
    assert all(B == 1 for _, _, B, _ in calls) and len(calls) == 11
    for r in rows:
        assert (r["B"], r["tokens"], r["packing"], r["documents"]) == ("1", r["T"], "plain", "1")
        assert (r["longest"], r["activation_checkpointing"], r["preset"]) == ("True", "False", "default")
        assert r["shape"] == "2 blocks, width 64, 2 heads (attention 2), vocabulary 256"
        if r["status"] == "ok":
            assert float(r["tokens_per_s"]) == pytest.approx(int(r["T"]) / float(r["ms_median"]) * 1e3)
        else:
            assert r["tokens_per_s"] == "nan"
    assert "B = 1 row per step (--longest), preset default (2 blocks, width 64" in printed.splitlines()[0]
    assert (out / "lm_longest_train.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "lm_longest_prefill.png").exists() and not (out / "lm_train.png").exists()


def test_longest_table_from_the_csv(longest_run):
    rows, _, out, _ = longest_run
    text = markdown_table(str(out / "lm.csv"))
    r0 = rows[0]
    assert text.startswith(f"`kalmix bench lm --longest` on {r0['device_name']}, commit {r0['git']} (torch "
                           f"{r0['torch']}, triton {r0['triton']}, fla {r0['fla']}); one row of T tokens per step "
                           f"(B = 1)")
    assert ("Preset default: 2 blocks, width 64, 2 heads (attention 2), vocabulary 256. Activation checkpointing "
            "off. A CPU run") in text
    assert "**training step**" in text and "**prefill (forward)**" in text
    head = "| model | params (× Llama) | longest T | T = 32 | T = 64 | T = 128 |"
    assert text.count(head) == 2
    lines = [line.split(" | ") for line in text.splitlines() if line.startswith(("| attention", "| llama"))]
    train_attention, train_llama, prefill_attention, prefill_llama = lines
    assert train_attention[2:] == ["32", train_attention[3], "oom", "not tried |"]
    assert train_llama[2] == "≥ 128" and prefill_attention[2] == "≥ 128" and prefill_llama[2] == "≥ 128"
    by = {(r["model"], r["mode"], r["T"]): r for r in rows}
    assert train_attention[3] == f"{float(by['attention', 'train', '32']['tokens_per_s']):,.0f}"  # CPU: no MFU, GiB


def test_longest_table_marks_a_model_that_never_ran_and_a_cuda_cell(longest_run):
    """Typed rows: a model out of memory at its first T reads "none"; on a GPU a cell gives MFU and peak memory."""
    rows = read_rows(str(longest_run[2] / "lm.csv"))
    train = [r for r in rows if r["mode"] == "train"]
    for r in train:
        if r["model"] == "llama":
            r.update(status="oom" if r["T"] == 32 else "skipped (oom at 32)")
        elif r["status"] == "ok":
            r.update(mfu=0.25, peak_GiB=12.34)
    text = longest_table(train)
    assert "**prefill (forward)**" not in text
    assert re.search(r"\| llama \| [\d.]+M \(1\.00\) \| none \| oom \| not tried \| not tried \|", text)
    assert re.search(r"\| attention \| [\d.]+M \([\d.]+\) \| 32 \| [\d,]+ · 25% · 12\.3 GiB \| oom \| not tried \|",
                     text)


def test_table_joins_only_one_setup(longest_run, tmp_path):
    rows = read_rows(str(longest_run[2] / "lm.csv"))
    other = tmp_path / "ac.csv"
    write_csv([{**r, "activation_checkpointing": True} for r in rows], str(other))
    with pytest.raises(ValueError, match=r"a row has activation_checkpointing True where the first has False; one "
                                         r"table joins runs of one GPU kind and setup only"):
        markdown_table(str(longest_run[2] / "lm.csv"), str(other))
    normal = tmp_path / "normal.csv"
    write_csv([{**r, "longest": False} for r in rows], str(normal))
    with pytest.raises(ValueError, match=r"a row has longest False where the first has True"):
        markdown_table(str(longest_run[2] / "lm.csv"), str(normal))


def test_plot_from_csvs_marks_the_oom(longest_run, tmp_path, monkeypatch, capsys):
    """`--table CSV --out DIR` prints the table and draws the joined rows' plots; the long-context plot has log T
    and an × at attention's oom (T = 64) in attention's colour, and no line past it."""
    figures = []
    real = matplotlib.figure.Figure.savefig

    def savefig(fig, path, **kw):
        figures.append(fig)
        return real(fig, path, **kw)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    assert main(["bench", "lm", "--table", str(longest_run[2] / "lm.csv"), "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("`kalmix bench lm --longest` on")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm_longest_prefill.png", "lm_longest_train.png"]
    ax = figures[0].axes[0]
    assert ax.get_xscale() == "log" and "×: out of memory" in ax.get_title()
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["attention"].get_xdata()) == [32]
    assert list(lines["llama"].get_xdata()) == [32, 64, 128]
    crosses = [line for line in ax.get_lines() if line.get_marker() == "x"]
    assert len(crosses) == 1 and list(crosses[0].get_xdata()) == [64]
    assert crosses[0].get_color() == lines["attention"].get_color()
    assert not [line for line in figures[1].axes[0].get_lines() if line.get_marker() == "x"]    # prefill: no oom


def test_activation_checkpointing_is_recorded_and_recomputes_each_block(monkeypatch, tmp_path):
    """The flag reaches the training step (each kalmix block's forward runs again in the backward) and every row
    records it; the plain mode keeps its tokens per step."""
    from kalmix.models.modeling import KalmixBlock
    forwards = []
    real = KalmixBlock.forward
    monkeypatch.setattr(KalmixBlock, "forward", lambda self, *a, **k: forwards.append(1) or real(self, *a, **k))
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["bench", "lm", *TINY, "--activation-checkpointing", "--models", "gdn", "llama", "--tokens", "64",
                   "--seq-lens", "32", "--packing", "plain", "--no-plots", "--out", str(tmp_path)])
    assert rc == 0
    rows = list(csv.DictReader(open(tmp_path / "lm.csv")))
    assert [(r["model"], r["B"], r["activation_checkpointing"], r["longest"], r["status"]) for r in rows] == [
        ("gdn", "2", "True", "False", "ok"), ("llama", "2", "True", "False", "ok")]
    assert len(forwards) == 2 * 2                            # 2 blocks, each run in the forward and again
    assert "64 tokens per step, preset default (" in buf.getvalue() and ", activation checkpointing," in buf.getvalue()
    assert "Activation checkpointing on." in markdown_table(str(tmp_path / "lm.csv"))


@pytest.mark.parametrize("model", ["gdn", "hybrid", "llama"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(model):
    """fp32, a tiny model of the benchmark: the loss and every parameter's gradient with each block recomputed equal
    those of the plain backward."""
    cfg = LMBenchConfig(device="cpu", layers=4, d_model=32, vocab_size=64, num_heads=2, attention_heads=2,
                        tolerance=0.5)
    shape = cfg.shape()
    spec = lm.specs(shape, [model])[model]
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        net = lm.build(spec, shape, impl="torch").train()
        if checkpointed:
            activation_checkpointing(net)
        assert net.is_gradient_checkpointing == checkpointed
        loss = net(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters()}))
    (loss0, grads0), (loss1, grads1) = results
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-6, atol=1e-7, msg=name)


def test_1b_preset_is_matched_as_its_help_says():
    """On the meta device: the 1b shape's models within 5% of Llama's ~978M; the help names attention's and gdn's
    counts as they are."""
    cfg = LMBenchConfig(device="cpu", preset="1b", models=["attention", "gdn", "kalman", "llama"])
    assert cfg.shape() == lm.LMShape(layers=18, d_model=2048, vocab_size=32768, num_heads=16, attention_heads=16)
    _, counts = matched_specs(cfg)
    assert 0.95e9 < counts["llama"] < 1.0e9
    assert all(abs(n / counts["llama"] - 1) <= 0.05 for n in counts.values())
    help_ = LMBenchConfig.model_fields["preset"].description
    assert f"attention {counts['attention'] / 1e6:.1f}M parameters, gdn sized to {counts['gdn'] / 1e6:.1f}M" in help_


@pytest.mark.parametrize("args, message", [
    (["--longest", "--tokens", "4096"], r"--longest runs B = 1 row of T tokens per step, so --tokens 4096 does not "
                                        r"apply; pass one of --longest and --tokens"),
    (["--longest", "--packing", "plain", "packed"], r"--longest times plain rows only; --packing packed does not"),
    (["--longest", "--memory"], r"--longest applies to the timed steps; --memory and --profile do not take it"),
    (["--activation-checkpointing", "--profile"], r"--activation-checkpointing applies to the timed steps; --memory "
                                                  r"and --profile do not take it"),
    (["--longest", "--seq-lens", "1", "1024"], r"T = 1 is too short; a row holds T >= 2 tokens"),
])
def test_bad_flag_combinations_are_named(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "lm", "--device", "cpu", *args])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_longest_takes_any_lengths_in_increasing_order():
    cfg = LMBenchConfig(device="cpu", longest=True, seq_lens=[65536, 3000, 2048, 3000], packing=["plain"])
    assert cfg.seq_lens == [2048, 3000, 65536] and cfg.packing == ["plain"] and cfg.rows(3000) == 1
    assert LMBenchConfig(device="cpu").rows(2048) == 32
