"""`kalmix train` end to end on CPU: config validation, a tiny run and its outputs, exact resume after a kill,
atomic checkpoints, the bad inputs that must stop before any step, and 2-process DDP / FSDP2 runs (gloo) that
give one process's loss curve."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kalmix  # noqa: F401
from kalmix.cli import main as cli
from kalmix.train import checkpoint as ckpt
from kalmix.train.config import load_config, presets
from kalmix.train.loop import Trainer, lr_factor, param_groups, train

WORDS = ("alpha beta gamma delta kalman filter state mean noise gain ridge solve chebyshev step key value query "
         "token layer model train loss").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSONL corpus of 120 short documents and a data folder shared by the module's runs."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    with open(root / "docs.jsonl", "w") as f:
        for _ in range(120):
            n = rng.randint(5, 60)
            f.write(json.dumps({"body": " ".join(rng.choice(WORDS) for _ in range(n))}) + "\n")
    return root


def _cfg(corpus, run_dir, **over):
    base = {
        "run_dir": str(run_dir), "data_dir": str(corpus / "data"),
        "data.source": str(corpus / "docs.jsonl"), "data.text_field": "body", "data.val_fraction": 0.2,
        "tokenizer.vocab_size": 300,
        "model.mixer": "kaczmarz", "model.hidden_size": 32, "model.num_hidden_layers": 2,
        "model.mixer_kwargs": {"kaczmarz": {"num_heads": 2}, "attention": {"num_heads": 2}},
        "train.steps": 6, "train.seq_len": 32, "train.global_batch_size": 4, "train.micro_batch_size": 2,
        "train.device": "cpu", "train.dtype": "fp32", "train.threads": 1,
        "optim.warmup_steps": 2, "eval.every": 3, "eval.rows": 8, "checkpoint.every": 3, "log.every": 1,
        "log.progress": False,
    }
    base.update(over)
    return load_config(None, base)


def _losses(run_dir):
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


# ---------------------------------------------------------------- config


def test_unknown_keys_are_errors_naming_them(tmp_path):
    with pytest.raises(ValueError, match=r"optim\.lrr"):
        load_config(None, {"optim.lrr": 1e-3})
    (tmp_path / "c.yaml").write_text("train:\n  stepz: 3\n")
    with pytest.raises(ValueError, match=r"train\.stepz"):
        load_config(str(tmp_path / "c.yaml"))
    with pytest.raises(ValueError, match="multiple of"):
        load_config(None, {"train.global_batch_size": 6, "train.micro_batch_size": 4})
    with pytest.raises(FileNotFoundError):
        load_config(str(tmp_path / "missing.yaml"))


def test_overrides_parse_as_yaml_and_presets_load(capsys):
    cfg = load_config(None, {"optim.lr": "1e-3", "optim.grad_clip": "null", "model.attention_layers": ["0", "-1"]})
    assert cfg.optim.lr == 1e-3 and cfg.optim.grad_clip is None and cfg.model.attention_layers == [0, -1]
    assert {"cpu-tiny", "gpu-125m"} <= set(presets())
    assert cli(["train", "gpu-125m", "--print-config", "--model.mixer", "kalman", "--train.steps", "7"]) == 0
    out = capsys.readouterr().out
    assert "mixer: kalman" in out and "steps: 7" in out and "hidden_size: 768" in out


def test_batch_must_divide_over_processes():
    cfg = load_config(None, {"train.global_batch_size": 8, "train.micro_batch_size": 2})
    assert cfg.accumulation(2) == 2
    with pytest.raises(ValueError, match="does not divide over 3 processes"):
        cfg.accumulation(3)


def test_schedules():
    cfg = load_config(None, {"train.steps": 100, "optim.warmup_steps": 10, "optim.min_lr_ratio": 0.1})
    f = [lr_factor(s, cfg) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(f[10:], f[11:]))
    wsd = load_config(None, {"train.steps": 100, "optim.warmup_steps": 10, "optim.schedule": "wsd",
                             "optim.decay_fraction": 0.2, "optim.min_lr_ratio": 0.0})
    g = [lr_factor(s, wsd) for s in range(100)]
    assert g[10:80] == [1.0] * 70 and g[-1] == pytest.approx(0.0) and g[85] < 1.0


def test_param_groups_exempt_norms_embeddings_and_recurrent_parameters():
    from kalmix.models import KalmixConfig, KalmixForCausalLM
    cfg = load_config(None, {"optim.recurrent_lr_mult": 0.5})
    model = KalmixForCausalLM(KalmixConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                           mixers=["kalman", "gka"], mixer_kwargs={"gka": {"num_heads": 2}}))
    groups = {g["name"]: g for g in param_groups(model, cfg)}
    names = {id(p): n for n, p in model.named_parameters()}
    recurrent = {names[id(p)].split(".")[-1] for p in groups["recurrent"]["params"]}
    assert {"A_log", "dt_raw", "p", "skip", "dt_bias"} <= recurrent
    assert groups["recurrent"]["lr_mult"] == 0.5 and groups["recurrent"]["weight_decay"] == 0
    decay = {names[id(p)] for p in groups["decay"]["params"]}
    assert all(p.dim() >= 2 for p in groups["decay"]["params"])
    assert "model.embed_tokens.weight" not in decay and groups["no_decay"]["weight_decay"] == 0
    assert sum(len(g["params"]) for g in groups.values()) == len(list(model.parameters()))


# ---------------------------------------------------------------- a run, its outputs, resume


def test_run_writes_metrics_checkpoints_and_a_loadable_model(corpus, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    run = tmp_path / "run"
    last = train(_cfg(corpus, run))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("train") == 6 and kinds.count("eval") == 2
    ev = [r for r in rows if r["kind"] == "eval"][-1]
    assert ev["val_ppl"] == pytest.approx(torch.tensor(ev["val_loss"]).exp().item())
    assert len(ev["loss_by_position"]) == 8 and sum(b["tokens"] for b in ev["loss_by_position"]) > 0
    assert last["loss"] == rows[-2]["loss"] or last["loss"] > 0
    assert [p.name for p in ckpt.checkpoints(run)] == ["step_0000003", "step_0000006"]
    assert (run / "config.yaml").is_file()
    model = AutoModelForCausalLM.from_pretrained(run / "model")
    tok = AutoTokenizer.from_pretrained(run / "model")
    ids = torch.tensor([tok("kalman filter state").input_ids])
    assert model(ids).logits.shape[-1] == model.config.vocab_size >= len(tok)


@pytest.mark.parametrize("option, steps, rel", [("train.activation_checkpointing", 3, 1e-6),
                                               ("train.compile", 2, 1e-5)])
def test_option_trains_the_same(corpus, tmp_path, option, steps, rel):
    """Activation checkpointing and the compiled MLPs give the losses of the plain run."""
    a, b = tmp_path / "a", tmp_path / "b"
    train(_cfg(corpus, a, **{"train.steps": steps}))
    train(_cfg(corpus, b, **{"train.steps": steps, option: True}))
    la, lb = _losses(a), _losses(b)
    for s in la:
        assert lb[s] == pytest.approx(la[s], rel=rel), (s, la[s], lb[s])


def test_killed_run_resumes_exactly(corpus, tmp_path, monkeypatch):
    full = tmp_path / "full"
    train(_cfg(corpus, full))
    killed = tmp_path / "killed"
    step = Trainer.train_step

    def dies_at_5(self):
        if self.step == 4:
            raise KeyboardInterrupt("killed")
        return step(self)
    monkeypatch.setattr(Trainer, "train_step", dies_at_5)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(corpus, killed))
    monkeypatch.setattr(Trainer, "train_step", step)
    assert [p.name for p in ckpt.checkpoints(killed)] == ["step_0000003"]
    train(_cfg(corpus, killed))
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 4, 5, 6]                         # the kill came after step 4; resumed from 3
    a, b = _losses(full), _losses(killed)
    for s in (4, 5, 6):
        assert a[s] == b[s], (s, a[s], b[s])                      # bit for bit


def test_interrupted_checkpoint_write_leaves_the_previous_one(corpus, tmp_path, monkeypatch):
    run = tmp_path / "run"
    real = os.replace
    calls = {"n": 0}

    def crash_on_second_checkpoint(src, dst):
        if Path(src).name.startswith(".tmp_step_0000006"):
            calls["n"] += 1
            raise KeyboardInterrupt("killed mid-write")
        return real(src, dst)
    monkeypatch.setattr(ckpt.os, "replace", crash_on_second_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(corpus, run))
    assert calls["n"] == 1
    assert [p.name for p in ckpt.checkpoints(run)] == ["step_0000003"]
    assert ckpt.read_meta(ckpt.checkpoints(run)[-1])["step"] == 3


# ---------------------------------------------------------------- bad input stops before any step


def _no_step(run_dir):
    return not Path(run_dir, "metrics.jsonl").exists()


def test_missing_or_empty_data(corpus, tmp_path):
    run = tmp_path / "run"
    with pytest.raises((FileNotFoundError, ValueError), match="nope"):
        train(_cfg(corpus, run, **{"data.source": str(tmp_path / "nope.jsonl"), "data_dir": str(tmp_path / "d")}))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError):
        train(_cfg(corpus, run, **{"data.source": str(tmp_path / "empty.jsonl"), "data_dir": str(tmp_path / "e")}))
    assert _no_step(run)


def test_vocabulary_that_does_not_fit(corpus, tmp_path):
    with pytest.raises(ValueError, match="smaller than the tokenizer's vocabulary"):
        train(_cfg(corpus, tmp_path / "run", **{"model.vocab_size": 100}))
    assert _no_step(tmp_path / "run")


def test_a_model_that_cannot_run_stops_before_any_step(corpus, tmp_path):
    """The shape check runs one forward and backward at the training shape and reports the layer's error (here:
    GKA's Triton kernels take head dimensions up to 128)."""
    over = {"model.mixer": "gka", "model.hidden_size": 160, "model.mixer_kwargs": {"gka": {"num_heads": 1}},
            "model.impl": "triton"}
    with pytest.raises(ValueError, match="cannot train on rows"):
        train(_cfg(corpus, tmp_path / "run", **over))
    assert _no_step(tmp_path / "run")


