"""Helpers shared by the test-suite and by GPU check scripts: relative errors, random op inputs, and ptxas's
report on a compiled kernel."""
from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Callable

import torch

from kalmix import ops


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


@dataclass
class OpCase:
    """How to draw realistic random inputs for one op (K, V = N, D for Kalman)."""
    name: str
    fn: Callable
    inputs: Callable        # (B, T, H, K, V, dtype, gen) -> list of positional tensors
    state: Callable         # (n, H, K, V, dtype, gen) -> initial_state


def _rand(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _unif(gen, lo, hi, *shape, dtype):
    return (lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)).to(dtype)


def _spd(gen, n, H, K, dtype, shift):
    X = _rand(gen, n, H, K, K, dtype=torch.float64)
    return (X @ X.transpose(-1, -2) / K + shift * torch.eye(K, dtype=torch.float64)).to(dtype)


def _normalize(x):
    return x / x.norm(dim=-1, keepdim=True)


CASES = {
    "kalman": OpCase(
        "kalman", ops.kalman_attention,
        lambda B, T, H, K, V, dt, g: [_normalize(_rand(g, B, T, H, K, dtype=dt)),
                                      _normalize(_rand(g, B, T, H, K, dtype=dt)), _rand(g, B, T, H, V, dtype=dt),
                                      _unif(g, 0.1, 3.0, B, T, H, V, dtype=dt), _unif(g, 0.5, 1.0, H, K, V, dtype=dt),
                                      _unif(g, 0.0, 0.2, H, K, V, dtype=dt)],
        lambda n, H, K, V, dt, g: (_unif(g, 0.5, 2.0, n, H, K, V, dtype=dt), _rand(g, n, H, K, V, dtype=dt))),
    "gka": OpCase(
        "gka", ops.gated_kalmanet,
        lambda B, T, H, K, V, dt, g: [_rand(g, B, T, H, K, dtype=dt), _normalize(_rand(g, B, T, H, K, dtype=dt)),
                                      _rand(g, B, T, H, V, dtype=dt), _unif(g, -0.3, 0.0, B, T, H, dtype=dt),
                                      _unif(g, 0.05, 1.0, B, T, H, dtype=dt), _unif(g, 0.0, 1.0, B, T, H, dtype=dt)],
        lambda n, H, K, V, dt, g: (_spd(g, n, H, K, dt, 0.1), _rand(g, n, H, K, V, dtype=dt))),
    "kaczmarz": OpCase(
        "kaczmarz", ops.kaczmarz_attention,
        lambda B, T, H, K, V, dt, g: [_normalize(_rand(g, B, T, H, K, dtype=dt)), _rand(g, B, T, H, K, dtype=dt),
                                      _rand(g, B, T, H, V, dtype=dt), _unif(g, -0.3, 0.0, B, T, H, dtype=dt),
                                      _unif(g, 0.05, 1.0, B, T, H, dtype=dt)],
        lambda n, H, K, V, dt, g: _rand(g, n, H, K, V, dtype=dt)),
    "vla": OpCase(
        "vla", ops.variational_linear_attention,
        lambda B, T, H, K, V, dt, g: [_rand(g, B, T, H, K, dtype=dt), _rand(g, B, T, H, K, dtype=dt),
                                      _rand(g, B, T, H, V, dtype=dt), _rand(g, B, T, H, K, dtype=dt)],
        lambda n, H, K, V, dt, g: (_rand(g, n, H, K, V, dtype=dt), _spd(g, n, H, K, dt, 0.5),
                                   _unif(g, 0.0, 2.0, n, H, K, dtype=dt))),
    "gla": OpCase(       # GLA's regime: a log decay per key channel
        "gla", ops.gated_linear_attention,
        lambda B, T, H, K, V, dt, g: [_rand(g, B, T, H, K, dtype=dt), _rand(g, B, T, H, K, dtype=dt),
                                      _rand(g, B, T, H, V, dtype=dt), _unif(g, -0.5, 0.0, B, T, H, K, dtype=dt)],
        lambda n, H, K, V, dt, g: _rand(g, n, H, K, V, dtype=dt)),
    "value_delta": OpCase(   # the VLA notebook's DeltaNet: unit keys, a sigmoid gate per value channel
        "value_delta", ops.value_gated_delta_rule,
        lambda B, T, H, K, V, dt, g: [_rand(g, B, T, H, K, dtype=dt), _normalize(_rand(g, B, T, H, K, dtype=dt)),
                                      _rand(g, B, T, H, V, dtype=dt), _unif(g, -2.0, 0.0, B, T, H, V, dtype=dt)],
        lambda n, H, K, V, dt, g: _rand(g, n, H, K, V, dtype=dt)),
}


