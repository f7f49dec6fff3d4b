"""The GPU suite: the Triton paths compiled for a real GPU, at realistic sizes, against the fp64 torch paths on
the same device. Run from the repository root on a CUDA machine, one group per command (times: the tests' own
durations in one run on an H200, compilation included):

- ``python -m pytest -q -m quick gpu_tests`` — every op's Triton path against fp64 (bf16, packed documents) and
  every layer's training step and decode, once each (17 tests, 120 s on a fresh H100 beside three busy GPUs);
- ``python -m pytest -q gpu_tests/test_ops_gpu.py`` — the ops at their limits and realistic regimes (276 s);
- ``python -m pytest -q gpu_tests/test_layers_gpu.py gpu_tests/test_models_gpu.py gpu_tests/test_train_gpu.py``
  — layers (49 s), models, decoding and the trainer (not yet timed).

(The CPU suite, ``tests/``, runs the same kernels under the Triton interpreter at small sizes; this one does not
skip on a machine without a GPU, it refuses to start.)"""
import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the quick group (every op and layer once; -m quick)")
    if not torch.cuda.is_available():
        raise pytest.UsageError("gpu_tests/ needs a CUDA device; the CPU suite is tests/")


@pytest.fixture(autouse=True)
def nan_poisoned_empty(monkeypatch):
    """torch.empty, empty_like and Tensor.new_empty hand out NaNs, so an output element a kernel forgets to write
    fails the comparison."""
    from kalmix.ops.common.testing import poison_empty
    poison_empty(monkeypatch)
    yield


@pytest.fixture
def dev():
    return torch.device("cuda")