def test_corrupt_foreign_and_mismatched_checkpoints(corpus, tmp_path):
    run = tmp_path / "run"
    train(_cfg(corpus, run, **{"train.steps": 3}))
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="model.hidden_size|model: checkpoint"):
        train(_cfg(corpus, run, **{"model.hidden_size": 64, "train.steps": 6}))
    meta = ckpt.checkpoints(run)[-1] / "meta.pt"
    meta.write_bytes(meta.read_bytes()[:50])
    with pytest.raises(ckpt.CheckpointError, match="cannot read"):
        train(_cfg(corpus, run, **{"train.steps": 6}))
    torch.save({"step": 3}, meta)
    with pytest.raises(ckpt.CheckpointError, match="not a kalmix training checkpoint"):
        train(_cfg(corpus, run, **{"train.steps": 6}))
    assert (run / "metrics.jsonl").read_text() == before          # nothing already written was lost
    with pytest.raises(ValueError, match="resume = never"):
        train(_cfg(corpus, run, resume="never"))


def test_non_finite_gradients_stop_the_run(corpus, tmp_path, monkeypatch):
    run = tmp_path / "run"
    real = Trainer._loss_sums

    def nan_at_step_5(self, batch):
        s, losses, mask = real(self, batch)
        return (s * float("nan") if self.step == 4 and self.model.training else s), losses, mask
    monkeypatch.setattr(Trainer, "_loss_sums", nan_at_step_5)
    with pytest.raises(FloatingPointError, match="step 5"):
        train(_cfg(corpus, run))
    assert [p.name for p in ckpt.checkpoints(run)] == ["step_0000003"]


