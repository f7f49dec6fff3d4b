"""Fixtures shared by the op tests. tests/ops mirrors kalmix/ops: the files at this level test what every op
honours (kalmix/ops/__init__.py's contract, its errors and edge inputs), each folder one op's or common/'s own
modules."""
import pytest
import torch

from kalmix.ops import SPECS


@pytest.fixture
def draw():
    """``draw(name, B, T, H, K, V, n_state=None, seed=0, dtype=torch.float64) -> (args, state)``: random positional
    inputs of the op ``SPECS[name]`` (K, V are N, D for Kalman) and an initial state for ``n_state`` sequences
    (default B), from one generator seeded with ``seed``."""
    def draw(name, B, T, H, K, V, n_state=None, seed=0, dtype=torch.float64):
        case = SPECS[name]
        gen = torch.Generator().manual_seed(seed)
        args = case.inputs(B, T, H, K, V, dtype, gen)
        return args, case.random_state(B if n_state is None else n_state, H, K, V, dtype, gen)
    return draw
