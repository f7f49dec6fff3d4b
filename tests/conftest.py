import os

import pytest
import torch

# without a GPU the Triton kernels run in Triton's interpreter; it is chosen when kernels are defined, so before
# any kalmix import
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def nan_poisoned_empty(monkeypatch):
    """torch.empty, empty_like and Tensor.new_empty hand out NaNs, so an output element a kernel forgets to write
    fails the comparison."""
    from kalmix.ops.common.testing import poison_empty
    poison_empty(monkeypatch)
    yield
