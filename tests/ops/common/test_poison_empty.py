"""The suites' NaN-poisoned ``torch.empty`` (``kalmix.ops.common.testing.poison_empty``) leaves ``with
torch.device(...)`` placing what it builds, also when the first such block of the process runs under the poison."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_a_model_built_on_the_meta_device_under_the_poison_stays_there():
    code = textwrap.dedent("""
        import pytest, torch
        from kalmix.ops.common.testing import poison_empty
        with pytest.MonkeyPatch.context() as mp:
            poison_empty(mp)
            assert torch.empty(3).isnan().all()
            with torch.device("meta"):
                layer = torch.nn.Linear(4096, 4096)
            print(layer.weight.device, torch.empty(2).device)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))        # a fresh process: no device block ran before
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["meta", "cpu"]


def test_a_leaf_that_requires_grad_is_poisoned_too():
    """torch.utils.checkpoint (torch 2.11) makes a leaf with ``torch.empty(..., requires_grad=True)``: poisoning
    it must not be an in-place operation autograd refuses (the suites' autouse fixture is on here)."""
    import torch
    x = torch.empty(3, requires_grad=True)
    assert x.is_leaf and x.requires_grad and x.isnan().all()
