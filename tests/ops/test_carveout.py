"""The L1 / shared-memory carveout a kernel is given: the smallest split that keeps its occupancy."""
import pytest

from kalmix.ops.common.carveout import SIZES_KB, _RESERVED, carveout_percent, prefer_l1


def _blocks(n_regs, num_warps, shared, largest):
    regs = -(-n_regs * 32 // 256) * 256 * num_warps
    return min(65536 // regs, 64 // num_warps, largest // (shared + _RESERVED))


@pytest.mark.parametrize("cc", sorted(SIZES_KB))
def test_the_driver_rounds_the_percent_to_the_smallest_size_that_keeps_the_blocks(cc):
    """The driver rounds the preference up to a size it has: that size must hold the blocks registers and warps
    allow, and the size below it must not (else L1 could have had more)."""
    sizes = [kb * 1024 for kb in SIZES_KB[cc]]
    for n_regs in (32, 96, 128, 168, 232, 255):
        for num_warps in (1, 2, 4, 8):
            for shared in (0, 1000, 16384, 33792, 57344, 81920, 98304, 131072, 163840, sizes[-1] - _RESERVED):
                blocks = _blocks(n_regs, num_warps, shared, sizes[-1])
                if blocks == 0:
                    with pytest.raises(ValueError, match="does not fit"):
                        carveout_percent(n_regs, num_warps, shared, SIZES_KB[cc])
                    continue
                pct = carveout_percent(n_regs, num_warps, shared, SIZES_KB[cc])
                picked = next(s for s in sizes if s >= pct * sizes[-1] / 100)
                need = blocks * (shared + _RESERVED)
                assert picked >= need, (n_regs, num_warps, shared, pct)
                assert sizes.index(picked) == 0 or sizes[sizes.index(picked) - 1] < need, (n_regs, shared, pct)


def test_the_gka_forward_on_an_h100_gets_164_kb():
    """255 registers, 4 warps, 80 KB: two blocks, 164 KB of shared memory (71% of 228 KB), 92 KB of L1."""
    assert carveout_percent(255, 4, 81920, SIZES_KB[(9, 0)]) == 71


def test_interpreter_launches_never_reach_the_driver(monkeypatch):
    """Under TRITON_INTERPRET a launch returns no compiled kernel: nothing is set and no CUDA library is loaded."""
    from kalmix.ops.common import carveout

    def driver():
        raise AssertionError("the CUDA driver was called")
    monkeypatch.setattr(carveout, "_driver", driver)
    before = set(carveout._done)
    prefer_l1(None)
    assert carveout._done == before
