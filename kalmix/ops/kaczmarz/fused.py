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

from kalmix.ops.common.delta_triton import chunk_delta_rule_triton

_OP = "kaczmarz_attention"
log = logging.getLogger("kalmix")
_told = False


def fla_gated_backward_refused(device: torch.device) -> bool:
    """Whether fla refuses its gated chunk backward here: a Hopper GPU with 3.4.0 <= triton < 3.7.1."""
    if device.type != "cuda":
        return False
    import triton
    version = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)\.(\d+)", triton.__version__).groups())
    return torch.cuda.get_device_capability(device)[0] == 9 and (3, 4, 0) <= version < (3, 7, 1)


def engine(device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str:
    """"fla" or "kalmix": which kernels run the op for inputs on ``device`` of ``dtype``."""
    if device.type != "cuda" or dtype == torch.float64 or (needs_grad and fla_gated_backward_refused(device)):
        return "kalmix"
    return "fla"


def reparameterise(k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, eps: float):
    """(k̂, v̂, β) of the module docstring; k̂, v̂ in k's and v's dtype, β in fp32 (fp64 for fp64 k)."""
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    d = (k.to(acc) ** 2).sum(-1) + eps
    pos = d > 0
    c = torch.rsqrt(torch.where(pos, d, torch.ones_like(d))) * pos   # k = 0, eps = 0: no inf, no nan gradient
    return (k.to(acc) * c[..., None]).to(k.dtype), (v.to(acc) * c[..., None]).to(v.dtype), eta.to(acc)


def _fla_gdn(q, k, v, g, beta, *, scale, state, cu_seqlens):
    """fla's chunk_gated_delta_rule: o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32."""
    from fla.ops import chunk_gated_delta_rule
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=True,
                                  cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())


def announce(dtype: torch.dtype) -> None:
    """Say once per process that kalmix's kernels stand in for fla's on this GPU, and why."""
    global _told
    if not _told:
        import triton
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
