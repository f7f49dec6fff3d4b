"""The GPU suite: the Triton paths compiled for a real GPU, at realistic sizes, against the fp64 torch paths on
the same device. Run from the repository root on a CUDA machine: ``python -m pytest -q gpu_tests``. (The CPU suite,
``tests/``, runs the same kernels under the Triton interpreter at small sizes; this one does not skip on a machine
without a GPU, it refuses to start.)"""
import pytest
import torch


def pytest_configure(config):
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