def run_case(case: OpCase, args, state, impl: str, **kw):
    """Call the op with every output requested; returns the flat list of outputs."""
    # GKA at ridge 0.3: 30 Chebyshev steps reach ~1e-13 (κ <= 4.3), so impl="triton"'s implicit-differentiation
    # gradients equal autograd through the steps; ridge 0.02 is tested against the exact solve in test_gka_triton
    extra = {"kalman": {"output_variance": True}, "gka": {"ridge": 0.3}}.get(case.name, {})
    out = case.fn(*args, initial_state=state, output_final_state=True, impl=impl, **extra, **kw)
    return [x for x in flatten_outputs(out) if x is not None]


def outputs_and_grads(case: OpCase, args, state, impl: str, seed: int = 1, **kw):
    """Outputs and the gradients of a random linear functional of all of them w.r.t. every input."""
    args = [a.detach().requires_grad_() for a in args]
    state_t = tuple(state) if isinstance(state, tuple) else (state,)
    state_t = tuple(s.detach().requires_grad_() for s in state_t)
    outs = run_case(case, args, state_t if isinstance(state, tuple) else state_t[0], impl, **kw)
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


def kalman_realistic_inputs(T, dtype, seed=0, B=1, H=1, N=16, D=8):
    """The regime of trained layers: decay near 1, tiny process noise, value precision up to 1e4."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, N, **f64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, N, **f64), dim=-1)
    v = torch.randn(B, T, H, D, **f64)
    w = 10 ** (6 * torch.rand(B, T, H, D, **f64) - 2)               # 1e-2 .. 1e4
    a = 0.9 + 0.099 * torch.rand(H, N, D, **f64)                   # [0.9, 0.999]
    p = 10 ** (-7 + torch.rand(H, N, D, **f64))                     # 1e-7 .. 1e-6
    return [x.to(dtype) for x in (q, k, v, w, a, p)]


def gka_layer_inputs(B, T, H, K, V, seed=0, dtype=torch.float64):
    """Gated KalmaNet in the trained layer's regime: unit q and k, β = sigmoid, Mamba-style decay near 1,
    α = sigmoid; a PSD initial H. Returns ([q, k, v, g, beta, alpha], (H0, U0))."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1), torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    g = -torch.exp(r(H) - 3) * torch.nn.functional.softplus(r(B, T, H) - 2)
    beta, alpha = torch.sigmoid(r(B, T, H)), torch.sigmoid(r(B, T, H) + 1)
    X = r(B, H, K, K)
    state = (X @ X.mT / K, r(B, H, K, V))
    return [x.to(dtype) for x in (q, k, r(B, T, H, V), g, beta, alpha)], tuple(s.to(dtype) for s in state)


def poison_empty(monkeypatch) -> None:
    """Make torch.empty, torch.empty_like and Tensor.new_empty hand out NaNs (for a test's duration), so an output
    element a kernel forgets to write fails the comparison; both test suites' conftest use it on every test."""
    def poisoned(make):
        def wrapper(*args, **kwargs):
            x = make(*args, **kwargs)
            if x.is_floating_point():
                x.fill_(float("nan"))
            return x
        return wrapper

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
