"""`kalmix bench run` / `report`: recipes, the run loop, resuming, lr selection, the depth rule, the report."""
import glob
import os

import pytest
import torch
import yaml
from pydantic import ValidationError

from kalmix.bench import report as rep
from kalmix.bench.synthetic import Recipe, TaskSpec, load_recipe, recorded, run, scores
from kalmix.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "kalmix", "bench", "recipes", "*.yaml")))


def tiny(**over) -> dict:
    data = {
        "name": "tiny", "paper": "test", "source": "none", "claim": "none",
        "task": {"kind": "mqar", "params": {"vocab_size": 64, "seq_len": 16, "num_kv_pairs": 2},
                 "train_examples": 64, "val_examples": 16, "test_examples": 16, "eval_lengths": [32]},
        "model": {"d_model": 16, "n_layers": 1},
        "mixers": {"gdn": {"mixer": "gdn", "kwargs": {"num_heads": 2}},
                   "kla": {"mixer": "kalman", "kwargs": {"d_state": 2, "expand": 1}}},
        "train": {"steps": 4, "batch_size": 8, "lrs": [1e-3, 3e-3], "eval_every": 2},
        "report": {"kind": "curve", "x": "eval_length"},
        "references": [{"mixer": "gdn", "at": {"eval_length": 32}, "value": 0.5}],
    }
    data.update(over)
    return data


@pytest.mark.parametrize("path", RECIPES, ids=[os.path.basename(p) for p in RECIPES])
def test_every_recipe_validates_at_every_grid_point(path):
    recipe = load_recipe(path)
    assert recipe.planned_runs() >= len(recipe.mixers)
    for point in recipe.points():
        at = recipe.at(point)
        at.task.check()
        assert at.task.vocab_size() > 0 and at.test_lengths()[0] == at.task.length()


def test_recipes_cover_each_paper():
    papers = {load_recipe(p).paper for p in RECIPES}
    assert papers == {"Kalman Linear Attention", "Gated KalmaNet", "Kaczmarz Linear Attention",
                      "Variational Linear Attention"}


def test_recipe_errors():
    with pytest.raises(ValidationError, match="extra"):
        Recipe.model_validate(tiny(epochs=3))
    with pytest.raises(ValidationError, match="unknown mixer"):
        Recipe.model_validate(tiny(mixers={"x": {"mixer": "lstm"}}))
    with pytest.raises(ValidationError, match="grid path"):
        Recipe.model_validate(tiny(grid={"model.width": [1]}))
    with pytest.raises(ValidationError, match="report axis"):
        Recipe.model_validate(tiny(report={"x": "model.d_model"}))
    with pytest.raises(ValidationError, match="reference names mixer"):
        Recipe.model_validate(tiny(references=[{"mixer": "nope", "value": 1.0}]))
    # a grid point that breaks the task's own constraints (4D <= T) is found at load, not mid-run
    with pytest.raises(ValidationError, match="num_kv_pairs"):
        Recipe.model_validate(tiny(grid={"task.params.num_kv_pairs": [2, 8]}))


def test_overrides(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny()))
    r = load_recipe(str(path), ["train.steps=7", "grid.model.d_model=[8, 16]", "train.lrs=[0.01]"])
    assert r.train.steps == 7 and r.train.lrs == [0.01] and r.grid == {"model.d_model": [8, 16]}
    assert [p["model.d_model"] for p in r.points()] == [8, 16] and r.at(r.points()[0]).model.d_model == 8
    with pytest.raises(ValueError, match="PATH=VALUE"):
        load_recipe(str(path), ["train.steps"])


def test_task_splits_differ_and_are_reproducible():
    spec = TaskSpec.model_validate(tiny()["task"])
    tr, va, te = (spec.build(s, 0) for s in ("train", "val", "test"))
    assert not torch.equal(tr[0][:16], va[0]) and not torch.equal(va[0], te[0])
    assert torch.equal(spec.build("val", 0)[0], va[0]) and not torch.equal(spec.build("val", 1)[0], va[0])
    assert spec.build("test", 0, 32)[0].shape == (16, 32)
    mad = TaskSpec(kind="selective_copying", train_examples=8, val_examples=4, test_examples=4)
    x, y = mad.build("val", 0)
    assert x.shape == (4, 256) and not torch.equal(x, mad.build("test", 0)[0])


