"""benchmarks/op_profile.py, check_impls.py and the GPU check scripts (_gpu_script.py's and kalman_fused.py's
--configs) without a GPU: they import, name a bad argument, device, impl or target, and say in one line that they
need CUDA."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


op_profile, check_impls = _load("op_profile"), _load("check_impls")


def _error(argv, capsys, script=op_profile) -> tuple[int | str, str]:
    with pytest.raises(SystemExit) as e:
        script.main(argv)
    return e.value.code, capsys.readouterr().err


def test_without_cuda_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = _error(["kaczmarz_attention/triton"], capsys)
    assert code == "op_profile.py: error: profiles CUDA kernels, and this machine has no CUDA device" and err == ""


def test_bad_arguments_are_named(monkeypatch, capsys):
    code, err = _error(["kaczmarz_attention/triton", "--seq-len", "0"], capsys)
    assert code == 2 and "op_profile.py: error: argument --seq-len: must be a whole number >= 1; got '0'" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    code, err = _error(["kaczmarz_attention/triton", "nope/triton"], capsys)
    assert code == 2 and "op_profile.py: error: unknown target(s) ['nope/triton']; the targets: " in err
    assert "kaczmarz_attention/triton" in err.split("the targets: ")[1]


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda"], "check_impls.py: error: device 'cuda': "),
    (["--device", "tpu"], "check_impls.py: error: device 'tpu' is not one of cpu, cuda or cuda:N"),
    (["--device", "cpu", "--impl", "fast"], "check_impls.py: error: argument --impl: invalid choice: 'fast' (choose "
                                            "from 'naive', 'torch', 'triton')"),
    (["--device", "cpu", "--impl", "triton"], "check_impls.py: error: impl='triton' needs CUDA tensors (or "
                                              "TRITON_INTERPRET=1)"),
])
def test_check_impls_names_a_device_or_impl_it_cannot_test(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code, err = _error(argv, capsys, check_impls)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_gpu_scripts_name_a_bad_configs_entry_and_the_missing_gpu(monkeypatch, capsys):
    """benchmarks/_gpu_script.py (delta_triton, gka_triton, vla_triton, short_conv) and kalman_fused /
    kaczmarz_fused, which share its CUDA check: one line each, never a traceback."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    gpu_script = _load("_gpu_script")
    called = []

    def go(argv):
        with pytest.raises(SystemExit) as e:
            gpu_script.run(None, lambda dev, configs: called.append(configs), "help", argv)
        return e.value.code, capsys.readouterr().err

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for bad, item in (("fwd=x", "'fwd=x'"), ("fwd=8,bwd", "'bwd'"), ("=8", "'=8'")):
        code, err = go(["--configs", "", bad])
        assert code == 2 and f"argument --configs: {item} of '{bad}' is not KEY=VALUE with a whole number VALUE" \
            in err and "Traceback" not in err
    assert gpu_script._config("fwd=16,bwd=8") == {"fwd": 16, "bwd": 8} and gpu_script._config("") == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = go(["--configs", "fwd=16"])
    assert code.endswith("error: times CUDA kernels, and this machine has no CUDA device") and err == ""
    assert called == []
    with pytest.raises(SystemExit) as e:
        _load("kalman_fused").main(["--no-checks"])
    assert e.value.code == "kalman_fused.py: error: times CUDA kernels, and this machine has no CUDA device"
    with pytest.raises(SystemExit) as e:
        _load("kalman_fused").main(["--configs", "4,16"])
    assert e.value.code == 2 and "argument --configs: '4,16' is not 6 whole numbers" in capsys.readouterr().err
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "benchmarks/kaczmarz_fused.py"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == ("kaczmarz_fused.py: error: times CUDA kernels, and this "
                                                               "machine has no CUDA device"), r.stderr
    assert "Traceback" not in r.stderr
