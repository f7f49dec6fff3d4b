"""`gpu_tests/cp_nccl.py speed` over several lengths on CPU: two gloo processes under torchrun (``--gloo``) with tiny
models and simulated out-of-memory errors (on rank 0's one-GPU step; on every rank under CP; on one rank only,
after the step's collectives): every rank agrees on each attempt's status, skips the same longer lengths and goes
on to the next model; the rows and their table; the arguments' refusals."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "gpu_tests" / "cp_nccl.py"


def _load():
    spec = importlib.util.spec_from_file_location("cp_nccl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cp_nccl = _load()

# run under torchrun: tiny models; out of memory (raised where the step would) at chosen (model, where, T, ranks),
# "after" on one rank only: its step ran, with every collective, then its last allocation failed
_WRAPPER = textwrap.dedent("""
    import importlib.util, sys
    import torch
    import torch.distributed as dist
    spec = importlib.util.spec_from_file_location("cp_nccl", {script!r})
    cp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cp)
    from kalmix.models import KalmixConfig, KalmixForCausalLM

    def tiny(mixers):
        return KalmixForCausalLM(KalmixConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=len(mixers), mixers=mixers,
                                              mixer_kwargs={{m: {{"num_heads": 2}} for m in set(mixers)}}))
    cp.speed_models = lambda preset, only: {{"gdn": lambda: tiny(["gdn", "gdn"]),
                                            "hybrid": lambda: tiny(["gdn", "attention"])}}
    OOM = {{("gdn", False, 64): "before", ("gdn", True, 128): "before", ("hybrid", True, 64): "after"}}
    real = cp.measured

    def measured(model, ids, reps, device, split=False):
        name = "hybrid" if model.config.mixers[-1] == "attention" else "gdn"
        T = ids.shape[1] * (dist.get_world_size() if split else 1)
        when = OOM.get((name, split, T))
        if when == "before":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        out = real(model, ids, reps, device, split)
        if when == "after" and dist.get_rank() == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, rank 1 alone)")
        return out
    cp.measured = measured
    cp.main()
