"""`kalmix bench run` / `report`: recipes, the run loop, resuming, lr selection, the depth rule, the report."""
import glob
import os

import pytest
import torch
import yaml
from pydantic import ValidationError

from kalmix.bench import report as rep
from kalmix.bench.synthetic import (Recipe, TaskSpec, load_recipe, read_rows, recorded, resolve_recipe, run, run_key,
                                    scores)
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


# ------------------------------------------------------------------------ the papers' protocols in the schema

def test_budget_fraction_in_dry_run_and_report(tmp_path, capsys):
    data = tiny(budget={"steps": 8, "batch_size": 8, "lrs": 1, "seeds": 1, "source": "Table 1"},
                train={"steps": 4, "batch_size": 8, "lrs": [1e-3, 3e-3], "seeds": [0, 1, 2], "eval_every": 2})
    recipe = Recipe.model_validate(data)
    assert recipe.budget_fraction == {"run": 0.5, "sweep": 3.0}               # 4 × 8 of 8 × 8; × 2 lrs × 3 seeds
    assert Recipe.model_validate(recipe.model_dump()).budget_fraction == recipe.budget_fraction   # round trip
    assert "50% of a paper run, 300% of its sweep" in recipe.budget_line()
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["bench", "run", str(path), "--dry-run", "--set", "train.steps=16"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["budget_fraction"] == {"run": 2.0, "sweep": 12.0}
    epochs = Recipe.model_validate(tiny(budget={"epochs": 2, "train_examples": 64, "seeds": 2, "source": "x"},
                                        train={"steps": 4, "batch_size": 8, "lrs": [1e-3], "seeds": [0]}))
    assert epochs.budget_fraction == {"run": 0.25, "sweep": 0.125}
    unknown = Recipe.model_validate(tiny(budget={"epochs": 500, "source": "x"}))
    assert unknown.budget_fraction == {"run": None, "sweep": None} and "no fraction" in unknown.budget_line()
    with pytest.raises(ValidationError, match="either steps"):
        Recipe.model_validate(tiny(budget={"steps": 8, "epochs": 2, "batch_size": 8, "source": "x"}))
    with pytest.raises(ValidationError, match="steps needs batch_size"):
        Recipe.model_validate(tiny(budget={"steps": 8, "source": "x"}))


def test_where_overrides_apply_at_their_grid_points():
    recipe = Recipe.model_validate(tiny(grid={"model.d_model": [8, 16]}, report={"x": "model.d_model"},
                                        references=[],
                                        where=[{"at": {"model.d_model": 16},
                                                "set": {"train.batch_size": 4, "mixers.gdn.kwargs.num_heads": 4}}]))
    small, big = (recipe.at(p) for p in recipe.points())
    assert small.train.batch_size == 8 and small.mixers["gdn"].kwargs["num_heads"] == 2
    assert big.train.batch_size == 4 and big.mixers["gdn"].kwargs["num_heads"] == 4 and big.where == []
    plain = Recipe.model_validate({**recipe.model_dump(), "where": []}).at({"model.d_model": 16})
    p16 = {"model.d_model": 16}
    assert run_key(big, p16, "gdn", 1e-3, 0) != run_key(plain, p16, "gdn", 1e-3, 0)   # the key sees the override
    with pytest.raises(ValidationError, match="not a grid path"):
        Recipe.model_validate(tiny(grid={"model.d_model": [8]}, report={"x": "model.d_model"},
                                   where=[{"at": {"model.n_layers": 1}, "set": {"train.steps": 2}}]))
    narrowed = Recipe.model_validate({**recipe.model_dump(), "grid": {"model.d_model": [8]}})   # --set grid.…=[8]
    assert [narrowed.at(p).train.batch_size for p in narrowed.points()] == [8]       # the entry for 16 is idle


def test_set_overrides_win_over_where_entries(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny(grid={"model.d_model": [8, 16]}, report={"x": "model.d_model"},
                                        references=[],
                                        where=[{"at": {"model.d_model": 16},
                                                "set": {"train.steps": 9, "train.batch_size": 4}}])))
    r = load_recipe(str(path), ["train.steps=2"])
    assert [r.at(p).train.steps for p in r.points()] == [2, 2]                  # --set holds at every point
    assert [r.at(p).train.batch_size for p in r.points()] == [8, 4]             # the rest of the entry stays
    r = load_recipe(str(path), ["train={steps: 3, lrs: [0.01]}"])               # a whole block replaces it all
    assert [(r.at(p).train.steps, r.at(p).train.batch_size) for p in r.points()] == [(3, 64), (3, 64)]
    assert r.where == []
    with pytest.raises(ValidationError, match="is a grid path"):
        Recipe.model_validate(tiny(grid={"model.d_model": [8]}, report={"x": "model.d_model"},
                                   where=[{"at": {"model.d_model": 8}, "set": {"model.d_model": 4}}]))
    with pytest.raises(ValidationError, match="does not name a recipe field"):
        Recipe.model_validate(tiny(grid={"model.d_model": [8]}, report={"x": "model.d_model"},
                                   where=[{"at": {"model.d_model": 8}, "set": {"train.epochs": 4}}]))
    # a grid point made invalid by its override is found when the recipe loads
    with pytest.raises(ValidationError, match="num_kv_pairs"):
        Recipe.model_validate(tiny(grid={"model.d_model": [8]}, report={"x": "model.d_model"},
                                   where=[{"at": {"model.d_model": 8}, "set": {"task.params.num_kv_pairs": 9}}]))


