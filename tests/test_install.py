"""The package as installed: its version, and kalmix without triton."""
import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch

import kalmix
from kalmix.layers.common import fused_kernels
from kalmix.ops.common import checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NO_TRITON = """
import sys
sys.modules["triton"] = None                          # `import triton` raises ImportError, as where it is absent
import torch, kalmix
from kalmix import ops
from kalmix.models import KalmixConfig, KalmixForCausalLM

assert ops.SPECS["kaczmarz"].runnable_impls(torch.device("cpu")) == ("naive", "torch")
q, g, eta = torch.randn(1, 5, 2, 4), -torch.rand(1, 5, 2), 0.5 + 0.5 * torch.rand(1, 5, 2)
o, _ = ops.kaczmarz_attention(q, q, q, g, eta)
o_torch, _ = ops.kaczmarz_attention(q, q, q, g, eta, impl="torch")
assert torch.equal(o, o_torch)
mixers = ["attention", "gdn", "kaczmarz", "gka", "vla", "kalman"]
cfg = KalmixConfig(vocab_size=16, hidden_size=16, num_hidden_layers=len(mixers), mixers=mixers,
                   mixer_kwargs={m: {"num_heads": 2} for m in mixers if m != "kalman"})
ids = torch.randint(0, 16, (2, 6))
loss = KalmixForCausalLM(cfg)(ids, labels=ids).loss
loss.backward()
assert torch.isfinite(loss)
try:
    ops.kaczmarz_attention(q, q, q, g, eta, impl="triton")
except ValueError as e:
    print(e)
import kalmix.cli
assert sys.modules["triton"] is None
"""


def test_version_is_the_package_metadata():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        pyproject = f.read()
    assert 'dynamic = ["version"]' in pyproject and 'version = {attr = "kalmix.__version__"}' in pyproject
    assert importlib.metadata.version("kalmix") == kalmix.__version__


def test_kalmix_runs_its_torch_paths_without_triton():
    env = {**os.environ, "TRITON_INTERPRET": "1"}          # the interpreter is asked for, the package is absent
    r = subprocess.run([sys.executable, "-c", NO_TRITON], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "impl='triton'" in r.stdout and "`triton` package, which is not installed" in r.stdout
    assert "impl='torch' and impl='naive' run without it" in r.stdout


def test_an_interpreter_too_old_for_the_kernels_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(checks, "_triton_version", lambda: (3, 6))
    assert "triton" not in kalmix.ops.SPECS["kalman"].runnable_impls(torch.device("cpu"))
    q = torch.randn(1, 3, 1, 4)
    with pytest.raises(ValueError, match=r"interpreter of triton 3\.6 cannot run kalmix's kernels \(triton >= 3\.9"):
        kalmix.ops.kaczmarz_attention(q, q, q, -torch.rand(1, 3, 1), torch.ones(1, 3, 1), impl="triton")
    with pytest.raises(ImportError, match="TRITON_INTERPRET=1: the interpreter of triton 3.6"):
        fused_kernels()
