"""The L1 / shared-memory carveout a kernel is given: the smallest split that keeps its occupancy."""
import pytest

from kalmix.ops.common.carveout import SIZES_KB, _RESERVED, blocks_per_sm, carveout_percent, prefer_l1


@pytest.mark.parametrize("n_regs,num_warps,shared,blocks", [
    (255, 4, 81920, 2),         # the GKA solves: registers allow 2 (255 -> 256 per thread, 32K per block)
    (255, 8, 131072, 1),        # GKA's U-path gradients
    (128, 1, 0, 16),            # Kalman's forward: registers allow 16 one-warp blocks
    (32, 1, 0, 64),             # warps: 64 per multiprocessor
    (32, 4, 98304, 2),          # shared memory: 2 × (96 + 1) KB within 228 KB (registers allow 16)
    (168, 4, 0, 3),             # 168 -> 5376 registers per warp, 21.5K per block: 3 in 64K
])
def test_blocks_per_multiprocessor(n_regs, num_warps, shared, blocks):
    assert blocks_per_sm(n_regs, num_warps, shared, 228 * 1024) == blocks


@pytest.mark.parametrize("cc", sorted(SIZES_KB))
def test_the_driver_rounds_the_percent_to_the_smallest_size_that_keeps_the_blocks(cc):
    """The driver rounds the preference up to a size it has: that size must hold the blocks registers and warps
    allow, and the size below it must not (else L1 could have had more)."""
    sizes = [kb * 1024 for kb in SIZES_KB[cc]]
    for n_regs in (32, 96, 128, 168, 232, 255):
        for num_warps in (1, 2, 4, 8):
            for shared in (0, 1000, 16384, 33792, 57344, 81920, 98304, 131072, 163840, sizes[-1] - _RESERVED):
                blocks = blocks_per_sm(n_regs, num_warps, shared, sizes[-1])
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