def test_model_and_optimizer_fields_reach_the_model(tmp_path, monkeypatch):
    import kalmix.bench.synthetic as syn
    recipe = Recipe.model_validate(tiny(model={"d_model": 16, "n_layers": 1, "mlp": True, "intermediate_size": 32,
                                               "tie_embeddings": True, "init_std": 0.02},
                                        train={"steps": 2, "lrs": [1e-3], "betas": [0.9, 0.95], "eval_every": 2}))
    model = syn.build_model(recipe, recipe.mixers["gdn"], None)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.intermediate_size == 32 and model.config.initializer_range == 0.02
    assert abs(model.model.embed_tokens.weight.std().item() - 0.02) < 0.003
    seen = []
    real = torch.optim.AdamW

    def spy(*args, **kwargs):
        seen.append(kwargs["betas"])
        return real(*args, **kwargs)
    monkeypatch.setattr(syn.torch.optim, "AdamW", spy)
    run(recipe, str(tmp_path / "r.jsonl"), mixers=["gdn"], progress=False)
    assert seen == [(0.9, 0.95)]
    with pytest.raises(ValidationError, match="betas"):
        Recipe.model_validate(tiny(train={"steps": 2, "lrs": [1e-3], "betas": [0.9, 1.5]}))
    with pytest.raises(ValidationError, match="exceeds the fixed training set"):
        Recipe.model_validate(tiny(train={"steps": 2, "lrs": [1e-3], "batch_size": 128}))