def test_plot_draws_several_runs(corpus, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(_cfg(corpus, a, **{"train.steps": 3}))
    train(_cfg(corpus, b, **{"train.steps": 3, "model.mixer": "attention"}))
    out = tmp_path / "loss.png"
    assert cli(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- torchrun, gloo


def _torchrun(n, args, env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           "-m", "kalmix.cli", "train", *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


def _flags(cfg_over: dict) -> list[str]:
    out = []
    for k, v in cfg_over.items():
        out += [f"--{k}", json.dumps(v) if isinstance(v, (dict, list, bool)) or v is None else str(v)]
    return out


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_follow_one_process_curve(corpus, tmp_path, parallel):
    common = {"data_dir": str(corpus / "data"), "data.source": str(corpus / "docs.jsonl"), "data.text_field": "body",
              "data.val_fraction": 0.2, "tokenizer.vocab_size": 300, "model.mixer": "kaczmarz",
              "model.hidden_size": 32, "model.num_hidden_layers": 2,
              "model.mixer_kwargs": {"kaczmarz": {"num_heads": 2}}, "train.steps": 4, "train.seq_len": 32,
              "train.global_batch_size": 8, "train.device": "cpu", "train.dtype": "fp32", "train.threads": 1,
              "optim.warmup_steps": 1, "eval.every": 4, "eval.rows": 8, "checkpoint.every": 2, "log.every": 1,
              "log.progress": False, "checkpoint.keep": 3}
    one = tmp_path / "one"
    train(load_config(None, {**common, "run_dir": str(one), "train.micro_batch_size": 4}))
    two = tmp_path / "two"
    _torchrun(2, _flags({**common, "run_dir": str(two), "train.micro_batch_size": 2, "train.parallel": parallel}))
    a, b = _losses(one), _losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=2e-5, abs=1e-6), (s, a[s], b[s])
    assert (two / "model" / "model.safetensors").is_file()
    if parallel == "fsdp":       # resume from FSDP2's sharded checkpoint of step 2: steps 3-4 again, the same
        import shutil
        shutil.rmtree(two / "checkpoints" / "step_0000004")
        _torchrun(2, _flags({**common, "run_dir": str(two), "train.micro_batch_size": 2, "train.parallel": parallel}))
        rows = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
        again = [r for r in rows if r["kind"] == "train"][4:]
        assert [r["step"] for r in again] == [3, 4]
        assert [r["loss"] for r in again] == [b[3], b[4]]
