"""impl="triton" of Kaczmarz attention: Gated DeltaNet on the exact reparameterisation

    k̂ = c k,   v̂ = c v,   β = η,   c = 1 / sqrt(‖k‖² + eps)        (k = 0 with eps = 0: c = 0, no write)

under which the Gated DeltaNet step β k̂ (v̂ − γ Sᵀk̂)ᵀ is the Kaczmarz step η/(‖k‖² + eps) · k (v − γ Sᵀk)ᵀ.
(Any c > 0 is exact; DESIGN §1.3's k/‖k‖ with β = η‖k‖²/(‖k‖² + eps) is c = 1/‖k‖. This c is smooth in k
where the step is, so a zero key keeps its gradient η/eps · …; ‖k̂‖ <= 1.) Gradients reach the raw k, v and
eta through the reparameterisation.

Two engines run it:
- fla's public ``chunk_gated_delta_rule`` on CUDA, wherever fla runs it both ways, and for inference anywhere;
- kalmix's own chunked Triton kernels (kalmix/ops/common/delta_triton.py) where fla refuses the backward of
  its gated chunk kernels (Hopper with triton in [3.4.0, 3.7.1): a miscompile, its issue #640) and gradients
  are needed, for fp64 inputs (fla takes none), and on CPU under TRITON_INTERPRET (how CI runs them).
A log line on the ``kalmix`` logger names the engine the first time kalmix's kernels stand in for fla on a GPU.
"""
from __future__ import annotations

import logging
import re

import torch
import triton
import triton.language as tl

from kalmix.ops.common.checks import compute_dtype
from kalmix.ops.common.delta_triton import chunk_delta_rule_triton

_OP = "kaczmarz_attention"
log = logging.getLogger("kalmix")
_told = False


def fla_gated_backward_refused(device: torch.device) -> bool:
    """Whether fla refuses its gated chunk backward here: a Hopper GPU with 3.4.0 <= triton < 3.7.1."""
    if device.type != "cuda":
        return False
    version = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)\.(\d+)", triton.__version__).groups())
    return torch.cuda.get_device_capability(device)[0] == 9 and (3, 4, 0) <= version < (3, 7, 1)


def engine(device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str:
    """"fla" or "kalmix": which kernels run the op for inputs on ``device`` of ``dtype``."""
    if device.type != "cuda" or dtype == torch.float64 or (needs_grad and fla_gated_backward_refused(device)):
        return "kalmix"
    return "fla"


@triton.jit
def _rows(ptr, r, n_rows, D, BD: tl.constexpr):
    d = tl.arange(0, BD)[None, :]
    return ptr + r.to(tl.int64) * D + d, (r < n_rows) & (d < D)


@triton.jit
def _load(ptr, r, n_rows, D, BD: tl.constexpr, ACC: tl.constexpr):
    p, m = _rows(ptr, r, n_rows, D, BD)
    return tl.load(p, mask=m, other=0.).to(ACC)


@triton.jit
def _store(ptr, x, r, n_rows, D, BD: tl.constexpr):
    p, m = _rows(ptr, r, n_rows, D, BD)
    tl.store(p, x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _reparam_fwd_kernel(k_ptr, v_ptr, kh_ptr, vh_ptr, c_ptr, n_rows, eps, K, V, R: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, ACC: tl.constexpr):
    """Rows of R (token, head) pairs: c = 1/sqrt(‖k‖² + eps) (0 where that is 0), k̂ = c k, v̂ = c v."""
    r = tl.program_id(0) * R + tl.arange(0, R)[:, None]
    k = _load(k_ptr, r, n_rows, K, BK, ACC)
    d = tl.sum(k * k, axis=1, keep_dims=True) + eps
    c = tl.where(d > 0, 1. / tl.sqrt(tl.where(d > 0, d, 1.)), 0.)
    _store(kh_ptr, k * c, r, n_rows, K, BK)
    _store(vh_ptr, _load(v_ptr, r, n_rows, V, BV, ACC) * c, r, n_rows, V, BV)
    tl.store(c_ptr + r, c, mask=r < n_rows)


@triton.jit
def _reparam_bwd_kernel(k_ptr, v_ptr, c_ptr, dkh_ptr, dvh_ptr, dk_ptr, dv_ptr, n_rows, K, V, R: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr):
    """dk = c dk̂ − c³ (k·dk̂ + v·dv̂) k,  dv = c dv̂  (dc/dk = −c³ k)."""
    r = tl.program_id(0) * R + tl.arange(0, R)[:, None]
    k, dkh = _load(k_ptr, r, n_rows, K, BK, ACC), _load(dkh_ptr, r, n_rows, K, BK, ACC)
    v, dvh = _load(v_ptr, r, n_rows, V, BV, ACC), _load(dvh_ptr, r, n_rows, V, BV, ACC)
    c = tl.load(c_ptr + r, mask=r < n_rows, other=0.)
    s = tl.sum(k * dkh, axis=1, keep_dims=True) + tl.sum(v * dvh, axis=1, keep_dims=True)
    _store(dk_ptr, c * dkh - c * c * c * s * k, r, n_rows, K, BK)
    _store(dv_ptr, c * dvh, r, n_rows, V, BV)


_ROWS = 16


class _Reparameterise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, eps):
        K, V = k.shape[-1], v.shape[-1]
        k, v = k.contiguous(), v.contiguous()
        n = k.numel() // K
        acc = compute_dtype(k)
        kh, vh, c = torch.empty_like(k), torch.empty_like(v), torch.empty(n, dtype=acc, device=k.device)
        meta = dict(R=_ROWS, BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V),
                    ACC=tl.float64 if acc == torch.float64 else tl.float32)
        _reparam_fwd_kernel[(triton.cdiv(n, _ROWS),)](k, v, kh, vh, c, n, eps, K, V, **meta)
        ctx.save_for_backward(k, v, c)
        ctx.meta = meta
        return kh, vh

    @staticmethod
    def backward(ctx, dkh, dvh):
        k, v, c = ctx.saved_tensors
        K, V, n = k.shape[-1], v.shape[-1], c.numel()
        dkh = torch.zeros_like(k) if dkh is None else dkh.contiguous()
        dvh = torch.zeros_like(v) if dvh is None else dvh.contiguous()
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        _reparam_bwd_kernel[(triton.cdiv(n, _ROWS),)](k, v, c, dkh, dvh, dk, dv, n, K, V, **ctx.meta)
        return dk, dv, None


