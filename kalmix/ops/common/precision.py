"""Mixed precision at the ops' boundary: the state math never runs under ``torch.autocast``."""
from __future__ import annotations

import functools

import torch


def no_autocast(fn):
    """Run ``fn`` with autocast off on the device of its first tensor argument.

    The ops take activations in any float dtype and compute their state math in fp32 (fp64 for fp64 inputs)
    by explicit casts; an enclosing autocast region would silently run those fp32 matmuls in bf16/fp16. Applied
    to every public op and to the ``backward`` of every custom autograd Function (which runs under autocast
    when ``.backward()`` is called inside the region)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        device = x.device.type if x is not None else "cpu"
        if torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return run
