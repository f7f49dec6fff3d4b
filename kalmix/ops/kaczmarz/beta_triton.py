"""The Kaczmarz step β = η/(‖k‖² + eps) as one Triton pass over the keys, forward and backward: what fla's
``chunk_gated_delta_rule`` takes as its β (fused.py), and the op's value check of g and η on the way.

Backward: with c² = 1/(‖k‖² + eps), dη = c² dβ and dk = −2 η c⁴ dβ k. (kalmix's own chunked kernels compute the
step inside their first kernel instead: kalmix/ops/common/delta_triton.py, ``step_eps``.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kalmix.ops.common.checks import compute_dtype
from kalmix.ops.common.precision import no_autocast
from kalmix.ops.common.triton_utils import add_extrema, inv_sq_norm, no_extrema, store_extrema, to_acc


@triton.jit
def _step_kernel(k_ptr, eta_ptr, g_ptr, ext_ptr, dbeta_ptr, out_ptr, dk_ptr, n_rows, eps, K, R: tl.constexpr,
                 BK: tl.constexpr, BACKWARD: tl.constexpr, CHECK: tl.constexpr):
    """Blocks of R (token, head) rows, strided over the programs. Forward: β = η c², c² = 1/(‖k‖² + eps); CHECK
    also writes g's and η's min, max and NaN count over the program's rows to its [2, 3] row of ``ext``
    ([programs, 2, 3], folded by checks.defer_check: no atomics, nothing to initialise). BACKWARD: from dβ,
    dη = c² dβ and dk = −2 η c⁴ dβ k."""
    d = tl.arange(0, BK)[None, :]
    ext_g, ext_e = no_extrema(R), no_extrema(R)
    for r0 in range(tl.program_id(0) * R, n_rows, tl.num_programs(0) * R):
        r = r0 + tl.arange(0, R)
        m = r < n_rows
        off, mk = r[:, None].to(tl.int64) * K + d, m[:, None] & (d < K)
        k = to_acc(tl.load(k_ptr + off, mask=mk, other=0.))
        c2 = inv_sq_norm(k, eps)
        eta = to_acc(tl.load(eta_ptr + r, mask=m, other=0.))
        if BACKWARD:
            dbeta = to_acc(tl.load(dbeta_ptr + r, mask=m, other=0.))
            tl.store(out_ptr + r, (c2 * dbeta).to(out_ptr.dtype.element_ty), mask=m)
            dk = (-2. * eta * c2 * c2 * dbeta)[:, None] * k
            tl.store(dk_ptr + off, dk.to(dk_ptr.dtype.element_ty), mask=mk)
        else:
            tl.store(out_ptr + r, eta * c2, mask=m)
            if CHECK:
                ext_g = add_extrema(ext_g, tl.load(g_ptr + r, mask=m, other=0.), m)
                ext_e = add_extrema(ext_e, eta, m)
    if CHECK:
        row = ext_ptr + tl.program_id(0) * 6
        store_extrema(row, ext_g)
        store_extrema(row + 3, ext_e)


# the step pass's row block, most programs and warps: the fastest tried (16-64 rows, 1056-2112 programs, 4-8 warps)
# at 32K tokens × 8 heads × K = 128 on an H100, its value check written as per-program extrema rather than atomics
# into one buffer (`python benchmarks/kaczmarz_fused.py` times the op with fla's engine, which runs this pass)
STEP_ROWS, STEP_PROGRAMS, STEP_WARPS = 32, 1056, 8


def step_programs(n_rows: int) -> int:
    """Programs of the step pass over ``n_rows`` (token, head) rows."""
    return max(1, min(triton.cdiv(n_rows, STEP_ROWS), STEP_PROGRAMS))


def step_extrema(n_rows: int, device: torch.device) -> torch.Tensor:
    """The buffer the step pass over ``n_rows`` rows writes its check into: per program, g's then η's min, max and
    NaN count ([programs, 2, 3] fp32, every element written by the pass)."""
    return torch.empty(step_programs(n_rows), 2, 3, device=device)


def _step_launch(k, eta, dbeta, out, dk, eps, backward, g=None, ext=None):
    K = k.shape[-1]
    n = eta.numel()
    _step_kernel[(step_programs(n),)](k, eta, g, ext, dbeta, out, dk, n, eps, K, R=STEP_ROWS,
                                      BK=triton.next_power_of_2(K), BACKWARD=backward, CHECK=ext is not None,
                                      num_warps=STEP_WARPS)


def kaczmarz_step(k: torch.Tensor, eta: torch.Tensor, eps: float, g: torch.Tensor | None = None,
                  ext: torch.Tensor | None = None) -> torch.Tensor:
    """β = η/(‖k‖² + eps) (0 where ‖k‖² + eps = 0) for k [..., K] and eta [...], in fp32 (fp64 for fp64 k): the
    Kaczmarz step that turns the delta rule on raw keys into the projection. One pass over k; differentiable.
    With ``ext`` (``step_extrema(eta.numel())``) the same pass writes each program's min, max and NaN
    count of g (like eta) and eta into it, for the op's value check (``checks.defer_check``)."""
    if ext is not None:
        g = g.contiguous()
    if torch.is_grad_enabled() and (k.requires_grad or eta.requires_grad):
        return _KaczmarzStep.apply(k, eta, float(eps), g, ext)
    k, eta = k.contiguous(), eta.contiguous()
    beta = torch.empty(eta.shape, dtype=compute_dtype(k), device=k.device)
    _step_launch(k, eta, None, beta, None, float(eps), False, g, ext)
    return beta


class _KaczmarzStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, eta, eps, g, ext):
        k, eta = k.contiguous(), eta.contiguous()
        beta = torch.empty(eta.shape, dtype=compute_dtype(k), device=k.device)
        _step_launch(k, eta, None, beta, None, eps, False, g, ext)
        ctx.save_for_backward(k, eta)
        ctx.eps = eps
        return beta

    @staticmethod
    @no_autocast
    def backward(ctx, dbeta):
        k, eta = ctx.saved_tensors
        dk, deta = torch.empty_like(k), torch.empty_like(eta)
        _step_launch(k, eta, dbeta.contiguous(), deta, dk, ctx.eps, True)
        return dk, deta, None, None, None
