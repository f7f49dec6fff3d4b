"""impl="triton" of Kaczmarz attention: the delta rule on the raw keys and values with the step

    β = η / (‖k‖² + eps)        (0 where ‖k‖² + eps = 0: a zero key with eps = 0 writes nothing)

which is the Kaczmarz step itself; no pass rewrites k or v. (DESIGN §1.3 writes the same rule as Gated DeltaNet
on k/‖k‖, v/‖k‖ with β = η‖k‖²/(‖k‖² + eps).) Gradients reach the raw k, v, eta and g.

Two engines run it:
- fla's public ``chunk_gated_delta_rule`` on CUDA wherever fla runs it both ways (β from ``kaczmarz_step``, one
  Triton pass over k, differentiable: beta_triton.py);
- kalmix's own chunked Triton kernels (kalmix/ops/common/delta_triton.py, ``step_eps``: their first kernel
  computes β from the keys it loads, and the backward folds β's gradient into dk and dη) where fla refuses the
  backward of its gated chunk kernels (Hopper with triton in [3.4.0, 3.7.1): a miscompile, its issue #640),
  with or without gradients, for fp64 inputs (fla takes none), and on CPU under TRITON_INTERPRET (how CI runs
  them).
A log line on the ``kalmix`` logger names the engine the first time kalmix's kernels stand in for fla on a GPU.
A one-token call without gradients (decoding) runs ``step.py``'s single kernel instead.
"""
from __future__ import annotations

import logging
import re
from typing import Mapping, Sequence

import torch
import triton

from kalmix.ops.common.checks import Range, compute_dtype, defer_check, no_check
from kalmix.ops.common.delta_triton import chunk_delta_rule_triton, max_head_size
from kalmix.ops.kaczmarz.beta_triton import kaczmarz_step, step_extrema
from kalmix.ops.kaczmarz.step import kaczmarz_step_fused

_OP = "kaczmarz_attention"
log = logging.getLogger("kalmix")
_told = False


def fla_gated_backward_refused(device: torch.device) -> bool:
    """Whether fla refuses its gated chunk backward here: a Hopper GPU with 3.4.0 <= triton < 3.7.1."""
    if device.type != "cuda":
        return False
    version = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)\.(\d+)", triton.__version__).groups())
    return torch.cuda.get_device_capability(device)[0] == 9 and (3, 4, 0) <= version < (3, 7, 1)


def engine(device: torch.device, dtype: torch.dtype) -> str:
    """"fla" or "kalmix": which kernels run the op for inputs on ``device`` of ``dtype``. Where fla refuses its
    gated backward kalmix's kernels run the forward too, with or without gradients: one engine per machine, so a
    model is evaluated by the kernels it was trained with (and on an H100 kalmix's forward measured 0.532 ms of
    GPU time against fla's 0.543 with the step pass, 32K tokens, H = 8, K = V = 128, bf16)."""
    if device.type != "cuda" or dtype == torch.float64 or fla_gated_backward_refused(device):
        return "kalmix"
    return "fla"


FLA_MAX_K = 256     # fla's chunk_gated_delta_rule asserts K <= 256


def max_head_sizes(dtype: torch.dtype, device: torch.device) -> dict[str, tuple[int, str]]:
    """{"K": (the largest K the engine that runs inputs of ``dtype`` on ``device`` takes, why)}; V is walked in
    blocks by both."""
    if engine(device, dtype) == "fla":
        return {"K": (FLA_MAX_K, "fla's chunk_gated_delta_rule holds K in one tile")}
    return {"K": max_head_size(dtype)}


def _fla_gdn(q, k, v, g, beta, *, scale, state, cu_seqlens, final_state):
    """fla's chunk_gated_delta_rule: o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32 (None unless
    ``final_state``: fla zero-fills it)."""
    from fla.ops import chunk_gated_delta_rule
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=final_state,
                                  cu_seqlens=None if cu_seqlens is None else cu_seqlens.tensor.long())


def announce(dtype: torch.dtype) -> None:
    """Say once per process that kalmix's kernels stand in for fla's on this GPU, and why."""
    global _told
    if not _told:
        why = ("fp64 inputs" if dtype == torch.float64 else
               f"fla refuses its gated backward on this GPU (Hopper, triton {triton.__version__} < 3.7.1)")
        log.warning("%s(impl='triton'): %s; kalmix's own chunked Triton kernels run the op forward and backward",
                    _OP, why)
        _told = True


def kaczmarz_fused(q, k, v, g, eta, *, state, eps, scale, cu_seqlens=None, check: Sequence[Range] = (),
                   finite: Mapping[str, torch.Tensor | None] | None = None, final_state: bool = True):
    """Kaczmarz attention on fla's or kalmix's chunk kernels (module docstring). q, k [B, T, H, K],
    v [B, T, H, V] of one dtype; g, eta [B, T, H]; ``state`` [N, H, K, V] fp32 (fp64 for fp64 inputs) or None
    (zeros); packed sequences (checked ``Offsets``) are handed to the kernels. ``check``: the op's ranges of g and
    eta, checked by the pass that computes the step; ``finite`` (given with ``check``): name -> tensor that must
    have no NaN or Inf, read back with them. Returns o [B, T, H, V] (q's dtype), the final state [N, H, K, V] and
    the check's ``finish()`` (checks.defer_check), to call before the outputs are used."""
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, eta, state))
    if q.shape[1] == 1 and cu_seqlens is None and not check and not grad:     # decoding: one launch (step.py)
        S = state if state is not None else q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3],
                                                       dtype=compute_dtype(q))
        o, S = kaczmarz_step_fused(q[:, 0], k[:, 0], v[:, 0], g[:, 0], eta[:, 0], S, eps=eps, scale=scale)
        return o[:, None], S, no_check
    if engine(q.device, q.dtype) == "fla":
        ext = step_extrema(eta.numel(), q.device) if check else None
        beta = kaczmarz_step(k, eta, eps, g, ext)     # fla's kernels take β with its gradient
        finish = defer_check(_OP, check, ext, finite) if check else no_check
        return (*_fla_gdn(q, k, v, g, beta, scale=scale, state=state, cu_seqlens=cu_seqlens,
                          final_state=final_state), finish)
    if q.device.type == "cuda":
        announce(q.dtype)
    # kalmix's first kernel computes the step from the keys it loads, folds its gradient into dk and dη, and checks
    # g and η on the way
    out = chunk_delta_rule_triton(q, k, k, v, g, eta, scale=scale, state=state, cu_seqlens=cu_seqlens,
                                  step_eps=eps, check=bool(check))
    return out[0], out[1], defer_check(_OP, check, out[2], finite) if check else no_check
