"""Triton kernels of ``linear_cross_entropy``'s chunks on CUDA (``kalmix/models/loss.py``), one program per row of
logits z [R, V] (in the logits' dtype, bf16 under autocast), arithmetic in fp32 (fp64 for fp64 logits):

- ``row_lse``: logsumexp(z) and z[target] per row, one pass over the row (a running maximum);
- ``softmax_grad_``: the cross-entropy's gradient (softmax(z) − onehot(target))·q per row, written over z.

They replace the torch chain (an fp32 copy of the chunk's logits, then logsumexp, subtraction, exp, scatter, scale
and a cast back: about eight passes over [R, V] in fp32) with three passes in the logits' dtype. The torch chain
stays the CPU path and the reference the tests compare with; under TRITON_INTERPRET the kernels run on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BV = 4096          # vocabulary entries per block
_WARPS = 8


def _acc(z: torch.Tensor):
    return tl.float64 if z.dtype == torch.float64 else tl.float32


def _meta(z: torch.Tensor) -> dict:
    return dict(BV=min(_BV, triton.next_power_of_2(z.shape[1])), ACC=_acc(z), num_warps=_WARPS)


@triton.jit
def _lse_kernel(z_ptr, idx_ptr, lse_ptr, zy_ptr, V, BV: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * V
    m = tl.full([], float("-inf"), ACC)
    s = tl.zeros([], ACC)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(ACC)
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    tl.store(lse_ptr + row, m + tl.log(s))
    tl.store(zy_ptr + row, tl.load(base + tl.load(idx_ptr + row)).to(ACC))


@triton.jit
def _grad_kernel(z_ptr, idx_ptr, lse_ptr, q_ptr, V, BV: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * V
    lse = tl.load(lse_ptr + row).to(ACC)
    q = tl.load(q_ptr + row).to(ACC)
    y = tl.load(idx_ptr + row)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        z = tl.load(base + cols, mask=cols < V, other=0.).to(ACC)
        g = (tl.exp(z - lse) - tl.where(cols == y, 1., 0.)) * q
        tl.store(base + cols, g.to(z_ptr.dtype.element_ty), mask=cols < V)


def _check(z: torch.Tensor, idx: torch.Tensor) -> None:
    if z.dim() != 2 or not z.is_contiguous() or idx.shape != z.shape[:1] or idx.dtype != torch.int64:
        raise ValueError(f"loss kernels: z must be a contiguous [R, V] tensor and idx int64 [R], got z "
                         f"{list(z.shape)} and idx {idx.dtype} {list(idx.shape)}")


def row_lse(z: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z [R, V] (contiguous), idx [R] int64 in [0, V) -> (logsumexp(z, -1), z[r, idx[r]]), each [R] in fp32
    (fp64 for fp64 z)."""
    _check(z, idx)
    acc = torch.promote_types(z.dtype, torch.float32)
    lse, zy = (torch.empty(z.shape[0], dtype=acc, device=z.device) for _ in range(2))
    if z.shape[0]:
        _lse_kernel[(z.shape[0],)](z, idx, lse, zy, z.shape[1], **_meta(z))
    return lse, zy


def softmax_grad_(z: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Overwrites z [R, V] with (exp(z − lse) − onehot(idx))·q row by row (lse, q [R] as ``row_lse`` gives them)
    and returns it."""
    _check(z, idx)
    if z.shape[0]:
        _grad_kernel[(z.shape[0],)](z, idx, lse.contiguous(), q.contiguous(), z.shape[1], **_meta(z))
    return z