""")


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """`speed 128,32,64 --gloo --reps 1` on 2 gloo ranks -> (JSON rows of cp_speed.jsonl, torchrun's output)."""
    tmp = tmp_path_factory.mktemp("cp_speed")
    wrapper = tmp / "speed.py"
    wrapper.write_text(_WRAPPER.format(script=str(SCRIPT)))
    env = dict(os.environ, OMP_NUM_THREADS="1", OUT=str(tmp), KALMIX_COMMIT="abc1234",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(wrapper), "speed", "128,32,64", "--gloo", "--reps", "1"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads(line) for line in (tmp / "cp_speed.jsonl").read_text().splitlines()], r.stdout + r.stderr


def test_every_rank_agrees_on_each_oom_and_skips_the_same_lengths(swept):
    rows, output = swept
    got = [(r["model"], r["T"], r["status_1gpu"], r["status_cp"]) for r in rows]
    assert got == [("gdn", 32, "ok", "ok"), ("gdn", 64, "oom", "ok"), ("gdn", 128, "skipped (oom at 64)", "oom"),
                   ("hybrid", 32, "ok", "ok"), ("hybrid", 64, "ok", "oom"),
                   ("hybrid", 128, "ok", "skipped (oom at 64)")]
    for r in rows:
        assert (r["gpus"], r["commit"], r["gpu"], r["preset"]) == (2, "abc1234", "cpu", None)
        assert r["mem_1gpu_gib"] is None and r["mem_cp_gib"] is None            # CUDA's statistics only
        for where in ("1gpu", "cp"):
            assert (r[f"ms_{where}"] is not None) == (r[f"status_{where}"] == "ok")
        assert (r["speedup"] is None) == (r["status_cp"] != "ok" or r["status_1gpu"] != "ok")
        if r["speedup"] is not None:
            assert r["speedup"] == pytest.approx(r["ms_1gpu"] / r["ms_cp"])
    assert "cp speed hybrid             T=64 1 GPU" in output and "| 2 GPUs oom ms - GiB | speed-up -" in output
    assert "cp speed: hybrid T=128 2 GPUs ..." not in output                # not tried
    assert "Traceback" not in output


def test_table_renders_the_swept_rows_and_each_longest(swept, tmp_path):
    rows, _ = swept
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = cp_nccl.table(str(path))
    lines = text.splitlines()
    gdn64 = next(r for r in rows if (r["model"], r["T"]) == ("gdn", 64))
    assert f"| gdn | 64 | 2 | oom | {gdn64['ms_cp']:.0f} | - | - / - |" in lines
    assert any(line.startswith("| gdn | 128 | 2 | not tried | oom | - |") for line in lines)
    assert any(line.startswith("| hybrid | 128 | 2 | ") and "| not tried | - |" in line for line in lines)
    assert "| model | GPUs | longest T on 1 GPU (tokens/s) | longest T under CP (tokens/s) |" in lines
    gdn32 = next(r for r in rows if (r["model"], r["T"]) == ("gdn", 32))
    hyb128 = next(r for r in rows if (r["model"], r["T"]) == ("hybrid", 128))
    cp_gdn = 64 / gdn64["ms_cp"] * 1e3
    assert f"| gdn | 2 | 32 ({32 / gdn32['ms_1gpu'] * 1e3:,.0f}) | 64 ({cp_gdn:,.0f}) |" in lines
    assert f"| hybrid | 2 | ≥ 128 ({128 / hyb128['ms_1gpu'] * 1e3:,.0f}) | 32 (" in text
    assert lines[-1] == "Measured at commit abc1234 on cpu."


def test_table_of_rows_before_statuses_is_unchanged(tmp_path):
    """A row of one length without statuses (the committed 64K rows) reads as measured; no longest table."""
    row = {"model": "gdn", "T": 65536, "gpus": 2, "ms_1gpu": 353.3, "ms_cp": 248.0, "speedup": 1.4246,
           "mem_1gpu_gib": 64.1, "mem_cp_gib": 37.71, "gpu": "NVIDIA H100 80GB HBM3", "commit": "859bfc2"}
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert cp_nccl.table(str(path)).splitlines() == [
        "| model | T | GPUs | 1 GPU (ms) | CP (ms) | speed-up | memory 1 GPU / CP per GPU (GiB) |",
        "|---|---|---|---|---|---|---|", "| gdn | 65,536 | 2 | 353 | 248 | 1.42× | 64.1 / 37.7 |", "",
        "Measured at commit 859bfc2 on NVIDIA H100 80GB HBM3."]


def test_preset_models_are_bench_lms(monkeypatch):
    """--preset: bench lm's kalmix models of that shape, sized as it sizes them (counted on the meta device here)."""
    import torch
    from kalmix.bench.lm import LMBenchConfig, matched_specs
    models = cp_nccl.speed_models("1b", ["gdn", "hybrid"])
    assert list(models) == ["gdn", "hybrid"]
    with torch.device("meta"):
        n = sum(p.numel() for p in models["gdn"]().parameters())
    assert n == matched_specs(LMBenchConfig(preset="1b", models=["gdn"]))[1]["gdn"]
    assert list(cp_nccl.speed_models(None, ["hybrid", "kalman"])) == ["hybrid gdn+attn/4", "kalman"]


@pytest.mark.parametrize("argv, env, message", [
    (["speed", "65536,abc"], {}, r"argument lengths: lengths must be comma-separated integers, e.g. 65536,131072; "
                                 r"got '65536,abc'"),
    (["speed", "1,64"], {}, r"a length must be at least 2 tokens; got 1"),
    (["speed", "64,98"], {"WORLD_SIZE": "4"}, r"cp_nccl.py speed: error: lengths \[98\] do not divide by the 4 ranks"),
    (["speed", "64", "gdn,mamba"], {}, r"unknown model\(s\) \['mamba'\]; expected any of hybrid, gdn, attention"),
    (["speed", "64", "--preset", "7b"], {}, r"argument --preset: invalid choice: '7b' \(choose from '?default'?, "
                                            r"'?125m'?, '?1b'?\)"),
    (["speed", "64", "--reps", "0"], {}, r"argument --reps: must be a whole number >= 1; got '0'"),
    ([], {}, r"cp_nccl.py: error: the following arguments are required: what"),
    (["check"], {"CUDA": ""}, r"^cp_nccl.py check: error: runs on CUDA GPUs over NCCL, and this machine has no CUDA "
                              r"device$"),
    (["speed", "64"], {"CUDA": ""}, r"cp_nccl.py speed: error: runs on CUDA GPUs over NCCL, and this machine has no "
                                    r"CUDA device \(speed --gloo runs on CPU processes\)"),
    (["speed", "64", "--gloo"], {}, r"cp_nccl.py speed: error: runs one process per GPU; start it with torchrun "
                                    r"--nproc-per-node N"),
    (["speed", "64", "--gloo"], {"OUT": "{tmp}/nope"}, r"cp_nccl.py speed: error: OUT = '{tmp}/nope' does not exist; "
                                                      r"speed appends its rows to OUT/cp_speed.jsonl: give an existing "
                                                      r"folder"),
    (["speed", "64", "--gloo"], {"OUT": "{tmp}/empty.jsonl"}, r"cp_nccl.py speed: error: OUT = '{tmp}/empty.jsonl' is "
                                                             r"a file"),
    (["speed", "64", "--gloo"], {"OUT": "{tmp}/cutout"}, r"cp_nccl.py speed: error: OUT = '{tmp}/cutout': output file "
                                                        r"'{tmp}/cutout/cp_speed.jsonl' ends in a cut-off line"),
    (["table", "{tmp}/nope.jsonl"], {}, r"cp_nccl.py table: error: {tmp}/nope.jsonl: No such file or directory"),
    (["table", "{tmp}"], {}, r"cp_nccl.py table: error: {tmp}: Is a directory"),
    (["table", "{tmp}/empty.jsonl"], {}, r"cp_nccl.py table: error: {tmp}/empty.jsonl: no rows \(an empty file\)"),
    (["table", "{tmp}/cut.jsonl"], {}, r"cp_nccl.py table: error: {tmp}/cut.jsonl:2: not JSON"),
    (["table", "{tmp}/other.jsonl"], {}, r"cp_nccl.py table: error: {tmp}/other.jsonl:1: not a row of `cp_nccl.py "
                                         r"speed` \(it lacks T, gpus"),
])
def test_bad_arguments_are_named(argv, env, message, monkeypatch, capsys, tmp_path):
    """One message naming the bad value: arguments, a machine without CUDA or a process outside torchrun (which had
    ended in tracebacks), and results files that are missing, a folder, empty, cut short or of something else."""
    import re
    import torch
    row = json.dumps({"model": "gdn", "T": 64, "gpus": 2, "ms_1gpu": 2.0, "ms_cp": 1.0, "speedup": 2.0,
                      "mem_1gpu_gib": 1.0, "mem_cp_gib": 0.5, "gpu": "cpu", "commit": "c"})
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "cut.jsonl").write_text(row + "\n" + row[:20])
    (tmp_path / "other.jsonl").write_text('{"model": "gdn"}\n')
    (tmp_path / "cutout").mkdir()
    (tmp_path / "cutout" / "cp_speed.jsonl").write_text(row[:20])
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("OUT", raising=False)
    if "CUDA" in env:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for k, v in env.items():
        monkeypatch.setenv(k, v.format(tmp=tmp_path))
    with pytest.raises(SystemExit) as e:
        cp_nccl.main([a.format(tmp=tmp_path) for a in argv])
    said = capsys.readouterr().err + str(e.value.code)
    assert re.search(message.format(tmp=re.escape(str(tmp_path))), said, re.M), said
    assert "Traceback" not in said


def test_a_step_out_of_memory_in_its_backward_leaves_no_gradients():
    """The backward fails half-way (the last block's gradients already accumulated): the error
    reaches the caller, and the next attempt starts from no gradients, on one rank as on every other."""
    import torch
    from kalmix.models import KalmixConfig, KalmixForCausalLM
    torch.manual_seed(0)
    model = KalmixForCausalLM(KalmixConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           mixer="gdn", mixer_kwargs={"gdn": {"num_heads": 2}}))

    def fail(grad):
        assert any(p.grad is not None for p in model.model.layers[1].parameters())     # half-way indeed
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    def hook(module, args, out):
        out[0].register_hook(fail)
    model.model.layers[0].register_forward_hook(hook)
    with pytest.raises(torch.OutOfMemoryError):
        cp_nccl.measured(model, torch.randint(0, 64, (1, 16)), 1, torch.device("cpu"))
    assert all(p.grad is None for p in model.parameters())
