"""benchmarks/scaling.py's pieces that need no GPU: the command it launches and the row it reads back from a run's
metrics (the profile's figures included when the run recorded one), and the table of its rows."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("scaling", ROOT / "benchmarks" / "scaling.py")
scaling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scaling)


def test_the_command_passes_the_profile_and_the_row_keeps_its_figures(tmp_path):
    cmd = scaling._cmd(tmp_path, "gdn", "125m", "ddp", 4, 30, tmp_path / "run", profile=5)
    assert cmd[cmd.index("--log.profile") + 1] == "5" and "--nproc-per-node=4" in cmd
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"kind": "start", "params": 117e6, "tokens_per_step": 65536},
            {"kind": "train", "step": 10, "tok_s": 1.0, "mfu": 0.1, "mem_gib": 10.0, "loss": 5.0},
            {"kind": "profile", "steps": [11, 15], "folder": "x", "step_ms": 152.0, "busy_ms": 140.0,
             "host_ms": 90.0, "idle_fraction": 0.08, "launches": 4100.0},
            {"kind": "train", "step": 20, "tok_s": 400e3, "mfu": 0.08, "mem_gib": 11.1, "loss": 4.0},
            {"kind": "train", "step": 30, "tok_s": 420e3, "mfu": 0.08, "mem_gib": 11.1, "loss": 3.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    row = scaling._summary(run)
    assert row["tok_s"] == 410e3 and row["profile"] == {"steps": [11, 15], "step_ms": 152.0, "busy_ms": 140.0,
                                                         "host_ms": 90.0, "idle_fraction": 0.08, "launches": 4100.0}
    one = {"mixer": "gdn", "size": "125m", "parallel": "ddp", "gpus": 1, "commit": "c", "gpu": "H100",
           **row, "tok_s": 120e3}
    four = {**one, "gpus": 4, "tok_s": 410e3}
    path = tmp_path / "scaling.jsonl"
    path.write_text(json.dumps(one) + "\n" + json.dumps(four) + "\n")
    assert "| gdn | 125m | 117M | ddp | 32 | 4 | 410,000 | 85% |" in scaling.table(path)


def test_rows_per_gpu_sets_the_micro_batch_and_the_global_batch_and_has_its_own_baseline(tmp_path):
    cmd = scaling._cmd(tmp_path, "gdn", "125m", "ddp", 4, 30, tmp_path / "run", rows_per_gpu=32)
    assert cmd[cmd.index("--train.micro_batch_size") + 1] == "32"
    assert cmd[cmd.index("--train.global_batch_size") + 1] == "128"
    assert "--train.global_batch_size" not in scaling._cmd(tmp_path, "gdn", "125m", "ddp", 4, 30, tmp_path / "r")
    base = {"mixer": "gdn", "size": "125m", "parallel": "ddp", "commit": "c", "gpu": "H100", "params": 117e6,
            "mfu": 0.1, "mem_gib": 9.8}
    rows = [{**base, "gpus": 1, "tok_s": 120e3}, {**base, "gpus": 4, "tok_s": 383e3},
            {**base, "gpus": 1, "rows_per_gpu": 32, "tok_s": 235e3},
            {**base, "gpus": 4, "rows_per_gpu": 32, "tok_s": 820e3}]
    path = tmp_path / "scaling.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = scaling.table(path)
    assert "| gdn | 125m | 117M | ddp | 32 | 4 | 383,000 | 80% |" in text
    assert "| gdn | 125m | 117M | ddp | 32/GPU | 4 | 820,000 | 87% |" in text


@pytest.mark.parametrize("argv, message", [
    (["run", "{tmp}/out", "--gpus", "0"], "scaling.py run: error: argument --gpus: must be a whole number >= 1; got '0'"),
    (["run", "{tmp}/out", "--steps", "-1"], "argument --steps: must be a whole number >= 1; got '-1'"),
    (["run", "{tmp}/out", "--rows-per-gpu", "0"], "argument --rows-per-gpu: must be a whole number >= 1; got '0'"),
    (["run", "{tmp}/out", "--profile", "x"], "argument --profile: must be a whole number >= 0; got 'x'"),
    (["run", "{tmp}/out", "--mixers", "mamba"], "argument --mixers: invalid choice: 'mamba' (choose from 'attention'"),
    (["run", "{tmp}/file"], "scaling.py run: error: OUT '{tmp}/file' is a file; give a folder"),
    (["prepare", "{tmp}/file"], "scaling.py prepare: error: OUT '{tmp}/file' is a file; give a folder"),
    (["run", "{tmp}/cut", "--gpus", "1"], "scaling.py run: error: {tmp}/cut/scaling.jsonl:2: not JSON"),
    (["table", "{tmp}/nope.jsonl"], "scaling.py table: error: {tmp}/nope.jsonl: No such file or directory"),
    (["table", "{tmp}"], "scaling.py table: error: {tmp}: Is a directory"),
    (["table", "{tmp}/file"], "scaling.py table: error: {tmp}/file: no rows (an empty file)"),
    (["table", "{tmp}/cut/scaling.jsonl"], "scaling.py table: error: {tmp}/cut/scaling.jsonl:2: not JSON"),
    (["table", "{tmp}/other.jsonl"], "scaling.py table: error: {tmp}/other.jsonl:1: not a row of `scaling.py run` "
                                     "(it lacks size, parallel, gpus, commit, gpu)"),
])
def test_bad_arguments_and_files_are_one_message(argv, message, tmp_path, capsys):
    """Each is refused before any run (it had run a data preparation, or ended in a traceback, or an empty file
    gave an empty table); nothing is made."""
    (tmp_path / "file").write_text("")
    (tmp_path / "cut").mkdir()
    row = json.dumps({"mixer": "gdn", "size": "125m", "parallel": "ddp", "gpus": 1, "commit": "c", "gpu": "g"})
    (tmp_path / "cut" / "scaling.jsonl").write_text(row + "\n" + row[:30])
    (tmp_path / "other.jsonl").write_text('{"mixer": "gdn"}\n')
    with pytest.raises(SystemExit) as e:
        scaling.main([a.format(tmp=tmp_path) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_a_failed_preparation_is_one_message(tmp_path):
    """The data preparation's `kalmix train` failing (here: OUT under a file) ends the script with its status in one
    line after train's own message, not a CalledProcessError traceback."""
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match=r"scaling.py: preparing .*file/x/data failed: `kalmix train` exited with "
                                         r"status 2 \(its message is above\)"):
        scaling.prepare(tmp_path / "file" / "x")
