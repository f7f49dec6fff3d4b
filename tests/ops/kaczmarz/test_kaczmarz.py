"""Kaczmarz attention: the projection property and its exact equivalence with a reparameterised GDN."""
import pytest
import torch

from kalmix import ops
from kalmix.ops import SPECS
from kalmix.ops.common.testing import assert_close


def gdn_loop(q, k, v, g, beta, S, scale):
    """Gated DeltaNet written from its definition: S ← γS; S ← S + β k (v − Sᵀk)ᵀ; o = scale Sᵀq."""
    os = []
    for t in range(q.shape[1]):
        S = g[:, t].exp()[..., None, None] * S
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + beta[:, t][..., None, None] * torch.einsum("bhk,bhv->bhkv", k[:, t], err)
        os.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(os, 1), S


@pytest.mark.parametrize("impl", ["naive", "torch"])
@pytest.mark.parametrize("eps", [0.0, 1e-6, 0.3])
def test_equals_gdn_on_normalised_keys(impl, eps):
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, eta = SPECS["kaczmarz"].inputs(2, 80, 2, 6, 5, torch.float64, gen)
    S0 = SPECS["kaczmarz"].random_state(2, 2, 6, 5, torch.float64, gen)
    o, S = ops.kaczmarz_attention(q, k, v, g, eta, eps=eps, initial_state=S0, output_final_state=True, impl=impl)
    kn = (k * k).sum(-1, keepdim=True)
    ro, rS = gdn_loop(q, k / kn.sqrt(), v / kn.sqrt(), g, eta * kn[..., 0] / (kn[..., 0] + eps), S0, 6 ** -0.5)
    assert_close("o", o, ro, 1e-10)
    assert_close("S", S, rS, 1e-10)


@pytest.mark.parametrize("impl", ["naive", "torch"])
def test_unit_step_projects_onto_the_constraint(impl):
    """η = 1, eps = 0: every new state satisfies Sᵀk_t = v_t exactly."""
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, _ = SPECS["kaczmarz"].inputs(1, 12, 2, 4, 3, torch.float64, gen)
    S = torch.randn(1, 2, 4, 3, generator=gen, dtype=torch.float64)
    for t in range(12):
        sl = slice(t, t + 1)
        _, S = ops.kaczmarz_attention(q[:, sl], k[:, sl], v[:, sl], g[:, sl], torch.ones_like(g[:, sl]), eps=0.0,
                                      initial_state=S, output_final_state=True, impl=impl)
        assert_close(f"Sᵀk at t={t}", torch.einsum("bhk,bhkv->bhv", k[:, t], S), v[:, t], 1e-12)


@pytest.mark.parametrize("impl", ["naive", "torch", "triton"])
def test_zero_key_with_no_eps_writes_nothing(impl):
    """eps = 0 (the GDN layer) and an all-zero key: that token writes nothing (β = 0), as the Triton kernels and
    fla do, instead of 0/0: outputs and state equal a GDN loop with β = 0 there, every gradient finite and equal
    to the fp64 token loop's."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, eta = SPECS["kaczmarz"].inputs(1, 9, 2, 4, 3, torch.float64, gen)
    k = k.clone()
    k[:, 2] = 0
    kn = (k * k).sum(-1)
    beta = torch.where(kn > 0, eta / kn.clamp_min(1e-300), torch.zeros_like(eta))
    ro, rS = gdn_loop(q, k, v, g, beta, torch.zeros(1, 2, 4, 3, dtype=torch.float64), 4 ** -0.5)
    dtype, tol = (torch.float32, 1e-5) if impl == "triton" else (torch.float64, 1e-10)
    res = {}
    for which in (impl, "naive"):
        xs = [t.to(dtype if which == impl else torch.float64).clone().requires_grad_() for t in (q, k, v, g, eta)]
        o, S = ops.kaczmarz_attention(*xs, eps=0.0, output_final_state=True, impl=which)
        res[which] = [o, S, *torch.autograd.grad(o.square().sum() + S.square().sum(), xs)]
    for name, a, b in zip(["o", "S", "dq", "dk", "dv", "dg", "deta"], res[impl], res["naive"]):
        assert torch.isfinite(a).all(), name
        assert_close(name, a.double(), b, tol)
    assert_close("o", res[impl][0].double(), ro, tol)
    assert_close("S", res[impl][1].double(), rS, tol)
