"""Every Triton kernel kalmix launches compiles for an H100 (sm_90), checked on the CPU (tests/kernel_compile.py):
the interpreter that runs the kernels here does not check them as the compiler does."""
import json
import os
import subprocess
import sys

from tests.kernel_compile import ROOT


def _run(*args: str, interpret: bool) -> None:
    """``python -m tests.kernel_compile *args`` from the repository root, under TRITON_INTERPRET=1 or without it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, "-m", "tests.kernel_compile", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, f"python -m tests.kernel_compile {' '.join(args)}:\n{run.stderr[-6000:]}"


def test_every_launched_kernel_compiles_for_sm90(tmp_path):
    launches, result = str(tmp_path / "launches.pkl"), tmp_path / "result.json"
    _run("record", launches, interpret=True)
    _run("compile", launches, str(result), interpret=False)
    result = json.loads(result.read_text())
    assert result["kernels"], "no @triton.jit kernel found under kalmix/"
    assert not result["unreached"], (f"kernels that no launch of tests/kernel_compile.py reaches (give them one "
                                     f"there): {result['unreached']}")
    assert not result["failures"], "\n\n".join(
        f"{f['kernel']} fails to compile for sm_90 at {len(f['launches'])} launch(es):\n"
        + "".join(f"  {launch}\n" for launch in f["launches"]) + f["error"] for f in result["failures"])
