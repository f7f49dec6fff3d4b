"""`kalmix train` end to end on CPU: strict config, a tiny run and its outputs, exact resume after a kill, what a
resumed run may change, a run's lock on its run_dir, SIGINT / SIGTERM, atomic checkpoints, the data cache keyed on
content, quiet bars and CPU threads, the bad inputs that must stop before any step, and 2-process DDP / FSDP2 runs
(gloo) that give one process's loss curve."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kalmix  # noqa: F401
from kalmix.cli import main as cli
from kalmix.layers import ALL_MIXERS
from kalmix.train import checkpoint as ckpt
from kalmix.train.config import load_config, presets
from kalmix.train.loop import Dist, Trainer, cpu_threads, data_cache_dir, resume_point, train
from kalmix.train.optim import lr_factor, param_groups
from kalmix.train.tokenizer import load_tokenizer

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


def _over(corpus, run_dir, **over) -> dict:
    """The dotted keys of a tiny CPU run in ``run_dir`` on the module's corpus, with ``over``."""
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
    return {**base, **over}


def _cfg(corpus, run_dir, **over):
    return load_config(None, _over(corpus, run_dir, **over))


def _losses(run_dir):
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


# ---------------------------------------------------------------- config


def test_an_empty_folder_source_or_field_name_is_refused(tmp_path, capsys):
    """'' as run_dir (the current folder), data.source, text_field or split is refused, from a file or a flag
    (which had read it as null: `got None`)."""
    (tmp_path / "c.yaml").write_text('run_dir: ""\n')
    with pytest.raises(ValueError, match=r"run_dir: String should have at least 1 character \(got ''\)"):
        load_config(str(tmp_path / "c.yaml"))
    for key in ("run_dir", "data.source", "data.text_field", "data.split"):
        assert cli(["train", f"--{key}", "", "--print-config"]) == 2
        assert f"{key}: String should have at least 1 character (got '')" in capsys.readouterr().err
    assert cli(["train", "--data_dir", "", "--print-config"]) == 0        # optional: '' is unset, as before


def test_a_negative_seed_is_refused_with_the_config(capsys):
    """Before any data (the data loader had refused it, after the tokenizer and shards were made)."""
    assert cli(["train", "--seed", "-1", "--print-config"]) == 2
    assert "seed: Input should be greater than or equal to 0 (got -1)" in capsys.readouterr().err


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


