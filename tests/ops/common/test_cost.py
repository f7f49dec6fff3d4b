"""The cost models (kalmix/ops/common/cost.py and each op spec's) on shapes counted by hand."""
import pytest

from kalmix.ops import SPECS
from kalmix.ops.common.cost import DELTA, SDPA, SIMPLE_GLA, Shape, io_bytes


def test_io_bytes_counts_each_tensor_once_per_pass():
    assert io_bytes(100, 10, "fwd") == 110
    # forward (100 + 10), backward: inputs again (100), output grad (10), one grad per input (100)
    assert io_bytes(100, 10, "fwdbwd") == 320
    with pytest.raises(ValueError, match=r"unknown mode 'decode'; expected one of \('fwd', 'fwdbwd'\)"):
        io_bytes(1, 1, "decode")


def test_op_bytes_by_hand():
    s = Shape(B=2, T=3, H=1, K=4, V=5)
    # delta rule in bf16: q, k [2,3,1,4], v [2,3,1,5], beta [2,3,1] read; o [2,3,1,5] written
    assert DELTA.bytes(s, 2, "fwd") == 2 * (24 + 24 + 30 + 6) + 2 * 30
    # Kalman in fp32: q, k, v, precision, plus fp32 decay and noise [1,4,5]; o written
    assert SPECS["kalman"].cost.bytes(s, 4, "fwd") == 4 * (24 + 24 + 30 + 30) + 4 * 2 * 20 + 4 * 30
    # GKA reads three gates (g, beta, alpha) per token and head
    assert SPECS["gka"].cost.bytes(s, 2, "fwd") - SPECS["kaczmarz"].cost.bytes(s, 2, "fwd") == 2 * 6


def test_op_flops_by_hand():
    s = Shape(B=1, T=2, H=1, K=2, V=3)
    kalman, gka, kaczmarz = (SPECS[n].cost for n in ("kalman", "gka", "kaczmarz"))
    # Kalman: 9 (forward) and 39 (forward+backward) fp32 slots per lane-token, as 2 FLOPs each
    assert kalman.flops(s, "fwd") == 2 * 9 * 2 * 2 * 3
    assert kalman.flops(s, "fwdbwd") == 2 * 39 * 2 * 2 * 3
    assert SDPA.flops(s, "fwd") == 2 * 1 * 1 * 2 * 2 * 2
    assert SDPA.flops(s, "fwdbwd") == 3.5 * SDPA.flops(s, "fwd")
    # gated linear attention: 2·BHT·(2KV + C(K + V)), C = 64
    assert SIMPLE_GLA.flops(s, "fwd") == 2 * 2 * (2 * 6 + 64 * 5)
    assert gka.flops(s, "fwd", num_iters=0) == SIMPLE_GLA.flops(s, "fwd") + 2 * 2 * 64 * 2
    assert kaczmarz.flops(s, "fwdbwd") == 3 * kaczmarz.flops(s, "fwd")


def test_value_delta_cost_by_hand():
    """The value-gated delta rule: 2·BHT·(3KV + C(2K + V + KV/2)) at its own chunk C = min(32, T); it reads q, k
    [K] and v, g [V] per token and head."""
    cost = SPECS["value_delta"].cost
    # T = 2: one chunk of C = 2
    assert cost.flops(Shape(B=1, T=2, H=1, K=2, V=3), "fwd") == 2 * 2 * (3 * 6 + 2 * (4 + 3 + 3))
    # T = 64: chunks of C = 32
    assert cost.flops(Shape(B=1, T=64, H=1, K=2, V=3), "fwd") == 2 * 64 * (3 * 6 + 32 * (4 + 3 + 3))
    assert cost.flops(Shape(B=1, T=64, H=1, K=2, V=3), "fwdbwd") == 3 * 2 * 64 * (3 * 6 + 32 * 10)
    s = Shape(B=2, T=3, H=1, K=4, V=5)
    assert cost.bytes(s, 2, "fwd") == 2 * (24 + 24 + 30 + 30) + 2 * 30
