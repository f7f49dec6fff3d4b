"""impl="triton" of Kaczmarz attention: fla's public ``chunk_gated_delta_rule`` on the exact reparameterisation

    k̂ = c k,   v̂ = c v,   β = η,   c = 1 / sqrt(‖k‖² + eps)        (k = 0 with eps = 0: c = 0, no write)

under which the Gated DeltaNet step β k̂ (v̂ − γ Sᵀk̂)ᵀ is the Kaczmarz step η/(‖k‖² + eps) · k (v − γ Sᵀk)ᵀ.
(Any c > 0 is exact; DESIGN §1.3's k/‖k‖ with β = η‖k‖²/(‖k‖² + eps) is c = 1/‖k‖. This c is smooth in k
where the step is, so a zero key keeps its gradient η/eps · …; ‖k̂‖ <= 1.) Gradients reach the raw k, v and
eta through the reparameterisation.

fla refuses the backward of its gated chunk kernels on Hopper with triton in [3.4.0, 3.7.1) (a miscompile, its
issue #640). There the forward still runs fla's kernels, and the backward differentiates the same function
recomputed by kalmix's chunked torch path (impl="torch"); a log line says so once per process.
"""
from __future__ import annotations

import logging
import re

import torch

from kalmix.ops.common.varlen import run_packed
from kalmix.ops.kaczmarz.chunk import kaczmarz_chunk

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


def reparameterise(k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, eps: float):
    """(k̂, v̂, β) of the module docstring; k̂, v̂ in k's and v's dtype, β in fp32. Shapes as k, v, eta."""
    d = (k.float() ** 2).sum(-1) + eps
    pos = d > 0
    c = torch.rsqrt(torch.where(pos, d, torch.ones_like(d))) * pos   # k = 0, eps = 0: no inf, no nan gradient
    return (k.float() * c[..., None]).to(k.dtype), (v.float() * c[..., None]).to(v.dtype), eta.float()


def _fla_gdn(q, k, v, g, beta, *, scale, state, cu_seqlens):
    """fla's chunk_gated_delta_rule: o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32."""
    if q.device.type != "cuda":
        raise ValueError(f"{_OP}: impl='triton' runs fla's chunk_gated_delta_rule, which needs CUDA tensors (it "
                         f"does not run under TRITON_INTERPRET); got tensors on {q.device}, use impl='torch'")
    from fla.ops import chunk_gated_delta_rule
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=True,
                                  cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())


def _forward(q, k, v, g, eta, state, eps, scale, cu_seqlens):
    k_hat, v_hat, beta = reparameterise(k, v, eta, eps)
    return _fla_gdn(q, k_hat, v_hat, g, beta, scale=scale, state=state, cu_seqlens=cu_seqlens)


class _FlaForwardTorchBackward(torch.autograd.Function):
    """fla's forward; the backward of the chunked torch path recomputed from the saved inputs."""

    @staticmethod
    def forward(ctx, q, k, v, g, eta, state, eps, scale, cu_seqlens):
        ctx.save_for_backward(q, k, v, g, eta, state, cu_seqlens)
        ctx.eps, ctx.scale = eps, scale
        ctx.set_materialize_grads(False)
        return _forward(q, k, v, g, eta, state, eps, scale, cu_seqlens)

    @staticmethod
    def backward(ctx, do, dS):
        *xs, cu_seqlens = ctx.saved_tensors
        leaves = [x.detach().requires_grad_() for x in xs]
        with torch.enable_grad():
            (o,), (S,) = run_packed(kaczmarz_chunk, cu_seqlens, [x.float() for x in leaves[:5]],
                                    (leaves[5].float(),), eps=ctx.eps, scale=ctx.scale)
            pairs = [(out, d.to(out.dtype)) for out, d in ((o, do), (S, dS)) if d is not None]
            grads = torch.autograd.grad([p[0] for p in pairs], leaves, [p[1] for p in pairs], allow_unused=True)
        return (*[None if d is None else d.to(x.dtype) for d, x in zip(grads, xs)], None, None, None)


def kaczmarz_fla(q, k, v, g, eta, *, state, eps, scale, cu_seqlens=None):
    """Kaczmarz attention through fla (module docstring). q, k [B, T, H, K], v [B, T, H, V] in bf16/fp16/fp32;
    g, eta [B, T, H]; ``state`` [N, H, K, V] fp32; packed sequences are handed to fla.
    Returns o [B, T, H, V] (q's dtype) and the final state [N, H, K, V] (fp32)."""
    if q.dtype == torch.float64:
        raise ValueError(f"{_OP}: impl='triton' (fla's kernels) takes bf16/fp16/fp32 inputs; use impl='torch' "
                         "or 'naive' for fp64")
    global _told
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, eta, state))
    if needs_grad and fla_gated_backward_refused(q.device):
        if not _told:
            import triton
            log.warning("%s(impl='triton'): fla refuses its gated backward on this GPU (Hopper, triton %s < "
                        "3.7.1); the forward runs fla's chunk_gated_delta_rule and the backward recomputes "
                        "through kalmix's chunked torch path", _OP, triton.__version__)
            _told = True
        return _FlaForwardTorchBackward.apply(q, k, v, g, eta, state, eps, scale, cu_seqlens)
    return _forward(q, k, v, g, eta, state, eps, scale, cu_seqlens)