def test_a_run_trains_through_the_trainers_optimisation(tmp_path, monkeypatch):
    """The recipe's protocol reaches kalmix train's parameter groups and schedule: warm-up over the first
    ``warmup`` of the steps, cosine down to zero at the last step; embeddings decayed only while
    ``train.decay_embeddings``; norms, biases and the recurrent parameters never."""
    from kalmix.train import optim
    seen, lrs = [], []
    real_init, real_update = optim.Optimization.__init__, optim.Optimization.update

    def init(self, model, *args, **kwargs):
        real_init(self, model, *args, **kwargs)
        names = {id(p): n for n, p in model.named_parameters()}
        seen.append({names[id(p)]: g["weight_decay"] for g in self.optimizer.param_groups for p in g["params"]})

    def update(self, step):
        lrs.append(real_update(self, step))
        return lrs[-1]
    monkeypatch.setattr(optim.Optimization, "__init__", init)
    monkeypatch.setattr(optim.Optimization, "update", update)
    for decay in (True, False):
        recipe = Recipe.model_validate(tiny(references=[], train={"steps": 4, "lrs": [1e-3], "warmup": 0.5,
                                                                   "weight_decay": 0.1, "decay_embeddings": decay}))
        run(recipe, str(tmp_path / f"{decay}.jsonl"), mixers=["kla"], progress=False)
    assert lrs == pytest.approx([5e-4, 1e-3, 5e-4, 0.0] * 2, abs=1e-15)
    decayed, exempt = seen
    assert decayed["model.embed_tokens.weight"] == 0.1 and exempt["model.embed_tokens.weight"] == 0.0
    for groups in seen:
        assert groups["lm_head.weight"] == 0.1 and groups["model.norm.weight"] == 0.0
        assert groups["model.layers.0.mixer.A_log"] == 0.0


def test_epoch_sampling_sees_every_sequence_once_per_epoch():
    from kalmix.bench.synthetic import epoch_batch
    batches = [epoch_batch(20, 6, 3, step) for step in range(6)]          # 3 batches per epoch, 2 dropped
    for epoch in (batches[:3], batches[3:]):
        seen = torch.cat(epoch)
        assert len(seen.unique()) == 18
    assert not torch.equal(torch.cat(batches[:3]), torch.cat(batches[3:]))   # a fresh permutation per epoch
    assert torch.equal(epoch_batch(20, 6, 3, 4), batches[4]) and not torch.equal(epoch_batch(20, 6, 4, 4), batches[4])


def test_recorded_results_keep_their_keys():
    """Rows recorded before the schema grew (betas, sampling, model fields) are still the current recipe's."""
    path = os.path.join(ROOT, "docs", "results", "bench", "kaczmarz_mqar_extrapolation.jsonl")
    rows = [r for r in rep.load_rows([path]) if r["status"] == "ok"]
    assert rows
    for row in rows:
        recipe = Recipe.model_validate(row["spec"])
        assert row["key"] == run_key(recipe.at(row["point"]), row["point"], row["mixer"], row["lr"], row["seed"])


def test_a_run_cut_by_sigterm_is_not_recorded_and_resumes(tmp_path, monkeypatch):
    import signal

    import kalmix.bench.synthetic as syn
    from kalmix.train import checkpoint as ckpt
    data = tiny(references=[], train={"steps": 6, "lrs": [1e-3], "eval_every": 2})
    data["mixers"] = {"gdn": data["mixers"]["gdn"]}
    recipe = Recipe.model_validate(data)
    whole = run(recipe, str(tmp_path / "whole.jsonl"), progress=False)[0]
    out = str(tmp_path / "cut.jsonl")
    real, calls = syn.evaluate, []

    def evaluate_then_term(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:                                    # during the evaluation at step 4
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)
    monkeypatch.setattr(syn, "evaluate", evaluate_then_term)
    assert run(recipe, out, progress=False) == [] and recorded(out) == set()
    assert not syn._STOP.is_set()                               # the stop ended that call, and only that one
    [folder] = os.listdir(out + ".ckpt")                        # the run's checkpoints: kalmix train's format
    assert ckpt.read_meta(ckpt.checkpoints(os.path.join(out + ".ckpt", folder))[-1])["step"] == 4
    monkeypatch.setattr(syn, "evaluate", real)
    [resumed] = run(recipe, out, progress=False)
    assert resumed["resumed_at"] == [4] and resumed["steps_run"] == 6
    assert resumed["history"] == whole["history"] and resumed["test"] == whole["test"]
    assert os.listdir(out + ".ckpt") == []


def _history(vals, every=100, loss0=2.0, falling=True):
    return [[every * (i + 1), loss0 * (1 - i / (2 * len(vals))) if falling else loss0, v] for i, v in enumerate(vals)]


