"""Every Triton kernel kalmix launches compiles for an H100 (sm_90), checked on the CPU (tests/kernel_compile.py):
the interpreter that runs the kernels here does not check them as the compiler does."""
import json
import os
import pickle
import subprocess
import sys

from tests.kernel_compile import ROOT, record


def test_every_launched_kernel_compiles_for_sm90(monkeypatch, tmp_path):
    launches = record(monkeypatch)
    (tmp_path / "launches.pkl").write_bytes(pickle.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.kernel_compile", str(tmp_path / "launches.pkl"),
                          str(tmp_path / "result.json")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["kernels"], "no @triton.jit kernel found under kalmix/"
    assert not result["unreached"], (f"kernels that no launch of tests/kernel_compile.py reaches (give them one "
                                     f"there): {result['unreached']}")
    assert not result["failures"], "\n\n".join(
        f"{f['kernel']} {f['constexprs']}:\n{f['error']}" for f in result["failures"])
