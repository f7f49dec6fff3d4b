"""Kaczmarz linear attention with unit keys is Gated DeltaNet: with ‖k‖ = 1 and eps = 0 its step η/(‖k‖² + eps) is
GDN's β = η (the Kaczmarz paper, §3.1 "Connection to GDN"; its released code runs both through one layer class,
``qk_norm='relaxed_kaczmarz_q_norm'`` against ``'l2'``). Checked in fp64 against a GDN token loop written from GDN's
recurrence S_t = γ_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ, at the op and at the layer.
"""
import pytest
import torch
import torch.nn.functional as F

from kalmix.layers import GatedDeltaNet, KaczmarzAttention
from kalmix.ops import kaczmarz_attention
from kalmix.ops.common.testing import assert_close, random_functional_grads, rel_err

TOL = 1e-12
IMPLS = ["naive", "torch", "triton"]


def gdn_loop(q, k, v, g, beta, state, scale):
    """Gated DeltaNet per token: S ← γ S, S ← S + β k (v − Sᵀk)ᵀ, o = scale · Sᵀq; q, k [B, T, H, K], v [B, T, H, V],
    g (log γ), beta [B, T, H], state [B, H, K, V]."""
    S, out = state, []
    for t in range(q.shape[1]):
        S = g[:, t].exp()[..., None, None] * S
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + beta[:, t, ..., None, None] * k[:, t, ..., :, None] * err[..., None, :]
        out.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, 1), S


def unit_inputs(B=2, T=37, H=2, K=8, V=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1)
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    eta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return [q, k, r(B, T, H, V), g, eta], r(B, H, K, V)


@pytest.mark.parametrize("impl", IMPLS)
def test_op_with_unit_keys_and_no_eps_is_gdn(impl):
    """Outputs, final state and the gradients of q, v, g, η and the initial state equal the GDN loop with β = η.
    The key's gradient differs by a radial term only: the Kaczmarz step depends on ‖k‖, GDN's β does not, so
    −2η(∂L/∂β) k is added along k, and the tangential parts (I − k kᵀ) dk agree (what reaches the raw key through
    an L2 normalisation, as in a layer)."""
    args, state = unit_inputs()
    leaves = [a.detach().requires_grad_() for a in (*args, state)]
    o, S = kaczmarz_attention(*leaves[:5], eps=0.0, initial_state=leaves[5], output_final_state=True, impl=impl)
    got = [o, S] + random_functional_grads([o, S], leaves)
    ref_leaves = [a.detach().requires_grad_() for a in (*args, state)]
    q, k, v, g, eta, s0 = ref_leaves
    ro, rS = gdn_loop(q, k, v, g, eta, s0, scale=q.shape[-1] ** -0.5)
    ref = [ro, rS] + random_functional_grads([ro, rS], ref_leaves)
    for name, x, r in zip(["o", "state", "dq", "dk", "dv", "dg", "deta", "dstate"], got, ref, strict=True):
        if name == "dk":
            radial = lambda d: (d * k).sum(-1, keepdim=True) * k          # noqa: E731
            assert_close("dk tangential", x - radial(x), r - radial(r), TOL)
            assert rel_err(x, r) > 1e-3                                  # the radial term is there
        else:
            assert_close(f"{impl} {name}", x, r, TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_op_default_eps_is_gdn_to_one_part_in_a_million(impl):
    """With Kaczmarz's default eps = 1e-6 the step is η/(1 + 1e-6): GDN to about 1e-6, not exactly."""
    args, state = unit_inputs(seed=1)
    o, _ = kaczmarz_attention(*args, initial_state=state, impl=impl)
    ro, _ = gdn_loop(*args, state, scale=args[0].shape[-1] ** -0.5)
    assert 1e-9 < rel_err(o, ro) < 1e-5


class UnitKeyKaczmarz(KaczmarzAttention):
    """The Kaczmarz layer with its projected keys L2-normalised (the one line GatedDeltaNet adds)."""

    def project(self, h, conv_state, docs=None):
        inputs, gate, conv_state = super().project(h, conv_state, docs)
        inputs[1] = F.normalize(inputs[1], dim=-1, eps=1e-6)
        return inputs, gate, conv_state


def _grads(layer, x):
    x = x.detach().requires_grad_()
    o = layer(x)[0]
    return [o] + random_functional_grads([o], [x, *layer.parameters()])


@pytest.mark.parametrize("impl", IMPLS)
def test_layer_with_unit_keys_is_gdn(impl):
    """Built from the same seed, the Kaczmarz and GDN layers have the same parameters (names, shapes, values:
    they differ in the key normalisation only). The Kaczmarz layer with eps = 0 and unit keys equals the GDN layer
    in outputs and in the gradients of the input and every parameter, and both equal the GDN loop on the GDN
    layer's projections (β = η) read out by its readout. With the default eps = 1e-6 it is GDN to ~1e-6."""
    torch.manual_seed(0)
    gdn = GatedDeltaNet(24, num_heads=2, impl=impl).double()
    torch.manual_seed(0)
    kac = UnitKeyKaczmarz(24, num_heads=2, eps=0.0, impl=impl).double()
    assert gdn.eps == kac.eps == 0.0
    gdn_params, kac_params = dict(gdn.named_parameters()), dict(kac.named_parameters())
    assert gdn_params.keys() == kac_params.keys()
    for name, p in gdn_params.items():
        assert torch.equal(p, kac_params[name]), name
    x = torch.randn(2, 29, 24, dtype=torch.float64)
    got, ref = _grads(kac, x), _grads(gdn, x)
    names = ["o", "dx"] + [f"d{n}" for n in gdn_params]
    for name, a, b in zip(names, got, ref, strict=True):
        assert_close(f"{impl} {name}", a, b, TOL)
    with torch.no_grad():
        (q, k, v, g, eta), gate, _ = gdn.project(gdn.project_in(x), None)
        assert_close("unit keys", k.norm(dim=-1), torch.ones_like(k[..., 0]), TOL)
        o, _ = gdn_loop(q, k, v, g, eta, q.new_zeros(2, 2, 12, 12), scale=12 ** -0.5)
        assert_close("GDN loop", gdn(x)[0], gdn.readout(o, None, gate)[0], TOL)
        kac.eps = 1e-6
        assert 1e-9 < rel_err(kac(x)[0], ref[0]) < 1e-5
