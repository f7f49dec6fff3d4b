import os

import pytest
import torch

# without a GPU the Triton kernels run in Triton's interpreter; it is chosen when kernels are defined, so before
# any kalmix import
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def nan_poisoned_empty(monkeypatch):
    """torch.empty hands out NaNs, so an output element a kernel forgets to write fails the comparison."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        x = real_empty(*args, **kwargs)
        if x.is_floating_point():
            x.fill_(float("nan"))
        return x

    monkeypatch.setattr(torch, "empty", empty)
    yield
