"""The LM head's cross-entropy without its logits: ``linear_cross_entropy``.

A causal LM's loss is ``cross_entropy(h Wᵀ, targets)``; computed as written, it holds the logits [N, V] (in bf16
under autocast), their fp32 copy, the log-softmax saved for the backward and the logits' gradient: at N = 65,536
tokens and V = 32,000, about 20 GiB. ``linear_cross_entropy`` runs the tokens in chunks and, per chunk, computes the
logits, the loss and the gradients with respect to h and W at once, keeping only those gradients ([N, d] and
[V, d]); the backward scales them by the loss's gradient. The result is the same loss and gradients (the
summation order of W's gradient over chunks aside), at the memory of one chunk's logits.
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from kalmix.layers.common import describe, require, runs_fused
from kalmix.ops.common.checks import triton_module

# the logits one chunk holds (S samples × rows × V), about 256 MiB in fp32
CHUNK_ELEMENTS = 2 ** 26


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, samples: int = 1,
                         reduction: str = "mean", ignore_index: int = -100,
                         chunk_size: int | None = None) -> torch.Tensor:
    """The cross-entropy of the logits ``h @ weight.T`` against ``targets``, without materialising the logits.

    Args:
        h: [S·B, ..., d] hidden states, sample-major when ``samples`` = S > 1 (rows s·B … (s + 1)·B − 1 are
            sample s), e.g. [N, d] or [B, T, d].
        weight: [V, d] the LM head's weight (the embedding, when tied).
        targets: [B, ...] (h's leading dims, the first over S) int64 token ids in [0, V), or ``ignore_index`` (not
            scored).
        samples: S >= 1. With S > 1 each token's loss is that of the Monte-Carlo marginal of its S samples,
            −log (1/S) Σ_s softmax(h_s Wᵀ)[target] (KLA+'s Eq. 25; ``kalmix.models.modeling.mc_marginal``).
        reduction: "mean" over the scored tokens (as ``F.cross_entropy``: NaN, with zero gradients, when none is
            scored) or "sum".
        chunk_size: tokens per chunk (None: as many as make ``CHUNK_ELEMENTS`` logits).

    Returns:
        the loss, a 0-d tensor in fp32 (fp64 for fp64 inputs).

    The logits are computed as ``F.linear`` computes them — under autocast in its dtype (bf16/fp16), else in h's —
    and upcast to fp32 for the softmax, as the LM's plain loss does. The gradients are computed in the forward,
    only where gradients are enabled and h or weight requires one; the backward multiplies them by the loss's
    gradient (it cannot be differentiated twice)."""
    name = "linear_cross_entropy"
    if not isinstance(h, torch.Tensor) or h.dim() < 2 or not h.is_floating_point():
        raise ValueError(f"{name}: `h` must be a floating-point tensor [S·B, ..., d], got {describe(h)}")
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != h.shape[-1]
            or not weight.is_floating_point()):
        raise ValueError(f"{name}: `weight` must be a floating-point tensor [V, d] = [V, {h.shape[-1]}], got "
                         f"{describe(weight)}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"{name}: `samples` must be an int >= 1, got {samples!r}")
    lead = [h.shape[0] // samples, *h.shape[1:-1]]
    if (not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64 or list(targets.shape) != lead
            or h.shape[0] % samples):
        raise ValueError(f"{name}: `targets` must be an int64 tensor of h's leading dims with the first over "
                         f"samples = {samples}, [B, ...] for h [{samples}·B, ..., d]; got {describe(targets)} and h "
                         f"{list(h.shape)}")
    if weight.device != h.device or targets.device != h.device:
        raise ValueError(f"{name}: `h`, `weight` and `targets` must be on one device, got {h.device}, "
                         f"{weight.device} and {targets.device}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{name}: `reduction` must be 'mean' or 'sum', got {reduction!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"{name}: `chunk_size` must be None or an int >= 1, got {chunk_size!r}")
    dtype = _compute_dtype(name, h, weight)
    V = weight.shape[0]
    if targets.numel():
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= V))
        require(~bad.any(), f"{name}: `targets` must be token ids in [0, V = {V}) or ignore_index = {ignore_index}",
                lambda: f", got {targets[bad].unique()[:8].tolist()}")
    chunk = chunk_size or max(1, CHUNK_ELEMENTS // (samples * V))
    grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(h, weight, targets, samples, reduction, ignore_index, chunk, dtype, grads)


def _kernels(h: torch.Tensor):
    """``kalmix.models.loss_kernels`` where the fused kernels run (``runs_fused``: CUDA; imported at first use),
    else None: the torch chain."""
    return triton_module("kalmix.models.loss_kernels") if runs_fused(h) else None


def _compute_dtype(name: str, h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The logits' dtype: ``F.linear``'s under autocast (which leaves fp64 alone), else h's and weight's one."""
    device = h.device.type
    if torch.is_autocast_enabled(device) and torch.float64 not in (h.dtype, weight.dtype):
        return torch.get_autocast_dtype(device)
    if h.dtype != weight.dtype:
        raise ValueError(f"{name}: `h` is {h.dtype} and `weight` {weight.dtype}; cast one to the other or run under "
                         f"torch.autocast")
    return h.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward: the loss and (if ``grads``) its gradients w.r.t. h and weight, chunk by chunk; backward: those
    gradients times the loss's."""

    @staticmethod
    def forward(ctx, h, weight, targets, samples, reduction, ignore_index, chunk, dtype, grads):
        acc = torch.promote_types(dtype, torch.float32)
        S, N, d = samples, targets.numel(), h.shape[-1]
        hs = h.reshape(S, N, d)
        targets = targets.flatten()
        keep = targets != ignore_index
        count = keep.sum()
        scale = 1 / count.clamp_min(1).to(acc) if reduction == "mean" else torch.ones((), dtype=acc,
                                                                                       device=h.device)
        need_h, need_w = grads and h.requires_grad, grads and weight.requires_grad
        dh = torch.empty_like(h, memory_format=torch.contiguous_format) if need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=h.device) if need_w else None
        total = torch.zeros((), dtype=acc, device=h.device)
        kernels = _kernels(h)
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dtype)
            for a in range(0, N, chunk):
                hc = hs[:, a:a + chunk].to(dtype)                                   # [S, c, d]
                y, kept = targets[a:a + chunk], keep[a:a + chunk]                   # [c]
                c = y.shape[0]
                z = (hc @ w.T).view(S * c, -1)                                      # [S·c, V] in dtype
                idx = y.masked_fill(~kept, 0).repeat(S)                             # [S·c]
                if kernels is not None:
                    lse, zy = kernels.row_lse(z, idx)
                else:
                    z = z.to(acc)
                    lse, zy = torch.logsumexp(z, -1), z.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
                logp = (zy - lse).view(S, c)                                        # [S, c] log p_s(y)
                nll = math.log(S) - torch.logsumexp(logp, 0)                        # [c]
                total += nll.masked_fill(~kept, 0).sum()
                if not grads:
                    continue
                # d nll / d z_s = q_s (softmax(z_s) - onehot(y)), q_s = the samples' posterior weights of y
                q = (torch.softmax(logp, 0) * kept * scale).flatten()               # [S·c]
                if kernels is not None:
                    g = kernels.softmax_grad_(z, idx, lse, q)
                else:
                    g = z.sub_(lse.unsqueeze(-1)).exp_()
                    g.scatter_add_(-1, idx.unsqueeze(-1), torch.full_like(idx, -1, dtype=acc).unsqueeze(-1))
                    g = g.mul_(q.unsqueeze(-1)).to(dtype)
                g = g.view(S, c, -1)                                                # [S, c, V]
                if need_h:
                    dh.view(S, N, d)[:, a:a + chunk] = g @ w
                if need_w:
                    dw += (g.flatten(0, 1).T @ hc.flatten(0, 1)).to(acc)
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return total / count.to(acc) if reduction == "mean" else total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        return (None if dh is None else (grad * dh).to(dh.dtype),
                None if dw is None else (grad * dw).to(ctx.weight_dtype), *[None] * 7)