def test_scores_by_hand():
    labels = torch.tensor([[-100, 1, 2, -100], [3, -100, 3, 4]])
    pred = torch.tensor([[0, 1, 0, 9], [3, 7, 3, 4]])
    s = scores(pred, labels)
    assert s["accuracy"] == pytest.approx((0.5 + 1.0) / 2)
    assert s["token_accuracy"] == pytest.approx(4 / 5)
    assert s["sequence_accuracy"] == pytest.approx(0.5)
    assert s["macro_accuracy"] == pytest.approx((1 + 0 + 1 + 1 + 0) / 5)   # classes 1, 2, 3, 4 and predicted 0


def test_run_resume_and_report(tmp_path):
    recipe = Recipe.model_validate(tiny())
    out = str(tmp_path / "r.jsonl")
    rows = run(recipe, out, progress=False)
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    for r in rows:
        assert set(r["test"]) == {"16", "32"} and 0 <= r["test"]["32"]["accuracy"] <= 1
        assert r["steps_run"] == 4 and len(r["history"]) == 2 and r["state_size"] > 0
        assert "kalmix torch" in r["ran"]
    assert rows[0]["state_size"] == 2 * 8 * 8           # GDN, 2 heads of 8 x 8
    assert rows[2]["state_size"] == 2 * 2 * 16          # Kalman: precision and mean, N = 2, 16 channels
    assert len(recorded(out)) == 4
    assert run(recipe, out, progress=False) == []       # everything recorded: nothing runs again
    text = rep.report([out], str(tmp_path / "rep"))
    assert "| gdn |" in text and "(50.0)" in text and "eval_length = 32" in text
    assert os.path.getsize(tmp_path / "rep" / "tiny.png") > 1000


def test_fresh_batches(tmp_path):
    data = tiny(references=[], train={"steps": 3, "lrs": [1e-3], "eval_every": 3})
    data["task"]["train_examples"] = None
    recipe = Recipe.model_validate(data)
    a, b = recipe.task.fresh_batch(8, 0, 0), recipe.task.fresh_batch(8, 0, 1)
    assert torch.equal(a[0], recipe.task.fresh_batch(8, 0, 0)[0]) and not torch.equal(a[0], b[0])
    assert not torch.equal(a[0], recipe.task.fresh_batch(8, 1, 0)[0])
    assert not (a[0][:, None] == recipe.task.build("val", 0)[0][None]).all(-1).any()   # no validation sequence
    rows = run(recipe, str(tmp_path / "r.jsonl"), progress=False)
    assert [r["status"] for r in rows] == ["ok", "ok"]


def test_a_failing_run_is_recorded_not_fatal(tmp_path, monkeypatch):
    import kalmix.bench.synthetic as syn
    calls = []

    def boom(*args, **kwargs):
        calls.append(1)
        raise AssertionError("this kernel does not support float32")
    monkeypatch.setattr(syn, "run_one", boom)
    rows = run(Recipe.model_validate(tiny(references=[])), str(tmp_path / "r.jsonl"), progress=False)
    assert len(calls) == 4 and {r["status"] for r in rows} == {"error"}
    assert "AssertionError: this kernel does not support float32" in rows[0]["reason"]


def test_unavailable_mixer_is_recorded_and_retried(tmp_path):
    recipe = Recipe.model_validate(tiny(mixers={"deltanet": {"mixer": "deltanet"}}, references=[],
                                        train={"steps": 2, "lrs": [1e-3]}))
    out = str(tmp_path / "r.jsonl")
    rows = run(recipe, out, progress=False)
    assert rows[0]["status"] == "unavailable" and "CUDA" in rows[0]["reason"]
    assert recorded(out) == set()                       # tried again on the next run (e.g. on a GPU)
    assert "unavailable" in rep.report([out], str(tmp_path / "rep"))


