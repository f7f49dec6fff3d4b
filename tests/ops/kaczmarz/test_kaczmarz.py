"""Kaczmarz attention: the projection property and its exact equivalence with a reparameterised GDN."""
import pytest
import torch

from kalmix import ops
from kalmix.ops.common.testing import CASES, assert_close


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
    q, k, v, g, eta = CASES["kaczmarz"].inputs(2, 80, 2, 6, 5, torch.float64, gen)
    S0 = CASES["kaczmarz"].state(2, 2, 6, 5, torch.float64, gen)
    o, S = ops.kaczmarz_attention(q, k, v, g, eta, eps=eps, initial_state=S0, output_final_state=True, impl=impl)
    kn = (k * k).sum(-1, keepdim=True)
    ro, rS = gdn_loop(q, k / kn.sqrt(), v / kn.sqrt(), g, eta * kn[..., 0] / (kn[..., 0] + eps), S0, 6 ** -0.5)
    assert_close("o", o, ro, 1e-10)
    assert_close("S", S, rS, 1e-10)


@pytest.mark.parametrize("impl", ["naive", "torch"])
def test_unit_step_projects_onto_the_constraint(impl):
    """η = 1, eps = 0: every new state satisfies Sᵀk_t = v_t exactly."""
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, _ = CASES["kaczmarz"].inputs(1, 12, 2, 4, 3, torch.float64, gen)
    S = torch.randn(1, 2, 4, 3, generator=gen, dtype=torch.float64)
    for t in range(12):
        sl = slice(t, t + 1)
        _, S = ops.kaczmarz_attention(q[:, sl], k[:, sl], v[:, sl], g[:, sl], torch.ones_like(g[:, sl]), eps=0.0,
                                      initial_state=S, output_final_state=True, impl=impl)
        assert_close(f"Sᵀk at t={t}", torch.einsum("bhk,bhkv->bhv", k[:, t], S), v[:, t], 1e-12)
