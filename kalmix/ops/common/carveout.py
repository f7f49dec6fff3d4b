"""The L1 / shared-memory split of a multiprocessor, chosen per compiled Triton kernel.

The driver runs a kernel that asks for much shared memory with the largest shared carveout (228 KB on an H100),
which leaves ~23–28 KB of L1: the register spills of kernels at 255 registers then miss L1 (ncu: 2–5% hits) and
wait on L2. Giving shared memory only what the kernel's occupancy needs leaves the rest to L1 for them (H100, Gated
KalmaNet at B = 16, T = 2048: forward+backward GPU time 6.15 -> 5.95 ms; README of kalmix/ops/gka).
"""
from __future__ import annotations

import ctypes
import functools

import torch

_CARVEOUT = 9           # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (percent of the largest carveout)
_RESERVED = 1024        # shared memory the system reserves per block (sm_80 and later)
# the shared-memory sizes (KB) a multiprocessor can be split at, per compute capability (CUDA C++ Programming
# Guide, "Shared Memory" of each architecture); the driver rounds a preference up to one of them
SIZES_KB = {(8, 0): (0, 8, 16, 32, 64, 100, 132, 164), (9, 0): (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)}
_done: set[int] = set()


def blocks_per_sm(n_regs: int, num_warps: int, shared: int, max_shared: int, regs_per_sm: int = 65536,
                  max_warps: int = 64) -> int:
    """How many blocks of a kernel one multiprocessor holds at once, given ``max_shared`` bytes of shared memory:
    the least of what its registers (allocated per warp in units of 256), warps and shared memory allow."""
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    return min(regs_per_sm // (regs_per_warp * num_warps), max_warps // num_warps, max_shared // (shared + _RESERVED))


def carveout_percent(n_regs: int, num_warps: int, shared: int, sizes_kb: tuple[int, ...]) -> int:
    """The carveout preference (percent of the largest size in ``sizes_kb``) that the driver rounds up to the
    smallest size holding ``blocks_per_sm`` blocks at the largest size."""
    per_block = shared + _RESERVED
    largest = sizes_kb[-1] * 1024
    blocks = blocks_per_sm(n_regs, num_warps, shared, largest)
    if blocks < 1:
        raise ValueError(f"a block of {num_warps} warps at {n_regs} registers and {shared} B of shared memory "
                         "does not fit a multiprocessor")
    i = next(i for i, kb in enumerate(sizes_kb) if kb * 1024 >= blocks * per_block)
    pct = 100 * sizes_kb[i] * 1024 // largest                  # rounded down: not past that size ...
    assert i == 0 or pct * largest > 100 * sizes_kb[i - 1] * 1024, (sizes_kb, i)   # ... nor below the one before
    return pct


@functools.cache
def _driver():
    return ctypes.CDLL("libcuda.so.1")


def prefer_l1(kernel) -> None:
    """Set the carveout of ``kernel`` (what a Triton launch returns; ``None`` under the interpreter) to
    ``carveout_percent``, once per compiled kernel, from its next launch on. Devices whose sizes ``SIZES_KB``
    does not list keep the driver's choice."""
    function = getattr(kernel, "function", None)
    if function is None or function in _done:
        return
    _done.add(function)
    sizes = SIZES_KB.get(torch.cuda.get_device_capability())
    if sizes is None:
        return
    pct = carveout_percent(kernel.n_regs, kernel.metadata.num_warps, kernel.metadata.shared, sizes)
    err = _driver().cuFuncSetAttribute(ctypes.c_void_p(function), _CARVEOUT, ctypes.c_int(pct))
    if err != 0:
        raise RuntimeError(f"cuFuncSetAttribute(preferred shared memory carveout = {pct}%) failed with CUresult "
                           f"{err} for {kernel.name}")
