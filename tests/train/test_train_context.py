"""`kalmix train --train.context_parallel N` on CPU with gloo processes: the config's refusals, and runs whose rows
are split over 2 processes (CP = 2, and CP = 2 × DP = 2 on 4 processes; DDP and FSDP2; the fused loss) that follow
one process's loss curve (from the logits) and resume exactly from their checkpoints."""
import json
import shutil
from pathlib import Path

import pytest

from kalmix.train.config import load_config
from kalmix.train.loop import train
from tests.train.test_train import _flags, _losses, _torchrun, corpus  # noqa: F401 - corpus: the module's fixture


def _common(corpus) -> dict:
    """A hybrid (Kaczmarz and attention layers, short convolutions) on rows of 32 tokens packing documents of 5 to
    60 words, so documents cross the pieces' boundaries."""
    return {"data_dir": str(corpus / "data"), "data.source": str(corpus / "docs.jsonl"), "data.text_field": "body",
            "data.val_fraction": 0.2, "tokenizer.vocab_size": 300, "model.mixer": "kaczmarz",
            "model.attention_every": 2, "model.hidden_size": 32, "model.num_hidden_layers": 2,
            "model.mixer_kwargs": {"kaczmarz": {"num_heads": 2}, "attention": {"num_heads": 2}},
            "train.steps": 4, "train.seq_len": 32, "train.global_batch_size": 4, "train.device": "cpu",
            "train.dtype": "fp32", "train.threads": 1, "optim.warmup_steps": 1, "eval.every": 2, "eval.rows": 8,
            "checkpoint.every": 2, "checkpoint.keep": 3, "log.every": 1, "log.progress": False}


def _rows(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.mark.parametrize("over, match", [
    ({"train.seq_len": 30, "train.context_parallel": 4}, "train.seq_len = 30 must divide by train.context_parallel"),
    ({"train.activation_checkpointing": True, "train.context_parallel": 2}, "activation_checkpointing does not"),
    ({"model.mixer": "deltanet", "train.context_parallel": 2}, "deltanet mixer cannot run on a row split"),
    ({"train.context_parallel": 0}, "context_parallel: Input should be greater than or equal to 1"),
])
def test_config_refuses_what_does_not_compose(over, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, over)


def test_processes_split_into_groups_and_the_batch_over_them():
    cfg = load_config(None, {"train.context_parallel": 2, "train.global_batch_size": 8, "train.micro_batch_size": 2})
    assert cfg.accumulation(2) == 4 and cfg.accumulation(4) == 2
    with pytest.raises(ValueError, match="3 process.es. do not split into groups of train.context_parallel = 2"):
        cfg.accumulation(3)
    with pytest.raises(ValueError, match=r"does not divide over 3 data-parallel groups \(6 processes / "
                                         r"train.context_parallel = 2\) × train.micro_batch_size = 2"):
        cfg.accumulation(6)


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("cp") / "one"
    train(load_config(None, {**_common(corpus), "run_dir": str(run), "train.micro_batch_size": 4,
                             "model.fuse_cross_entropy": False}))
    return run


@pytest.mark.parametrize("procs, parallel", [(2, "ddp"), (4, "ddp"), (2, "fsdp")])
def test_context_parallel_follows_one_process_and_resumes_exactly(corpus, one_process, tmp_path, procs, parallel):
    """Rows split in 2 pieces over groups of 2 processes (procs // 2 data-parallel groups), trained on the fused
    loss (each piece's targets, the next piece's first label included, passed to the model): the training and
    validation losses equal one process's from the logits within 1e-6 (fp32); removing the last checkpoint and
    running again resumes from step 2 and repeats steps 3 and 4 exactly."""
    run = tmp_path / "cp"
    flags = _flags({**_common(corpus), "run_dir": str(run), "train.context_parallel": 2,
                    "train.micro_batch_size": 4 // (procs // 2), "train.parallel": parallel})
    _torchrun(procs, flags)
    ref, got = _losses(one_process), _losses(run)
    assert sorted(ref) == sorted(got) == [1, 2, 3, 4]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-6), (step, ref[step], got[step])
    # every scored target counted once over the world, the next piece's first token included
    assert [r["tokens"] for r in _rows(run, "train")] == [r["tokens"] for r in _rows(one_process, "train")]
    for a, b in zip(_rows(one_process, "eval"), _rows(run, "eval"), strict=True):
        assert b["val_loss"] == pytest.approx(a["val_loss"], abs=1e-6)
        assert [x["tokens"] for x in b["loss_by_position"]] == [x["tokens"] for x in a["loss_by_position"]]
    assert _rows(run, "start")[0]["context_parallel"] == 2
    assert (run / "model" / "model.safetensors").is_file()
    shutil.rmtree(run / "checkpoints" / "step_0000004")
    _torchrun(procs, flags)
    again = _rows(run, "train")[4:]
    assert [r["step"] for r in again] == [3, 4]
    assert [r["loss"] for r in again] == [got[3], got[4]]