def test_escape_statistics_lr_edges_and_tails():
    recipe = Recipe.model_validate(tiny(train={"steps": 1000, "lrs": [1e-3, 3e-3, 1e-2], "seeds": [0, 1, 2, 3],
                                               "eval_every": 100},
                                        report={"x": "eval_length", "solve_at": 0.9}, references=[]))
    p = {}
    flat_low = _history([0.05] * 10, falling=False)
    rows = [  # seed 0 solves at step 300 with the middle lr; seed 1 at 700 with the top lr; seeds 2, 3 never
        _row("gdn", p, 0, 3e-3, 0.99, 0.99, history=_history([0.1, 0.5, 0.95] + [0.99] * 7), steps_run=1000),
        _row("gdn", p, 0, 1e-2, 0.5, 0.5, history=_history([0.5] * 10), steps_run=1000),
        _row("gdn", p, 1, 1e-2, 0.93, 0.9, history=_history([0.1] * 6 + [0.95, 0.93, 0.93, 0.93]), steps_run=1000),
        _row("gdn", p, 2, 1e-3, 0.05, 0.05, history=flat_low, steps_run=1000),
        _row("gdn", p, 3, 1e-3, 0.4, 0.4, history=_history([0.05] * 8 + [0.2, 0.4]), steps_run=1000),
    ]
    s = rep.summarise(recipe, rows)
    text = "\n".join(rep.diagnostics(recipe, s))
    assert "| gdn | – | 2 of 4 | 500 |" in text                                # median of steps 300 and 700
    assert "0.001 ×2 (edge), 0.003 ×1, 0.01 ×1 (edge)" in text
    assert "solved; solved; flat; rising (+20.0 pts" in text
    assert rep.solve_step(rows[0], 0.9) == 300 and rep.solve_step(rows[3], 0.9) is None
    patience = _row("gdn", p, 0, 1e-3, 0.3, 0.3, history=_history([0.3] * 4), steps_run=400)
    assert rep.tail(patience, recipe.train) == "stopped by patience"
    saturated = _row("gdn", p, 0, 1e-3, 1.0, 1.0, history=_history([1.0] * 10, loss0=0.1), steps_run=1000)
    assert rep.tail(saturated, recipe.train) == "flat"                      # loss falling at 100% is not training
    md = rep.markdown(recipe, s, None)
    assert "**Budget** per grid point: the recipe states no paper budget" in md and "ms/step" in md
    lrs = "\n".join(rep.by_lr(recipe, rows))          # every rate's runs, the unkept ones included
    assert "| gdn | – | 0.001 | 0 of 2 | 22.5 ± 24.7 | 22.5 ± 24.7 | 1 flat, 1 rising |" in lrs
    assert "| gdn | – | 0.01 | 1 of 2 | 70.0 ± 28.3 | 70.0 ± 28.3 | 1 rising, 1 solved |" in lrs
    assert "Every learning rate" in md


def test_the_report_counts_every_rate_and_seed_its_rows_ran(tmp_path):
    """Runs of one recipe version started with other lr / seed lists (``--set train.lrs=...``) share a file; the
    report's recipe, and so its budget line, has every rate and seed of the rows, not the newest start's lists."""
    data = tiny(budget={"steps": 8, "batch_size": 8, "lrs": 1, "seeds": 1, "source": "x"}, references=[],
                mixers={"gdn": {"mixer": "gdn", "kwargs": {"num_heads": 2}}},
                train={"steps": 2, "batch_size": 8, "lrs": [1e-3], "seeds": [0], "eval_every": 2})
    path = str(tmp_path / "r.jsonl")
    run(Recipe.model_validate(data), path, progress=False)
    data["train"] = data["train"] | {"lrs": [3e-3], "seeds": [1]}
    run(Recipe.model_validate(data), path, progress=False)
    recipe, rows, earlier = rep.current(read_rows(path))
    assert (recipe.train.lrs, recipe.train.seeds, len(rows), earlier) == ([1e-3, 3e-3], [0, 1], 2, 0)
    assert "2 steps of 8 × 2 learning rate(s) × 2 seed(s): 25% of a paper run, 100% of its sweep" in \
        rep.markdown(recipe, rep.summarise(recipe, rows), None)