def reparameterise(k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, eps: float):
    """(k̂, v̂, β) of the module docstring in one fused pass over k and v (a Triton kernel each way): k̂, v̂ in k's
    and v's dtype (the arithmetic in fp32, fp64 for fp64), β = η in fp32 (fp64 for fp64 k)."""
    k_hat, v_hat = _Reparameterise.apply(k, v, float(eps))
    return k_hat, v_hat, eta.to(compute_dtype(k))


def _fla_gdn(q, k, v, g, beta, *, scale, state, cu_seqlens):
    """fla's chunk_gated_delta_rule: o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32."""
    from fla.ops import chunk_gated_delta_rule
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=True,
                                  cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())


def announce(dtype: torch.dtype) -> None:
    """Say once per process that kalmix's kernels stand in for fla's on this GPU, and why."""
    global _told
    if not _told:
        why = ("fp64 inputs" if dtype == torch.float64 else
               f"fla refuses its gated backward on this GPU (Hopper, triton {triton.__version__} < 3.7.1)")
        log.warning("%s(impl='triton'): %s; kalmix's own chunked Triton kernels run the op forward and backward",
                    _OP, why)
        _told = True


def kaczmarz_fused(q, k, v, g, eta, *, state, eps, scale, cu_seqlens=None):
    """Kaczmarz attention on fla's or kalmix's chunk kernels (module docstring). q, k [B, T, H, K],
    v [B, T, H, V] of one dtype; g, eta [B, T, H]; ``state`` [N, H, K, V] fp32 (fp64 for fp64 inputs); packed
    sequences are handed to the kernels. Returns o [B, T, H, V] (q's dtype) and the final state [N, H, K, V]."""
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, eta, state))
    k_hat, v_hat, beta = reparameterise(k, v, eta, eps)
    if engine(q.device, q.dtype, needs_grad) == "fla":
        return _fla_gdn(q, k_hat, v_hat, g, beta, scale=scale, state=state, cu_seqlens=cu_seqlens)
    if q.device.type == "cuda":
        announce(q.dtype)
    return chunk_delta_rule_triton(q, k_hat, k_hat, v_hat, g, beta, scale=scale, state=state, cu_seqlens=cu_seqlens)
