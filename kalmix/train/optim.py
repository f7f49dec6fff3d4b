"""The optimisation every kalmix training loop shares: ``kalmix train``'s ``Trainer``, the runs of ``kalmix bench
run`` recipes and ``kalmix bench mqar`` (``kalmix.bench.synthetic.fit``); ``kalmix bench lm`` times its AdamW.

AdamW over parameter groups, the learning-rate schedule, autocast (fp16 with a gradient scaler), gradient clipping,
and evaluation mode. What differs between the loops is their data, their evaluation metric and the
``OptimSection`` they pass.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn

from kalmix.train.config import OptimSection

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def param_groups(model: nn.Module, optim: OptimSection) -> list[dict]:
    """AdamW groups: matrices with weight decay; norms, biases and embeddings (unless ``optim.decay_embeddings``)
    without; the recurrent parameters (those a layer marks ``_no_weight_decay``: decays, process noise, step sizes,
    skip) without weight decay and at ``optim.recurrent_lr_mult`` times the learning rate."""
    decay, plain, recurrent = [], [], []
    embeddings = set() if optim.decay_embeddings else {id(m.weight) for m in model.modules()
                                                       if isinstance(m, nn.Embedding)}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if getattr(p, "_no_weight_decay", False):
            recurrent.append(p)
        elif p.dim() < 2 or id(p) in embeddings:
            plain.append(p)
        else:
            decay.append(p)
    groups = [dict(params=decay, weight_decay=optim.weight_decay, lr_mult=1.0, name="decay"),
              dict(params=plain, weight_decay=0.0, lr_mult=1.0, name="no_decay"),
              dict(params=recurrent, weight_decay=0.0, lr_mult=optim.recurrent_lr_mult, name="recurrent")]
    return [g for g in groups if g["params"]]


def lr_factor(step: int, optim: OptimSection, steps: int) -> float:
    """The learning rate at optimizer step ``step`` (0-based) of ``steps`` as a fraction of the peak: linear
    warm-up over ``optim.warmup_steps``, then ``optim.schedule`` down to ``optim.min_lr_ratio`` at the last step."""
    o = optim
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    if o.schedule == "wsd":
        decay_start = steps - max(1, round(o.decay_fraction * steps))
        if step < decay_start:
            return 1.0
        frac = (step - decay_start + 1) / (steps - decay_start)
        return 1.0 - (1.0 - o.min_lr_ratio) * frac
    frac = min(1.0, (step - o.warmup_steps + 1) / max(1, steps - o.warmup_steps))
    return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))


def autocast(device_type: str, dtype: str):
    """The autocast context of ``dtype`` (bf16 or fp16) on ``device_type``; fp32: none. Weights stay fp32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=_AUTOCAST[dtype])


@contextlib.contextmanager
def evaluating(model: nn.Module):
    """The block runs ``model`` in eval mode and without gradients; the model's mode comes back after it."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


class Optimization:
    """AdamW on ``param_groups(model, optim)`` (fused on CUDA unless ``sharded``: FSDP2's DTensors), stepped at
    ``optim``'s schedule over ``steps`` optimizer steps, under ``dtype`` autocast (fp16: with a GradScaler).

    One optimizer step: ``with opt.autocast(): loss = ...`` and ``opt.backward(loss)`` per micro-batch, then
    ``norm = opt.clip(parameters)`` and ``opt.update(step)``. The caller decides when to read the norm (a float of
    it waits for the device)."""

    def __init__(self, model: nn.Module, optim: OptimSection, steps: int, device: torch.device, dtype: str = "fp32",
                 sharded: bool = False):
        self.optim, self.steps, self.device_type, self.dtype = optim, steps, device.type, dtype
        fused = device.type == "cuda" and not sharded
        self.optimizer = torch.optim.AdamW(param_groups(model, optim), lr=optim.lr,
                                           betas=(optim.beta1, optim.beta2), eps=optim.eps, fused=fused or None)
        self.scaler = torch.amp.GradScaler(device.type) if dtype == "fp16" else None

    def autocast(self):
        return autocast(self.device_type, self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def clip(self, parameters) -> torch.Tensor:
        """Unscale the gradients (fp16) and clip their global norm to ``optim.grad_clip`` (None: no clipping):
        -> the norm before clipping, a 0-d tensor (a DTensor under FSDP2)."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        clip = self.optim.grad_clip if self.optim.grad_clip is not None else math.inf
        return torch.nn.utils.clip_grad_norm_(parameters, clip)

    def update(self, step: int) -> float:
        """Optimizer step ``step`` (0-based) at its learning rate (``optim.lr`` · the group's ``lr_mult`` · the
        schedule), then the gradients zeroed: -> the first group's learning rate. fp16's scaler skips a step whose
        gradients are not finite."""
        factor = lr_factor(step, self.optim, self.steps)
        for g in self.optimizer.param_groups:
            g["lr"] = self.optim.lr * (g["lr_mult"] * factor)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.optimizer.param_groups[0]["lr"]