def test_the_report_takes_the_words_of_the_shipped_recipe_that_ran_its_rows():
    """Rows carry the recipe as it ran; a shipped recipe whose description was edited since, but which runs the
    same version (the same run keys), lends the report its words. One that runs another version does not."""
    shipped = load_recipe(resolve_recipe("kaczmarz_mqar_extrapolation"))

    def rows_of(recipe):
        spec = recipe.model_dump() | {"deviations": "as it was", "claim": "as it was"}
        return [{"recipe": recipe.name, "spec": spec, "point": {}, "mixer": m, "lr": 1e-3, "seed": 0,
                 "status": "ok", "time": "2026-01-01T00:00:00", "key": run_key(recipe.at({}), {}, m, 1e-3, 0)}
                for m in recipe.mixers]

    recipe, rows, earlier = rep.current(rows_of(shipped))
    assert (recipe.deviations, recipe.claim, len(rows), earlier) == (shipped.deviations, shipped.claim, 3, 0)
    other = load_recipe(resolve_recipe("kaczmarz_mqar_extrapolation"), ["train.patience=3"])
    recipe, rows, _ = rep.current(rows_of(other))
    assert (recipe.deviations, len(rows)) == ("as it was", 3)


def test_report_also_shows_extra_metrics():
    recipe = Recipe.model_validate(tiny(
        task={"kind": "word_problem", "params": {"group": "A5", "seq_len": 4}, "train_examples": 8,
              "val_examples": 8, "test_examples": 8},
        grid={"task.params.seq_len": [4], "model.n_layers": [1, 2]}, references=[], metric="sequence_accuracy",
        report={"kind": "min_depth", "x": "task.params.seq_len", "depth": "model.n_layers", "threshold": 0.9,
                "also": ["token_accuracy"]}))
    rows = []
    for d, (seq, tok) in [(1, (0.5, 0.95)), (2, (0.92, 0.99))]:
        row = _row("kla", {"task.params.seq_len": 4, "model.n_layers": d}, 0, 1e-3, seq, seq, length=4)
        row["test"]["4"]["token_accuracy"] = tok
        rows.append(row)
    s = rep.summarise(recipe, rows)
    assert rep.min_depths(recipe, s)["kla"][4] == (2, [1, 2])
    assert rep.min_depths(recipe, s, "token_accuracy")["kla"][4] == (1, [1, 2])
    md = rep.markdown(recipe, s, None)
    assert "90% test sequence accuracy" in md and "90% test token accuracy" in md


PLATEAU_PRONE = {"mqar", "hard_mqar", "capacity_mqar", "word_problem", "in_context_recall"}


@pytest.mark.parametrize("path", RECIPES, ids=[os.path.basename(p) for p in RECIPES])
def test_every_recipe_states_its_paper_budget_and_deviations(path):
    recipe = load_recipe(path)
    assert recipe.budget is not None and recipe.budget.source and len(recipe.deviations) > 200
    seeds = len(recipe.train.seeds)
    assert seeds >= max(3, recipe.budget.seeds)
    if recipe.task.kind in PLATEAU_PRONE or "task.kind" in recipe.grid:         # MQAR, A5, MAD: >= 5 seeds
        assert seeds >= 5 and recipe.report.solve_at is not None
    for point in recipe.points():
        f = recipe.at(point).budget_fraction
        assert f["run"] is None or f["run"] >= 0.99                              # every run at the paper's length