def test_a_yaml_file_that_does_not_parse_names_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: 3\n  seq_len: [1, 2\n")
    with pytest.raises(ValueError, match=rf"config file {re.escape(str(bad))}, line 4, column 1: expected ','") as e:
        load_config(str(bad))
    assert "<unicode string>" not in str(e.value)
    (tmp_path / "dup.yaml").write_text("train:\n  steps: 3\n  steps: 4\n")     # PyYAML keeps the last silently
    with pytest.raises(ValueError, match=r"dup\.yaml, line 3, column 3: key 'steps' is given twice \(first on line 2"):
        load_config(str(tmp_path / "dup.yaml"))
    with pytest.raises(ValueError, match=r"--model\.mixer_kwargs '\{a: ', line 1, column 5"):
        load_config(None, {"model.mixer_kwargs": "{a: "})
    assert cli(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kalmix train: error: config file {bad}, line 4, column 1") and "Traceback" not in err
    for text in ("", "# only a comment\n"):
        (tmp_path / "empty.yaml").write_text(text)
        with pytest.raises(ValueError, match=rf"config file {re.escape(str(tmp_path / 'empty.yaml'))} is empty \(or "
                                             r"only comments\); give its sections, or leave CONFIG out"):
            load_config(str(tmp_path / "empty.yaml"))
    assert cli(["train", str(tmp_path / "empty.yaml"), "--print-config"]) == 2
    assert capsys.readouterr().err.startswith(f"kalmix train: error: config file {tmp_path / 'empty.yaml'} is empty")


@pytest.mark.parametrize("over, match", [
    ({"train.steps": True}, r"train\.steps: Input should be a valid integer \(got True\)"),      # not 1
    ({"train.steps": "true"}, r"train\.steps: Input should be a valid integer \(got True\)"),    # a flag's text
    ({"train.steps": "3.0"}, r"train\.steps: Input should be a valid integer \(got 3\.0\)"),    # ints stay ints
    ({"log.progress": "1"}, r"log\.progress: Input should be a valid boolean \(got 1\)"),
    ({"optim.lr": "true"}, r"optim\.lr: Input should be a valid number \(got True\)"),
    ({"optim.lr": ".nan"}, r"optim\.lr: Input should be a finite number"),
    ({"model.attention_layers": ["0", "true"]}, r"model\.attention_layers\.1: Input should be a valid integer"),
    ({"model.attention_layers": ["0", "0"]}, r"model: layer_pattern: attention layer 0 is given twice; give each "
                                             r"layer once"),
    ({"data.max_docs": "yes"}, r"data\.max_docs: Input should be a valid integer \(got True\)"),
    ({"train.device": "tpu"}, r"train\.device: 'tpu' is not a device kalmix trains on; allowed: auto, cpu, cuda, "
                              r"cuda:N"),
    ({"train.device": "cuda:x"}, r"train\.device: 'cuda:x' is not a device"),
    ({"model.mixer": "kaczmarzz"}, r"model\.mixer: unknown mixer 'kaczmarzz'; the mixers are attention, "),
    ({"model.mixers": ["gka", "foo"], "model.num_hidden_layers": 2}, r"model\.mixers: unknown mixer 'foo' \(layer 1"),
    ({"model.mixer_kwargs": "{gkaa: {num_heads: 2}}"}, r"model\.mixer_kwargs: unknown mixer 'gkaa'"),
    ({"model.mixer_kwargs": "{gka: {num_head: 2}}"}, r"model: .*unknown argument\(s\) \['num_head'\]"),
    ({"model.mixers": ["gka", "gka"]}, r"model: .*`mixers` has 2 entries for num_hidden_layers = 4"),
    ({"train.stepz": 3}, r"train\.stepz: unknown key \(known: steps, seq_len, "),
    ({"model.norm": "batchnorm"}, r"model\.norm: Input should be 'rmsnorm' or 'layernorm' \(got 'batchnorm'\)"),
    ({"model.mlp_act": "relu"}, r"model\.mlp_act: Input should be 'swiglu' or 'gelu' \(got 'relu'\)"),
    ({"model.position": "learned"}, r"model: KalmixConfig: position='learned' needs `max_position_embeddings`"),
    ({"model.match_params": "gdnn"}, r"model\.match_params: unknown mixer 'gdnn' \(match_params\)"),
    ({"tokenizer.vocab_size": "99999999999"}, r"tokenizer\.vocab_size: Input should be less than or equal to "
                                              r"4294967296 \(got 99999999999\)"),
    ({"model.match_params": "gdn", "model.intermediate_size": 128},
     r"model: give either `intermediate_size` \(128\) or `match_params` \('gdn'\), not both"),
    ({"model.position": "learned", "model.max_position_embeddings": 100},
     r"model\.max_position_embeddings = 100 rows of learned positions cannot cover rows of train\.seq_len = 512 "
     r"tokens; give at least 512"),
])
def test_config_values_keep_their_types_and_names_are_checked_at_load(over, match):
    with pytest.raises(ValueError, match=match) as e:
        load_config(None, over)
    if "unknown mixer" in match:
        assert all(name in str(e.value) for name in ALL_MIXERS)      # the models package's registry


@pytest.mark.parametrize("mixer, extra", [("attention", {}), ("gka", {"model.attention_every": 2}), ("gdn", {}),
                                          ("kalman", {})])
def test_match_params_sizes_the_mlp_to_the_reference_mixers_count(mixer, extra):
    """match_params moves the MLP width (a multiple of 64) to bring the count within half a width step of the
    reference model's; the reference itself keeps the default width."""
    from kalmix.models import KalmixForCausalLM

    def count(over):
        cfg = load_config(None, {"model.hidden_size": 96, "model.num_hidden_layers": 4, "model.mixer": mixer,
                                 "model.mixer_kwargs": {"attention": {"num_heads": 2}, "gka": {"num_heads": 2},
                                                        "gdn": {"num_heads": 2}, "kalman": {"expand": 1}},
                                 **extra, **over})
        config = cfg.model.kalmix_config(256)
        with torch.device("meta"):
            return config.intermediate_size, sum(p.numel() for p in KalmixForCausalLM(config).parameters())

    default, plain = count({})
    _, gdn = count({"model.mixer": "gdn", "model.attention_every": None})
    width, matched = count({"model.match_params": "gdn"})
    step = 3 * 96 * 64 * 4                                 # SwiGLU's three matrices, 64 more channels, 4 blocks
    assert width % 64 == 0 and abs(matched - gdn) <= step / 2
    assert (width == default) == (abs(plain - gdn) <= step / 2)
    if mixer == "gdn":
        assert (width, matched) == (default, gdn)


def test_match_params_refuses_a_model_the_mlp_cannot_shrink_to():
    with pytest.raises(ValueError, match=r"match_params 'gdn': this model has [\d,]+ parameters at MLP width 256, "
                                         r"[\d,]+ more than the reference's [\d,]+, and even width 64 cannot"):
        load_config(None, {"model.hidden_size": 96, "model.mixer": "kalman", "model.match_params": "gdn",
                           "model.mixer_kwargs": {"kalman": {"expand": 4}}})


def test_backbone_options_reach_the_model(capsys):
    """The model section's backbone options (flags generated from the config) build the VLA notebook's backbone:
    LayerNorm, a GELU MLP, learned positions, no residual init scale; the defaults keep kalmix's."""
    import torch.nn as nn
    from kalmix.models import KalmixForCausalLM
    from kalmix.models.modeling import GeluMLP, RMSNorm, SwiGLU
    assert cli(["train", "cpu-tiny", "--print-config", "--model.norm", "layernorm", "--model.mlp_act", "gelu",
                "--model.position", "learned", "--model.max_position_embeddings", "4096",
                "--model.residual_init_scale", "false"]) == 0
    out = capsys.readouterr().out
    assert all(line in out for line in ("norm: layernorm", "mlp_act: gelu", "position: learned",
                                        "max_position_embeddings: 4096", "residual_init_scale: false"))
    over = {"model.hidden_size": 16, "model.num_hidden_layers": 1, "model.mixer": "notebook_deltanet",
            "model.mixer_kwargs": {"notebook_deltanet": {"num_heads": 2}}, "train.seq_len": 8}
    notebook = {"model.norm": "layernorm", "model.mlp_act": "gelu", "model.position": "learned",
                "model.max_position_embeddings": 8, "model.residual_init_scale": False}
    for extra, norm, mlp in (({}, RMSNorm, SwiGLU), (notebook, nn.LayerNorm, GeluMLP)):
        cfg = load_config(None, {**over, **extra}).model.kalmix_config(64)
        model = KalmixForCausalLM(cfg)
        block = model.model.layers[0]
        assert type(block.mixer_norm) is norm and type(model.model.norm) is norm and type(block.mlp) is mlp
        assert hasattr(model.model, "embed_positions") == bool(extra)
        assert cfg.residual_init_scale is not bool(extra)
    assert model.model.embed_positions.weight.shape == (8, 16)


def test_config_floats_take_ints_and_number_strings(tmp_path):
    cfg = load_config(None, {"optim.lr": "1e-3", "optim.weight_decay": 0, "data.val_fraction": "5e-2",
                             "run_dir": "2024", "tokenizer.path": "null", "train.device": "cuda:1"})
    assert cfg.optim.lr == 1e-3 and cfg.optim.weight_decay == 0.0 and isinstance(cfg.optim.weight_decay, float)
    assert cfg.data.val_fraction == 0.05 and cfg.run_dir == "2024" and cfg.tokenizer.path is None
    assert cfg.train.device == "cuda:1"
    (tmp_path / "c.yaml").write_text("optim: {lr: 1e-3, eps: 1}\ntrain: {steps: 1e3}\n")      # YAML 1.1: '1e3'
    with pytest.raises(ValueError, match=r"c\.yaml\):\n  train\.steps: Input should be a valid integer \(got '1e3'"):
        load_config(str(tmp_path / "c.yaml"))


def test_cli_config_errors_are_one_message_before_any_data(tmp_path, capsys):
    data_dir = tmp_path / "data"
    assert cli(["train", "--train.device", "tpu", "--data_dir", str(data_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kalmix train: error: invalid training config:\n  train.device: 'tpu' is not a device")
    assert cli(["train", "--model.mixer", "gkaa", "--data_dir", str(data_dir), "--run_dir", str(tmp_path / "r")]) == 2
    assert "model.mixer: unknown mixer 'gkaa'" in capsys.readouterr().err
    assert cli(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "config file '" + str(tmp_path / "nope.yaml") + "' does not exist; give a YAML file or a preset (cpu-tiny" \
        in capsys.readouterr().err
    assert not data_dir.exists() and not (tmp_path / "r").exists()


def test_a_run_dir_or_data_dir_that_is_a_file_is_named(corpus, tmp_path, capsys):
    """The message names the key and the file (it had been ``FILE/.lock: Not a directory``); nothing is made."""
    (tmp_path / "file").write_text("")
    flags = [f"--{k}={v}" for k, v in _over(corpus, tmp_path / "run", data_dir=str(tmp_path / "data")).items()
             if k not in ("model.mixer_kwargs",)]
    cases = {("run_dir", "file"): f"run_dir '{tmp_path / 'file'}' is a file, not a folder",
             ("run_dir", "file/run"): f"run_dir '{tmp_path / 'file' / 'run'}': {tmp_path / 'file'} is a file, not a "
                                      "folder",
             ("data_dir", "file"): f"data_dir '{tmp_path / 'file'}' is a file, not a folder"}
    for (key, name), message in cases.items():
        assert cli(["train", *flags, f"--{key}", str(tmp_path / name)]) == 2
        assert capsys.readouterr().err == f"kalmix train: error: {message}\n"
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_a_layer_that_refuses_its_arguments_stops_before_the_data(corpus, tmp_path):
    data_dir = tmp_path / "data"
    with pytest.raises(ValueError, match="`num_heads` = 3 must divide"):
        train(_cfg(corpus, tmp_path / "run", data_dir=str(data_dir), **{
            "model.mixer": "attention", "model.mixer_kwargs": {"attention": {"num_heads": 3}}}))
    assert not data_dir.exists() and not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_a_cuda_device_without_cuda_stops_before_the_data(corpus, tmp_path):
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=f"train.device = {device}, but CUDA is not available"):
            train(_cfg(corpus, tmp_path / "run", data_dir=str(tmp_path / "data"), **{"train.device": device}))
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_tokenizer_cli_errors(corpus, tmp_path, capsys):
    out = tmp_path / "tok"

    def code(argv):
        try:
            return cli(argv)
        except SystemExit as e:                     # the command line's error path exits
            return e.code
    assert code(["tokenizer", "train", "--source", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"kalmix tokenizer train: error: data source not found: {tmp_path / 'nope'}\n"
    assert code(["tokenizer", "train", "--source", str(corpus / "docs.jsonl"), "--text-field", "body",
                "--vocab-size", "100", "--out", str(out)]) == 2
    assert "a vocabulary of 100 is too small: a byte-level BPE needs at least 257" in capsys.readouterr().err
    assert code(["tokenizer", "train", "--format", "jsonl", "--out", str(out)]) == 2
    assert "source 'stdlib' is read as Python files" in capsys.readouterr().err
    assert not out.exists()


def test_tokenizer_cli_says_when_the_corpus_gives_a_smaller_vocabulary(corpus, tmp_path, capsys):
    argv = ["tokenizer", "train", "--source", str(corpus / "docs.jsonl"), "--text-field", "body", "--out"]
    assert cli([*argv, str(tmp_path / "big"), "--vocab-size", "100000000"]) == 0
    size = len(load_tokenizer(tmp_path / "big"))
    assert size < 1000 and capsys.readouterr().err.endswith(
        f"\nkalmix tokenizer train: note: the vocabulary has {size} tokens, not the --vocab-size 100000000 asked: the "
        f"corpus has no more pairs of tokens seen twice to merge\n")
    assert cli([*argv, str(tmp_path / "small"), "--vocab-size", "270"]) == 0
    assert len(load_tokenizer(tmp_path / "small")) == 270 and "note:" not in capsys.readouterr().err


def test_batch_must_divide_over_processes():
    cfg = load_config(None, {"train.global_batch_size": 8, "train.micro_batch_size": 2})
    assert cfg.accumulation(2) == 2
    with pytest.raises(ValueError, match="does not divide over 3 processes"):
        cfg.accumulation(3)


def test_schedules():
    cfg = load_config(None, {"train.steps": 100, "optim.warmup_steps": 10, "optim.min_lr_ratio": 0.1})
    f = [lr_factor(s, cfg.optim, 100) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(f[10:], f[11:]))
    wsd = load_config(None, {"train.steps": 100, "optim.warmup_steps": 10, "optim.schedule": "wsd",
                             "optim.decay_fraction": 0.2, "optim.min_lr_ratio": 0.0})
    g = [lr_factor(s, wsd.optim, 100) for s in range(100)]
    assert g[10:80] == [1.0] * 70 and g[-1] == pytest.approx(0.0) and g[85] < 1.0


def test_param_groups_exempt_norms_embeddings_and_recurrent_parameters():
    from kalmix.models import KalmixConfig, KalmixForCausalLM
    cfg = load_config(None, {"optim.recurrent_lr_mult": 0.5})
    model = KalmixForCausalLM(KalmixConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                           mixers=["kalman", "gka"], mixer_kwargs={"gka": {"num_heads": 2}}))
    groups = {g["name"]: g for g in param_groups(model, cfg.optim)}
    names = {id(p): n for n, p in model.named_parameters()}
    recurrent = {names[id(p)].split(".")[-1] for p in groups["recurrent"]["params"]}
    assert {"A_log", "dt_raw", "p", "skip", "dt_bias"} <= recurrent
    assert groups["recurrent"]["lr_mult"] == 0.5 and groups["recurrent"]["weight_decay"] == 0
    decay = {names[id(p)] for p in groups["decay"]["params"]}
    assert all(p.dim() >= 2 for p in groups["decay"]["params"])
    assert "model.embed_tokens.weight" not in decay and groups["no_decay"]["weight_decay"] == 0
    assert sum(len(g["params"]) for g in groups.values()) == len(list(model.parameters()))
    # optim.decay_embeddings (the synthetic recipes' rule): the embedding joins the decayed matrices
    groups = {g["name"]: g for g in param_groups(model, load_config(None, {"optim.decay_embeddings": True}).optim)}
    assert "model.embed_tokens.weight" in {names[id(p)] for p in groups["decay"]["params"]}
    assert all(p.dim() < 2 for p in groups["no_decay"]["params"])


def test_one_adamw_in_the_package():
    """Every training loop (the trainer, recipe runs, bench mqar) and bench lm's timed step build their optimizer
    through kalmix.train.optim.Optimization."""
    root = Path(__file__).parents[2] / "kalmix"
    found = [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if "optim.AdamW(" in line]
    assert len(found) == 1 and found[0].startswith("train/optim.py:"), found


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


@pytest.mark.parametrize("option, value, steps, rel", [("train.activation_checkpointing", True, 3, 1e-6),
                                                      ("train.compile", True, 2, 1e-5),
                                                      ("model.fuse_cross_entropy", False, 3, 1e-6),
                                                      ("model.recompute_mixers", True, 3, 0)])
def test_option_trains_the_same(corpus, tmp_path, option, value, steps, rel):
    """Activation checkpointing, the compiled MLPs, the loss from the logits (no fused loss) and the recomputed
    mixers (exactly) give the losses of the default run."""
    a, b = tmp_path / "a", tmp_path / "b"
    train(_cfg(corpus, a, **{"train.steps": steps}))
    train(_cfg(corpus, b, **{"train.steps": steps, option: value}))
    la, lb = _losses(a), _losses(b)
    for s in la:
        assert lb[s] == pytest.approx(la[s], rel=rel), (s, la[s], lb[s])


def _grads(model, loss) -> tuple[torch.Tensor, dict]:
    """(the loss, {parameter name: its gradient}) after ``loss.backward()``; the model's gradients are reset."""
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("case", ["fp64", "fp64-checkpointing", "fp64-untied", "bf16"])
def test_the_train_loss_and_every_gradient_equal_the_logits_path(corpus, tmp_path, case):
    """A micro-batch's training loss (packed rows), through the model's fused loss without logits, equals the model's
    loss from its logits (``model.fuse_cross_entropy: false``) and evaluation's per-token losses from the logits
    summed, gradients included: to 1e-10 in fp64 (the weights cast after the build) with or without activation
    checkpointing or a tied LM head; under bf16 autocast the loss to 1e-5 and each gradient to 1% of its norm (the
    fused LM head's gradient sums its chunks in fp32, the plain one rounds it to bf16)."""
    option = {"fp64-checkpointing": {"train.activation_checkpointing": True},
              "fp64-untied": {"model.tie_word_embeddings": False}, "bf16": {"train.dtype": "bf16"}}.get(case, {})
    over = {"train.seq_len": 128, "train.global_batch_size": 2, **option}
    fused = Trainer(_cfg(corpus, tmp_path / "fused", **over), Dist("cpu"))
    plain = Trainer(_cfg(corpus, tmp_path / "plain", **over, **{"model.fuse_cross_entropy": False}), Dist("cpu"))
    if case.startswith("fp64"):
        fused.raw.double(), plain.raw.double()
    (batch,), count = fused._micro_batches()
    assert count > 0 and any(b % 128 for b in batch["cu_seqlens"].bounds)      # documents start inside rows
    got = _grads(fused.raw, fused._loss_sum(batch))
    refs = [_grads(plain.raw, plain._loss_sum(batch)), _grads(plain.raw, plain._token_losses(batch)[0].sum())]
    for loss, grads in refs:
        if case == "bf16":
            torch.testing.assert_close(got[0], loss, rtol=1e-5, atol=0)
            for n, g in grads.items():
                assert (got[1][n] - g).norm() <= 1e-2 * g.norm(), n
        else:
            torch.testing.assert_close(got[0], loss, rtol=1e-12, atol=0)
            for n, g in grads.items():
                torch.testing.assert_close(got[1][n], g, rtol=1e-10, atol=1e-12, msg=n)


def test_the_train_step_holds_no_logits(corpus, tmp_path, monkeypatch):
    """A whole training step (forward, backward, optimizer) under bf16 autocast peaks below half of one bf16 logits
    tensor [N, V] with the fused loss, where the loss from the logits peaks above two fp32 ones (N = 4 × 256 tokens,
    V = 16,384). The fused loss's chunks are cut to 16 tokens, a small part of the batch as at training sizes."""
    import kalmix.models.loss as loss_module
    from kalmix.bench.memory import step_peak_bytes
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 16 * 16384)
    B, T, V = 4, 256, 16384
    peak = {}
    for fused in (True, False):
        trainer = Trainer(_cfg(corpus, tmp_path / str(fused), **{
            "model.vocab_size": V, "model.fuse_cross_entropy": fused, "train.seq_len": T, "train.micro_batch_size": B,
            "train.global_batch_size": B, "train.dtype": "bf16", "eval.rows": B}), Dist("cpu"))
        trainer.train_step()                            # the optimizer's state is made at the first step
        peak[fused] = step_peak_bytes(trainer.train_step)
    logits = B * T * V
    assert peak[True] < logits * 2 / 2
    assert peak[False] > 2 * logits * 4


@pytest.fixture(scope="module")
def full_losses(corpus, tmp_path_factory):
    """The train losses by step of an uninterrupted run of ``_cfg``'s 6 steps."""
    run = tmp_path_factory.mktemp("full") / "run"
    train(_cfg(corpus, run))
    return _losses(run)


def test_profiled_steps_train_as_the_others_and_stop_before_an_evaluation(corpus, tmp_path, full_losses):
    """``log.profile``: the steps after the first log line (step 2 here) are recorded, up to the next evaluation
    (after step 3), so step 3 alone; the run's losses are those of the unprofiled run, and the table and trace
    are written."""
    run = tmp_path / "run"
    train(_cfg(corpus, run, **{"log.every": 2, "log.profile": 5}))
    assert _losses(run) == {k: v for k, v in full_losses.items() if k % 2 == 0 or k == 6}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (prof,) = [r for r in rows if r["kind"] == "profile"]
    assert prof["steps"] == [3, 3] and prof["step_ms"] > 0
    table = (run / "profile" / "rank0.txt").read_text()
    assert table.startswith("rank 0 of 1, steps 3-3: ms per step by category (CPU op self time)")
    assert "GEMM" in table and "top 20 ops by CPU self time" in table
    assert (run / "profile" / "rank0.trace.json.gz").stat().st_size > 0


def test_killed_run_resumes_exactly(corpus, tmp_path, monkeypatch, full_losses):
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
    a, b = full_losses, _losses(killed)
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


def test_resume_applies_the_changes_it_can_and_logs_them(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    train(_cfg(corpus, run, **{"train.steps": 3}))
    capsys.readouterr()
    new = _cfg(corpus, run, **{"train.steps": 6, "optim.lr": 1e-3, "eval.every": 2})
    train(new)
    out = capsys.readouterr().out
    for line in ("changed on resume: train.steps 3 → 6", "changed on resume: optim.lr 0.003 → 0.001",
                 "changed on resume: eval.every 3 → 2"):
        assert line in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in rows if r["kind"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["step"] == 3
    assert resumed[0]["changed"] == {"train.steps": [3, 6], "optim.lr": [0.003, 0.001], "eval.every": [3, 2]}
    lrs = {r["step"]: r["lr"] for r in rows if r["kind"] == "train"}
    for step in (4, 5, 6):                          # the lr used and logged is the new one (and its schedule)
        assert lrs[step] == pytest.approx(1e-3 * lr_factor(step - 1, new.optim, 6), rel=1e-12)
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [3, 4, 6]
    assert load_config(str(run / "config.yaml")).optim.lr == 1e-3       # config.yaml: the config now in force
    more = _cfg(corpus, run, **{"train.steps": 9, "optim.lr": 1e-3, "optim.weight_decay": 0.05, "optim.beta2": 0.9})
    groups = {g["name"]: g for g in Trainer(more, Dist("cpu"), resume_point(more)).optimizer.param_groups}
    assert groups["decay"]["weight_decay"] == 0.05 and groups["no_decay"]["weight_decay"] == 0.0
    assert tuple(groups["decay"]["betas"]) == (0.9, 0.9)


def test_resume_refuses_the_changes_it_cannot_apply_naming_each(corpus, tmp_path):
    run = tmp_path / "run"
    train(_cfg(corpus, run, **{"train.steps": 3}))
    before = (run / "metrics.jsonl").read_text()
    over = {"train.steps": 6, "model.hidden_size": 64, "seed": 1, "train.seq_len": 16, "data.val_fraction": 0.3,
            "tokenizer.vocab_size": 320, "train.global_batch_size": 8, "train.dtype": "bf16",
            "model.mixer_kwargs": {"kaczmarz": {"num_heads": 4}}}
    with pytest.raises(ValueError, match=r"cannot resume from .*step_0000003: a run in progress cannot change ") \
            as e:
        train(_cfg(corpus, run, **over))
    for change in ("model.hidden_size 32 → 64", "seed 0 → 1", "train.seq_len 32 → 16",
                   "data.val_fraction 0.2 → 0.3", "tokenizer.vocab_size 300 → 320", "train.global_batch_size 4 → 8",
                   'train.dtype "fp32" → "bf16"', "model.mixer_kwargs.kaczmarz.num_heads 2 → 4"):
        assert change in str(e.value)
    assert "train.steps" not in str(e.value)                         # a change that applies is not refused
    with pytest.raises(ValueError, match=r"train\.steps = 2 is fewer than the 3 steps done \(.*step_0000003\); "
                                         r"set train\.steps >= 3"):
        train(_cfg(corpus, run, **{"train.steps": 2}))
    assert (run / "metrics.jsonl").read_text() == before


def test_a_finished_run_started_again_says_so_and_does_nothing(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    train(_cfg(corpus, run, **{"train.steps": 3}))
    metrics, model = (run / "metrics.jsonl").read_text(), run / "model" / "model.safetensors"
    mtime = model.stat().st_mtime_ns
    capsys.readouterr()
    assert cli(["train", *_flags(_over(corpus, run, **{"train.steps": 3}))]) == 0
    assert f"{run} is already complete: 3 of train.steps = 3 steps done, the model in {run / 'model'}" \
        in capsys.readouterr().out
    assert train(_cfg(corpus, run, **{"train.steps": 3})) == {}
    assert (run / "metrics.jsonl").read_text() == metrics and model.stat().st_mtime_ns == mtime    # no re-export
    shutil.rmtree(run / "model")                    # complete, but its model deleted: exported again
    train(_cfg(corpus, run, **{"train.steps": 3}))
    assert model.is_file() and "model written to" in capsys.readouterr().out


# ---------------------------------------------------------------- a run owns its run_dir; signals


_HOLD_LOCK = "import sys; from kalmix.train.checkpoint import DirLock; DirLock(sys.argv[1]).acquire(); " \
             "print('locked', flush=True); sys.stdin.read()"


def test_a_run_dir_in_use_is_refused_and_a_dead_owners_lock_taken_over(corpus, tmp_path, capfd):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ckpt.RunDirInUse, match=rf"run_dir {re.escape(str(run))} is in use by pid "
                                                   rf"{holder.pid} on .*; wait for it to finish, stop it, or choose "
                                                   rf"another run_dir"):
            train(_cfg(corpus, run))
        assert cli(["train", *_flags(_over(corpus, run))]) == 2
        assert f"kalmix train: error: run_dir {run} is in use by pid {holder.pid}" in capfd.readouterr().err
        assert [p.name for p in run.iterdir()] == [".lock"]            # nothing written by the refused runs
    finally:
        holder.kill()                                                 # dies holding the lock
        holder.wait()
    train(_cfg(corpus, run, **{"train.steps": 3}))
    assert f"taking over the lock of pid {holder.pid} on" in capfd.readouterr().err
    assert not (run / ".lock").exists() and (run / "model").is_dir()   # released at the end


def test_a_waiting_lock_gets_the_folder_when_its_owner_releases(tmp_path):
    first = ckpt.DirLock(tmp_path / "data", what="data_dir").acquire()
    got = []
    waiter = threading.Thread(target=lambda: got.append(ckpt.DirLock(tmp_path / "data", wait=True).acquire()))
    waiter.start()
    time.sleep(0.3)
    assert not got                                  # still waiting
    first.release()                                 # removes the lock file the waiter had opened: it retries
    waiter.join(10)
    assert got and (tmp_path / "data" / ".lock").is_file()
    assert json.loads((tmp_path / "data" / ".lock").read_text())["pid"] == os.getpid()
    got[0].release()
    folder = tmp_path / "data"                      # created by the first lock: removed by it unless the waiter had
    assert not folder.exists() or not any(folder.iterdir())  # re-opened its lock file there first (then left empty)


def test_checkpoints_leave_no_temporary_folder(tmp_path, monkeypatch):
    """The same step saved twice (a rerun that trained no step, or the race of two processes) replaces its
    metadata instead of failing with 'Directory not empty'; a failed write removes its temporary folder."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    args = (tmp_path, 3, model, opt, {"epoch": 0}, {"seed": 0}, False, 2)
    ckpt.save(*args, data_dir="d")
    ckpt.save(*args, data_dir="d", complete=True)
    assert ckpt.read_meta(ckpt.checkpoints(tmp_path)[-1])["complete"]
    real = torch.save

    def disk_full(obj, path, *a, **k):
        if "rng" in str(path):
            raise OSError(28, "No space left on device")
        return real(obj, path, *a, **k)
    monkeypatch.setattr(ckpt.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        ckpt.save(tmp_path, 6, model, opt, {"epoch": 0}, {"seed": 0}, False, 2, data_dir="d")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_0000003"]


def test_a_new_run_removes_what_a_killed_one_left_half_written(corpus, tmp_path):
    run = tmp_path / "run"
    for stale in (run / "checkpoints" / ".tmp_step_0000003_deadbeef", run / ".model.deadbeef.tmp"):
        stale.mkdir(parents=True)
        (stale / "half").write_text("x")
    train(_cfg(corpus, run, **{"train.steps": 3}))
    assert sorted(p.name for p in run.rglob("*") if ".tmp" in p.name or ".old" in p.name) == []


_SIGNAL_AT = """
import os, signal, sys
from kalmix.train.loop import Trainer
at, sig, rank = int(sys.argv[1]), getattr(signal, sys.argv[2]), int(sys.argv[3])
step = Trainer.train_step
def train_step(self):
    if self.step == at and self.env.rank == rank:
        os.kill(os.getpid(), sig)           # arrives during the step
    return step(self)
Trainer.train_step = train_step
from kalmix.cli import main
sys.exit(main(sys.argv[4:]))
"""


def test_a_signal_before_the_first_step_stops_at_once_and_leaves_nothing(corpus, tmp_path, monkeypatch):
    from kalmix.train import loop
    prepare = loop.prepare_data

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)        # e.g. while the tokenizer trains
        return prepare(*args, **kwargs)
    monkeypatch.setattr(loop, "prepare_data", interrupted)
    with pytest.raises(loop.TrainingInterrupted, match=r"interrupted \(SIGTERM\); no checkpoint was written now") as e:
        train(_cfg(corpus, tmp_path / "run", data_dir=str(tmp_path / "data")))
    assert e.value.exit_code == 143 and e.value.step is None
    assert not (tmp_path / "run").exists()          # lock released, the folder it made removed
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL     # the handlers are the caller's again


@pytest.mark.parametrize("name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_finishes_the_step_writes_a_checkpoint_and_resumes_exactly(corpus, tmp_path, name, code,
                                                                            full_losses):
    run, script = tmp_path / "run", tmp_path / "signal_at.py"
    script.write_text(_SIGNAL_AT)
    r = subprocess.run([sys.executable, str(script), "3", name, "0", "train", *_flags(_over(corpus, run))],
                       env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert r.returncode == code, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == (f"kalmix train: interrupted ({name}) at step 4; checkpoint written to "
                    f"{run / 'checkpoints' / 'step_0000004'}; rerun the same command to resume")
    assert "Traceback" not in r.stderr
    assert [p.name for p in ckpt.checkpoints(run)] == ["step_0000003", "step_0000004"]
    assert not (run / "model").exists() and not (run / ".lock").exists()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    assert rows[-1] == {"kind": "interrupt", "step": 4, "signal": name}
    train(_cfg(corpus, run))                        # the same command again
    losses = _losses(run)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    for s in (5, 6):
        assert losses[s] == full_losses[s], (s, losses[s], full_losses[s])      # bit for bit


# ---------------------------------------------------------------- data cache, bars, threads


def _write_docs(path, n, seed):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"body": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))}) + "\n")


def test_the_data_cache_follows_the_content_of_the_source(corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                     # the default cache is runs/data/<key> of the working folder
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(corpus / "docs.jsonl", src / "a.jsonl")
    over = {"data_dir": None, "data.source": str(src), "train.steps": 3}
    first = data_cache_dir(_cfg(corpus, tmp_path / "a", **over))
    train(_cfg(corpus, tmp_path / "a", **over))
    assert (first / "shards" / "meta.json").is_file()
    _write_docs(src / "b.jsonl", 30, seed=1)        # the source gains a file: a new cache, not an error
    second = data_cache_dir(_cfg(corpus, tmp_path / "b", **over))
    assert second != first
    train(_cfg(corpus, tmp_path / "b", **over))
    assert (second / "shards" / "meta.json").is_file()
    train(_cfg(corpus, tmp_path / "a", **{**over, "train.steps": 6}))      # resumes on the data it started on
    assert ckpt.read_meta(ckpt.checkpoints(tmp_path / "a")[-1])["data_dir"] == str(first.resolve())
    assert sorted(_losses(tmp_path / "a")) == [1, 2, 3, 4, 5, 6]


def test_a_changed_source_in_an_explicit_data_dir_names_data_dir(corpus, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(corpus / "docs.jsonl", src / "a.jsonl")
    over = {"data_dir": str(tmp_path / "data"), "data.source": str(src), "train.steps": 3}
    train(_cfg(corpus, tmp_path / "a", **over))
    _write_docs(src / "b.jsonl", 30, seed=1)
    with pytest.raises(ValueError, match=rf"the source files .* changed; .* \(it is data_dir = "
                                         rf"{re.escape(str(tmp_path / 'data'))}: set another data_dir") as e:
        train(_cfg(corpus, tmp_path / "b", **over))
    assert "out_dir" not in str(e.value)


def test_progress_off_shows_no_third_party_bar(corpus, tmp_path, capfd):
    from transformers.utils import logging as hf_logging
    train(_cfg(corpus, tmp_path / "run", **{"train.steps": 1, "eval.every": 1, "checkpoint.every": 1}))
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "it/s" not in err, err     # transformers' save_pretrained bar
    assert hf_logging.is_progress_bar_enabled()                            # the setting is restored after the run


def test_a_warmup_longer_than_the_run_is_said(corpus, tmp_path, capsys):
    """Allowed (short runs that time something keep a preset's warm-up), but not silently."""
    train(_cfg(corpus, tmp_path / "run", **{"train.steps": 1}))         # optim.warmup_steps = 2
    assert "note: optim.warmup_steps = 2 exceeds train.steps = 1: the learning rate is still warming up at the " \
           "last step, at 1/2 of optim.lr" in capsys.readouterr().out
    train(_cfg(corpus, tmp_path / "whole", **{"train.steps": 2}))
    assert "warmup_steps" not in capsys.readouterr().out


def test_cpu_threads_by_default_and_logged(corpus, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        run = tmp_path / "run"
        train(_cfg(corpus, run, **{"train.threads": None, "train.steps": 1}))
        start = next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                     if json.loads(line)["kind"] == "start")
        assert start["threads"] == 1                        # a small model on CPU: one thread
        assert start["versions"]["torch"] == torch.__version__ and start["versions"]["device_name"]
        assert torch.get_num_threads() == 2                 # and the caller's setting back afterwards
        env = SimpleNamespace(device=torch.device("cpu"), local_world=2)
        big = _cfg(corpus, run, **{"train.threads": None})
        assert cpu_threads(big, env, 10**8) == max(1, len(os.sched_getaffinity(0)) // 2)
        assert cpu_threads(_cfg(corpus, run, **{"train.threads": 3}), env, 10) == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "2")          # the user's choice is kept
        torch.set_num_threads(2)
        assert cpu_threads(big, env, 10) == 2
    finally:
        torch.set_num_threads(before)


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


def test_evaluation_takes_fewer_rows_than_a_micro_batch_and_a_split_too_small_stops_before_the_first_step(
        corpus, tmp_path):
    run = tmp_path / "run"
    train(_cfg(corpus, run, **{"eval.rows": 1, "train.steps": 3}))
    ev = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in ev if r["kind"] == "eval"]
    assert ev and all(r["val_loss"] > 0 for r in ev)
    assert sum(b["tokens"] for b in ev[-1]["loss_by_position"]) <= 32          # one row of 32 tokens

    def plan(rows, val_rows, world, mbs=8):
        cfg = SimpleNamespace(eval=SimpleNamespace(rows=rows), train=SimpleNamespace(micro_batch_size=mbs, seq_len=32))
        return Trainer._eval_plan(SimpleNamespace(cfg=cfg, val_set=range(val_rows), dp_world=world))
    assert plan(64, 47, 4) == (32, 8) and plan(64, 47, 4, mbs=32) == (44, 11) and plan(3, 100, 1) == (3, 3)
    with pytest.raises(ValueError, match=r"holds 3 rows of 32 tokens and eval.rows = 64: fewer than one row for "
                                         r"each of 4 data-parallel processes"):
        plan(64, 3, 4)


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


def test_non_finite_gradients_stop_the_run(corpus, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    real = Trainer._loss_sum

    def nan_at_step_5(self, batch):
        s = real(self, batch)
        return s * float("nan") if self.step == 4 else s
    monkeypatch.setattr(Trainer, "_loss_sum", nan_at_step_5)
    with pytest.raises(FloatingPointError, match="step 5"):
        train(_cfg(corpus, run))
    assert [p.name for p in ckpt.checkpoints(run)] == ["step_0000003"]
    assert cli(["train", *_flags(_over(corpus, tmp_path / "cli"))]) == 1       # one line, no traceback
    assert capsys.readouterr().err.startswith("kalmix train: error: non-finite gradient norm at step 5")


def test_plot_draws_several_runs(corpus, tmp_path):
    from kalmix.train.plot import plot_runs
    a, b = tmp_path / "a", tmp_path / "b"
    train(_cfg(corpus, a, **{"train.steps": 3}))
    train(_cfg(corpus, b, **{"train.steps": 3, "model.mixer": "attention"}))
    out = tmp_path / "loss.png"
    assert cli(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"run '.*a/' is given twice \(as '.*a'\): its curves would be drawn twice"):
        plot_runs([str(a), str(b), str(a) + "/"], str(tmp_path / "twice.png"))


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


@pytest.mark.parametrize("parallel, dtype", [("ddp", "fp32"), ("fsdp", "fp32"), ("ddp", "bf16"), ("fsdp", "bf16")])
def test_two_processes_follow_one_process_curve(corpus, tmp_path, parallel, dtype):
    """Two processes training on the fused loss (no logits; under FSDP2 the LM head's weight gathered in the
    model's forward) follow one process's losses and gradient norms from the logits (fp32: to 2e-5 and 1e-4;
    under bf16 autocast, where they differ by about 1e-4 and 2e-3: to 1e-3 and 1e-2), each recording its step 2
    (``log.profile``) on the way, and an FSDP2 run resumes exactly."""
    tol = {"fp32": (2e-5, 1e-4), "bf16": (1e-3, 1e-2)}[dtype]
    common = {"data_dir": str(corpus / "data"), "data.source": str(corpus / "docs.jsonl"), "data.text_field": "body",
              "data.val_fraction": 0.2, "tokenizer.vocab_size": 300, "model.mixer": "kaczmarz",
              "model.hidden_size": 32, "model.num_hidden_layers": 2,
              "model.mixer_kwargs": {"kaczmarz": {"num_heads": 2}}, "train.steps": 4, "train.seq_len": 32,
              "train.global_batch_size": 8, "train.device": "cpu", "train.dtype": dtype, "train.threads": 1,
              "optim.warmup_steps": 1, "eval.every": 4, "eval.rows": 8, "checkpoint.every": 2, "log.every": 1,
              "log.progress": False, "checkpoint.keep": 3}
    one = tmp_path / "one"
    train(load_config(None, {**common, "run_dir": str(one), "train.micro_batch_size": 4,
                             "model.fuse_cross_entropy": False}))
    two = tmp_path / "two"
    _torchrun(2, _flags({**common, "run_dir": str(two), "train.micro_batch_size": 2, "train.parallel": parallel,
                         "log.profile": 1}))
    assert [(two / "profile" / f"rank{r}.txt").read_text().split(":")[0] for r in (0, 1)] == [
        "rank 0 of 2, steps 2-2", "rank 1 of 2, steps 2-2"]                # every process records step 2
    a, b = _losses(one), _losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    norms = [[r["grad_norm"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"] for run in (one, two)]
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=tol[0], abs=1e-6), (s, a[s], b[s])
    assert norms[1] == pytest.approx(norms[0], rel=tol[1])
    assert (two / "model" / "model.safetensors").is_file()
    if parallel == "fsdp":       # resume from FSDP2's sharded checkpoint of step 2: steps 3-4 again, the same
        import shutil
        shutil.rmtree(two / "checkpoints" / "step_0000004")
        _torchrun(2, _flags({**common, "run_dir": str(two), "train.micro_batch_size": 2, "train.parallel": parallel}))
        rows = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
        again = [r for r in rows if r["kind"] == "train"][4:]
        assert [r["step"] for r in again] == [3, 4]
        assert [r["loss"] for r in again] == [b[3], b[4]]


def test_under_torchrun_every_process_stops_after_the_same_step(corpus, tmp_path):
    """SIGTERM reaches rank 1 alone, during step 2: both processes finish step 2, write its checkpoint together and
    exit with 143; rank 0 says so in one line."""
    run, script = tmp_path / "run", tmp_path / "signal_at.py"
    script.write_text(_SIGNAL_AT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           "1", "SIGTERM", "1", "train", *_flags(_over(corpus, run))]
    r = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert r.stderr.count("kalmix train: interrupted") == 1, r.stderr[-3000:]
    assert (f"kalmix train: interrupted (SIGTERM) at step 2; checkpoint written to "
            f"{run / 'checkpoints' / 'step_0000002'}; rerun the same command to resume") in r.stderr
    assert "TrainingInterrupted" not in r.stderr and "exitcode  : 143" in r.stderr
    assert [p.name for p in ckpt.checkpoints(run)] == ["step_0000002"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "train"] == [1, 2]
