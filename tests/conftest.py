import os

import pytest
import torch

# without a GPU the Triton kernels run in Triton's interpreter; it is chosen when kernels are defined, so before
# any kalmix import
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# under pytest-xdist the workers share the cores: torch's default (every core per process) oversubscribes them,
# and its small ops then spend their time waiting for each other's threads
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(autouse=True)
def nan_poisoned_empty(monkeypatch):
    """torch.empty, empty_like and Tensor.new_empty hand out NaNs, so an output element a kernel forgets to write
    fails the comparison."""
    from kalmix.ops.common.testing import poison_empty
    poison_empty(monkeypatch)
    yield