def test_reproduce_script_spreads_jobs_and_stops_at_its_limit(tmp_path):
    import subprocess
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny(references=[], train={"steps": 2, "lrs": [1e-3], "eval_every": 2})))
    out = tmp_path / "out"
    env = {**os.environ, "GPUS": "", "PER_GPU": "2", "LIMIT": "0", "PYTHONPATH": ROOT}
    script = os.path.join(ROOT, "benchmarks", "reproduce.sh")
    done = subprocess.run(["bash", script, str(out), f"{path}:gdn {path}:kla:0,1"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "finished" in done.stdout
    assert len(rep.load_rows([str(out / "tiny.gdn.jsonl")])) == 1
    assert {r["seed"] for r in rep.load_rows([str(out / "tiny.kla.s0-1.jsonl")])} == {0, 1}
    assert (out / "report" / "README.md").exists()
    late = subprocess.run(["bash", script, str(tmp_path / "late"), f"{path}:gdn"], env={**env, "LIMIT": "1"},
                          capture_output=True, text=True, timeout=600)
    assert late.returncode == 124 and "not started (time limit)" in late.stdout


@pytest.mark.parametrize("name", ["vla_capacity", "vla_long_context"])
def test_vla_released_mixers_are_the_notebooks_models(name, tmp_path):
    """The *_released mixers of the VLA recipes build the notebook's models (its layers on LayerNorm, a GELU FFN,
    learned positions as long as the task, no residual init scale) and a tiny CPU run of them through the command
    finishes; the other mixers keep kalmix's backbone."""
    import kalmix.bench.synthetic as syn
    path = os.path.join(ROOT, "kalmix", "bench", "recipes", name + ".yaml")
    recipe = load_recipe(path)
    point = recipe.points()[0]
    r = recipe.at(point)
    released = [label for label in r.mixers if label.endswith("_released")]
    assert sorted(released) == ["attention_released", "deltanet_released", "linear_attention_released",
                                "vla_released"]
    for label, spec in r.mixers.items():
        cfg = syn.lm_config(r, spec, None)
        notebook = (cfg.norm, cfg.mlp_act, cfg.position, cfg.residual_init_scale)
        if label in released:
            assert notebook == ("layernorm", "gelu", "learned", False)
            assert cfg.max_position_embeddings == r.task.length()
        else:
            assert notebook == ("rmsnorm", "swiglu", "none", True)
    assert r.mixers["deltanet_released"].mixer == "notebook_deltanet"
    assert r.mixers["attention_released"].kwargs["rope"] is False
    out = tmp_path / "r.jsonl"
    assert main(["bench", "run", path, "--device", "cpu", "--mixers", "deltanet_released", "attention_released",
                 "--set", "train.steps=2", "--set", "train.eval_every=2", "--set", "train.seeds=[42]",
                 "--set", "train.lrs=[3.0e-4]", "--set", f"grid.{next(iter(point))}=[{next(iter(point.values()))}]",
                 "--set", "task.val_examples=16", "--set", "task.test_examples=16", "--out", str(out)]) == 0
    rows = rep.load_rows([str(out)])
    assert sorted(row["mixer"] for row in rows) == ["attention_released", "deltanet_released"]
    assert all(row["status"] == "ok" and row["steps_run"] == 2 for row in rows)
    assert "notebook_deltanet: kalmix torch (chunked PyTorch)" in {row["ran"] for row in rows}


def test_a_cuda_device_without_index_is_pinned_to_the_current_one(monkeypatch):
    """``bench run --device cuda`` (the default on a GPU machine) once failed in torch.cuda.set_device, which
    refuses a CUDA device without an index."""
    from kalmix.bench import synthetic
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(d))
    assert synthetic._pinned("cuda") == torch.device("cuda", 2)
    assert synthetic._pinned("cuda:1") == torch.device("cuda", 1)
    assert calls == [torch.device("cuda", 2), torch.device("cuda", 1)]
    assert synthetic._pinned("cpu") == torch.device("cpu") and len(calls) == 2
