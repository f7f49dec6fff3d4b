"""Helpers shared by the test-suite and by GPU check scripts: relative errors, calls of an op with every output
requested (its random inputs are its spec's, ``kalmix.ops.SPECS``), and ptxas's report on a compiled kernel."""
from __future__ import annotations

import os
import subprocess
import tempfile

import torch

from kalmix.ops.common.spec import OpSpec


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS error ‖x − ref‖ / ‖ref‖ (absolute when ref is 0), computed in fp64."""
    x, ref = x.detach().double(), ref.detach().double()
    den = ref.norm().item()
    return (x - ref).norm().item() / (den if den > 0 else 1.0)


def ptxas_verbose(ptx: str, arch: str) -> subprocess.CompletedProcess:
    """Assemble ``ptx`` for ``arch`` (e.g. "sm_90a") with the ptxas bundled in the installed Triton, verbose: its
    output names the registers, the spill stores and its performance warnings (C75xx: wgmma serialised). Nothing
    is written; the caller checks the return code."""
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        return subprocess.run([ptxas, f"-arch={arch}", "-v", f.name, "-o", os.devnull], capture_output=True,
                              text=True)


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(x).all(), f"{name}: non-finite values"
    err = rel_err(x, ref)
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.1e}"


def flatten_outputs(out) -> list[torch.Tensor | None]:
    """(o, [variance,] state) -> flat list with the state's tensors spread out."""
    flat = []
    for x in out:
        if isinstance(x, (tuple, list)):
            flat.extend(x)
        else:
            flat.append(x)
    return flat


def run_case(spec: OpSpec, args, state, impl: str, **kw):
    """Call the op of ``spec`` with every output requested (and its ``test_kwargs``); returns the flat list of
    outputs."""
    requested = {flag: True for flag in spec.outputs if flag is not None}
    out = spec.fn(*args, initial_state=state, output_final_state=True, impl=impl, **requested, **spec.test_kwargs,
                  **kw)
    return [x for x in flatten_outputs(out) if x is not None]


def outputs_and_grads(spec: OpSpec, args, state, impl: str, seed: int = 1, **kw):
    """Outputs and the gradients of a random linear functional of all of them w.r.t. every input."""
    args = [a.detach().requires_grad_() for a in args]
    state_t = tuple(state) if isinstance(state, tuple) else (state,)
    state_t = tuple(s.detach().requires_grad_() for s in state_t)
    outs = run_case(spec, args, state_t if isinstance(state, tuple) else state_t[0], impl, **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)).sum() for o in outs)
    grads = torch.autograd.grad(loss, [*args, *state_t])
    return [o.detach() for o in outs], list(grads)


def random_functional_grads(outs, leaves, seed: int = 1) -> list[torch.Tensor]:
    """Gradients w.r.t. ``leaves`` of Σ_i ⟨r_i, outs_i⟩ in fp64 for fixed Gaussian r_i (drawn on the CPU from
    ``seed``, so every impl and device sees the same functional); zeros for a leaf the outputs do not reach."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
               for o in outs)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(x) if d is None else d for x, d in zip(leaves, grads)]


def poison_empty(monkeypatch) -> None:
    """Make torch.empty, torch.empty_like and Tensor.new_empty hand out NaNs (for a test's duration), so an output
    element a kernel forgets to write fails the comparison; both test suites' conftest use it on every test."""
    def poisoned(make):
        def wrapper(*args, **kwargs):
            x = make(*args, **kwargs)
            if x.is_floating_point():
                with torch.no_grad():       # a leaf made with requires_grad (torch.utils.checkpoint's, torch 2.11)
                    x.fill_(float("nan"))
            return x
        return wrapper

    # `with torch.device(...)` finds the factories it places by identity, in a set made once per process: make it
    # before they are wrapped, or a model built under `torch.device("meta")` lands on the CPU for the whole run
    torch.utils._device._device_constructors()
    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned(torch.Tensor.new_empty))


def launch_args(monkeypatch, kernel, name: str) -> list:
    """The value of keyword argument ``name`` (a constexpr) at each launch of the Triton ``kernel`` from here on,
    in order (``kernel[grid](...)`` goes through ``kernel.run``, here and in the interpreter)."""
    seen = []
    run = kernel.run

    def spy(*args, **kwargs):
        seen.append(kwargs[name])
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", spy)
    return seen
