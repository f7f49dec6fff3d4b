"""A Triton kernel of fp32 FMAs only: `kalmix speed` measures the CUDA cores' fp32 rate with it."""
import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def fma_chains(x_ptr, a, b, n_iters, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Four independent chains x <- a·x + b per element, ``n_iters`` × UNROLL steps each: fp32 FMAs only."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x0 = tl.load(x_ptr + offs)
    x1, x2, x3 = x0 + 1.0, x0 + 2.0, x0 + 3.0
    for _ in range(n_iters):
        for _u in tl.static_range(UNROLL):
            x0, x1, x2, x3 = x0 * a + b, x1 * a + b, x2 * a + b, x3 * a + b
    tl.store(x_ptr + offs, x0 + x1 + x2 + x3)


def run_chains(x: torch.Tensor, n_iters: int, unroll: int, a: float = 0.999, b: float = 1e-3) -> None:
    """``fma_chains`` over x (fp32, in place, a multiple of BLOCK elements): 4 · n_iters · unroll FMAs per
    element."""
    fma_chains[(x.numel() // BLOCK,)](x, a, b, n_iters, BLOCK=BLOCK, UNROLL=unroll, num_warps=4)
