"""Gated linear attention against its unrolled closed form, for every decay layout, and its refusal of impl="triton"."""
import pytest
import torch

from kalmix import ops
from kalmix.ops.common.testing import assert_close


def closed_form(q, k, v, g, S0, scale):
    """o_t = scale · (q_t ⊙ e^{G_t})ᵀ S_0 + scale · Σ_{s<=t} Σ_k q_t[k] k_s[k] e^{G_t[k] − G_s[k]} v_s and the final
    state, with G_t = Σ_{r<=t} g_r over the whole sequence ([B, T, H, K], the decay broadcast over K)."""
    T = q.shape[1]
    G = g.cumsum(1)
    D = (G[:, :, None] - G[:, None, :]).exp() * torch.ones(T, T).tril().to(G)[None, :, :, None, None]
    scores = torch.einsum("bthk,bshk,btshk->bhts", q, k, D)
    o = scale * (torch.einsum("bthk,bhkv->bthv", q * G.exp(), S0) + torch.einsum("bhts,bshv->bthv", scores, v))
    decay_to_end = (G[:, -1:] - G).exp()
    S = G[:, -1, :, :, None].exp() * S0 + torch.einsum("bshk,bshv->bhkv", k * decay_to_end, v)
    return o, S


@pytest.mark.parametrize("impl", ["naive", "torch"])
@pytest.mark.parametrize("layout", ["per key channel", "per head", "no decay"])
def test_matches_the_closed_form(impl, layout, draw):
    """T = 150 spans three chunks of the torch impl, the last partial."""
    (q, k, v, g), S0 = draw("gla", 2, 150, 2, 5, 3, seed=1)
    g = {"per key channel": g, "per head": g[..., 0], "no decay": None}[layout]
    o, S = ops.gated_linear_attention(q, k, v, g, scale=0.4, initial_state=S0, output_final_state=True, impl=impl)
    g_k = torch.zeros_like(q) if g is None else (g[..., None] if g.dim() == 3 else g).expand_as(q)
    o_ref, S_ref = closed_form(q, k, v, g_k, S0, 0.4)
    assert_close("o", o, o_ref, 1e-10)
    assert_close("S", S, S_ref, 1e-10)


def test_triton_is_refused_by_name(draw):
    (q, k, v, g), _ = draw("gla", 2, 8, 2, 4, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match="gated_linear_attention: has no Triton kernel"):
        ops.gated_linear_attention(q, k, v, g, impl="triton")