def test_compression_and_word_problem_models_train(tmp_path):
    data = tiny(task={"kind": "compression", "params": {"seq_len": 8}, "train_examples": 32, "val_examples": 8,
                      "test_examples": 8},
                mixers={"kla": {"mixer": "kalman", "kwargs": {"d_state": 2, "expand": 1}},
                        "kla+": {"mixer": "kalman", "kwargs": {"d_state": 2, "expand": 1},
                                 "config": {"mc_samples": 2}}}, references=[],
                train={"steps": 2, "lrs": [1e-3], "eval_every": 1, "batch_size": 4},
                grid={"task.kind": ["compression"]}, report={"kind": "table", "x": "task.kind"})
    rows = run(Recipe.model_validate(data), str(tmp_path / "c.jsonl"), progress=False)
    assert [r["status"] for r in rows] == ["ok", "ok"] and rows[0]["params"] == rows[1]["params"]
    assert rows[0]["history"] != rows[1]["history"]     # KLA+'s marginal loss differs from the mean readout's
    data.update(mixers={"kla": data["mixers"]["kla"]},
                task={"kind": "word_problem", "params": {"group": "Z60", "seq_len": 4}, "train_examples": 32,
                      "val_examples": 8, "test_examples": 8}, grid={"model.n_layers": [1, 2]},
                metric="sequence_accuracy", report={"kind": "min_depth", "x": "model.n_layers"})
    with pytest.raises(ValidationError, match="report axis 'task.params.seq_len'|report axis"):
        Recipe.model_validate({**data, "report": {"kind": "min_depth", "x": "task.params.seq_len"}})
    rows = run(Recipe.model_validate(data), str(tmp_path / "w.jsonl"), progress=False)
    assert [r["point"]["model.n_layers"] for r in rows] == [1, 2] and rows[0]["params"] < rows[1]["params"]


def _row(mixer, point, seed, lr, val, test, length=16, history=None, steps_run=4):
    metrics = {m: test for m in ("accuracy", "token_accuracy", "sequence_accuracy", "macro_accuracy")}
    return {"recipe": "t", "status": "ok", "mixer": mixer, "point": point, "seed": seed, "lr": lr, "val": val,
            "test": {str(length): metrics}, "ran": "x", "device": "cpu", "steps_run": steps_run, "train_s": 1.0,
            "history": history or [[steps_run, 1.0, val]]}


def test_lr_chosen_by_validation_not_test():
    recipe = Recipe.model_validate(tiny(grid={"model.d_model": [16]}, report={"x": "model.d_model"},
                                        references=[]))
    p = {"model.d_model": 16}
    rows = [_row("gdn", p, 0, 1e-3, val=0.9, test=0.5), _row("gdn", p, 0, 3e-3, val=0.8, test=1.0),
            _row("gdn", p, 1, 1e-3, val=0.1, test=0.0), _row("gdn", p, 1, 3e-3, val=0.7, test=0.7)]
    s = rep.series(recipe, rep.summarise(recipe, rows))
    mean, std, n = s[""]["gdn"][16]
    assert n == 2 and mean == pytest.approx((0.5 + 0.7) / 2)


def test_min_depth_rule():
    recipe = Recipe.model_validate(tiny(
        task={"kind": "word_problem", "params": {"group": "A5", "seq_len": 4}, "train_examples": 8,
              "val_examples": 8, "test_examples": 8},
        grid={"task.params.seq_len": [4, 8], "model.n_layers": [1, 2]}, references=[],
        report={"kind": "min_depth", "x": "task.params.seq_len", "depth": "model.n_layers", "threshold": 0.9}))
    rows = []
    for L, d, accs in [(4, 1, [0.95, 0.1]), (4, 2, [1.0, 1.0]), (8, 1, [0.2, 0.3]), (8, 2, [0.5, 0.89])]:
        for seed, a in enumerate(accs):
            rows.append(_row("kla", {"task.params.seq_len": L, "model.n_layers": d}, seed, 1e-3, a, a, length=L))
    depths = rep.min_depths(recipe, rep.summarise(recipe, rows))
    assert depths["kla"][4] == (1, [1, 2])              # one seed of two reaching 90% solves it
    assert depths["kla"][8] == (None, [1, 2])
    assert "— (tried 1,2)" in rep.markdown(recipe, rep.summarise(recipe, rows), None)


def test_cli_dry_run_and_errors(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny()))
    assert main(["bench", "run", str(path), "--dry-run", "--set", "train.seeds=[0, 1]"]) == 0
    assert "# 8 runs (1 grid points)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "run", str(path), "--set", "train.optimizer=sgd"])
    with pytest.raises(SystemExit):
        main(["bench", "run", str(path), "--mixers", "nope", "--out", str(tmp_path / "o.jsonl")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(SystemExit):
        main(["bench", "report", str(bad), "--out", str(tmp_path / "rep")])
