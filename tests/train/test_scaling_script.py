"""benchmarks/scaling.py's pieces that need no GPU: the command it launches and the row it reads back from a run's
metrics (the profile's figures included when the run recorded one), and the table of its rows."""
import importlib.util
import json
from pathlib import Path

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
             "host_ms": 90.0},
            {"kind": "train", "step": 20, "tok_s": 400e3, "mfu": 0.08, "mem_gib": 11.1, "loss": 4.0},
            {"kind": "train", "step": 30, "tok_s": 420e3, "mfu": 0.08, "mem_gib": 11.1, "loss": 3.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    row = scaling._summary(run)
    assert row["tok_s"] == 410e3 and row["profile"] == {"steps": [11, 15], "step_ms": 152.0, "busy_ms": 140.0,
                                                         "host_ms": 90.0}
    one = {"mixer": "gdn", "size": "125m", "parallel": "ddp", "gpus": 1, "commit": "c", "gpu": "H100",
           **row, "tok_s": 120e3}
    four = {**one, "gpus": 4, "tok_s": 410e3}
    path = tmp_path / "scaling.jsonl"
    path.write_text(json.dumps(one) + "\n" + json.dumps(four) + "\n")
    assert "| gdn | 125m | 117M | ddp | 4 | 410,000 | 85% |" in scaling.table(path)
