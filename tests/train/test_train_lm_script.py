"""benchmarks/train_lm.sh on CPU: jobs spread over groups of (here nominal) GPUs side by side, a group of two as
one torchrun (gloo), a hybrid job (MIXER@K), finished runs skipped on a rerun, the loss plot, and a bad PER_RUN refused (reproduce.sh's PER_GPU and LIMIT are checked by the same helper)."""
import json
import os
import random
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "train_lm.sh"
WORDS = "alpha beta gamma delta kalman filter state mean noise gain ridge solve key value query token".split()


def _corpus(root: Path) -> Path:
    rng = random.Random(0)
    path = root / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))})
                            + "\n" for _ in range(80)))
    return path


def _run(out: Path, jobs: str, gpus: str, per_run: str | None, corpus: Path):
    env = dict(os.environ, PRESET="cpu-tiny", GPUS=gpus, OMP_NUM_THREADS="1")
    env.pop("PER_RUN", None)
    if per_run is not None:
        env["PER_RUN"] = per_run
    flags = ["--data.source", str(corpus), "--data.val_fraction", "0.2", "--tokenizer.vocab_size", "300",
             "--model.hidden_size", "32", "--train.steps", "2", "--train.seq_len", "32",
             "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.device", "cpu",
             "--eval.every", "2", "--eval.rows", "4", "--checkpoint.every", "2", "--log.every", "1"]
    return subprocess.run(["bash", str(SCRIPT), str(out), jobs, *flags], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def _start(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


def test_jobs_run_side_by_side_and_a_group_of_two_under_torchrun(tmp_path):
    corpus = _corpus(tmp_path)
    out = tmp_path / "lm"
    r = _run(out, "gdn kaczmarz:1", "0 1", "1", corpus)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gdn: finished (GPUs 0)" in r.stdout and "kaczmarz:1: finished (GPUs 1)" in r.stdout
    for run, mixer in ((out / "gdn", "gdn"), (out / "kaczmarz.s1", "kaczmarz")):
        assert (run / "model" / "config.json").is_file() and _start(run)["mixers"] == [mixer, mixer]
        assert _start(run)["world_size"] == 1
    assert (out / "loss.png").is_file()
    again = _run(out, "gdn kaczmarz:1", "0 1", "1", corpus)
    assert again.returncode == 0 and again.stdout.count("finished before") == 2, again.stdout
    pair = _run(out, "gdn@2", "0 1", None, corpus)         # PER_RUN defaults to every GPU: one torchrun of 2
    assert pair.returncode == 0, pair.stdout + pair.stderr
    assert "gdn@2: finished (GPUs 0,1)" in pair.stdout
    assert _start(out / "gdn@2")["world_size"] == 2 and _start(out / "gdn@2")["mixers"] == ["gdn", "attention"]


def test_a_per_run_that_does_not_divide_the_gpus_is_refused(tmp_path):
    r = _run(tmp_path / "lm", "gdn", "0 1", "3", tmp_path / "none.jsonl")
    assert r.returncode == 1 and "PER_RUN = 3 must be at least 1 and divide the 2 GPUs of GPUS = '0 1'" in r.stderr
    assert not (tmp_path / "lm" / "gdn").exists()


@pytest.mark.parametrize("script, env, message", [
    ("train_lm.sh", {"LIMIT": "abc"}, "train_lm.sh: LIMIT = 'abc' must be a whole number >= 0"),
    ("train_lm.sh", {"LIMIT": "-5"}, "train_lm.sh: LIMIT = '-5' must be a whole number >= 0"),
    ("train_lm.sh", {"GPUS": "0 1", "PER_RUN": "0"}, "train_lm.sh: PER_RUN = '0' must be a whole number >= 1"),
    ("train_lm.sh", {"GPUS": "0 1", "PER_RUN": "two"}, "train_lm.sh: PER_RUN = 'two' must be a whole number >= 1"),
    ("reproduce.sh", {"PER_GPU": "0"}, "reproduce.sh: PER_GPU = '0' must be a whole number >= 1"),
    ("reproduce.sh", {"PER_GPU": "x"}, "reproduce.sh: PER_GPU = 'x' must be a whole number >= 1"),
    ("reproduce.sh", {"LIMIT": "1.5"}, "reproduce.sh: LIMIT = '1.5' must be a whole number >= 0"),
])
def test_a_bad_number_in_the_environment_is_refused(script, env, message, tmp_path):
    """A value that is not a whole number in range is named before anything is made (it was read as 0: no limit,
    or no slot to run a job in)."""
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / script), str(tmp_path / "out"), "gdn"], cwd=ROOT,
                       env={**os.environ, "GPUS": "", **env}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr == message + "\n", r.stdout + r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["train_lm.sh", "reproduce.sh"])
def test_an_out_that_is_a_file_is_refused(script, tmp_path):
    """OUT a file: one message before any job (mkdir's error was printed and every job then failed, pointing at a
    log under the file)."""
    out = tmp_path / "out"
    out.write_text("")
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / script), str(out), "gdn"], cwd=ROOT,
                       env={**os.environ, "GPUS": ""}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr == f"{script}: OUT = '{out}' is a file; give a folder for the runs\n", \
        r.stdout + r.stderr
    assert r.stdout == ""
