"""benchmarks/op_profile.py without a GPU: it imports, names a bad argument or target, and says in one line that it
needs CUDA."""
import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("op_profile", ROOT / "benchmarks" / "op_profile.py")
op_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(op_profile)


def _error(argv, capsys) -> tuple[int | str, str]:
    with pytest.raises(SystemExit) as e:
        op_profile.main(argv)
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
