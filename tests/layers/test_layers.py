"""Layers: fla's signature, recurrent decoding equals the full forward, padding equals packed sequences."""
import pytest
import torch

from kalmix.layers import MIXERS

SMALL = {
    "kalman": dict(d_state=6, num_heads=2),
    "kalman_triton": dict(d_state=6, num_heads=2, impl="triton"),  # fused kernels (interpreter on CPU)
    "gka": dict(num_heads=2, num_iters=12),
    "gka_triton": dict(num_heads=2, num_iters=12, impl="triton"),
    "kaczmarz": dict(num_heads=2),
    "vla": dict(num_heads=2),
    "vla_noconv": dict(num_heads=2, conv_size=0),
    "gdn": dict(num_heads=2),
    "attention": dict(num_heads=2),
}


def make(name, d_model=24, **kw):
    torch.manual_seed(0)
    return MIXERS[name.split("_")[0]](d_model, **SMALL[name], **kw).double()


@pytest.mark.parametrize("name", list(SMALL))
def test_forward_signature_and_gradients(name):
    layer = make(name)
    x = torch.randn(2, 33, 24, dtype=torch.float64, requires_grad=True)
    o, attn, cache = layer(x)
    assert o.shape == x.shape and attn is None and cache is None
    o.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    for pname, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


def decoded(layer, x, prefix: int):
    """The layer's output over x [B, T, d]: its first ``prefix`` tokens in one cached call, then one token at a
    time through the cache."""
    out, _, cache = layer(x[:, :prefix], use_cache=True)
    outs = [out]
    for t in range(prefix, x.shape[1]):
        out, _, cache = layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)
        outs.append(out)
    return torch.cat(outs, 1)


@pytest.mark.parametrize("name", list(SMALL))
def test_token_by_token_decoding_equals_full_forward(name):
    layer = make(name)
    x = torch.randn(2, 19, 24, dtype=torch.float64)
    torch.testing.assert_close(decoded(layer, x, 7), layer(x)[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", list(SMALL))
def test_padding_mask_equals_unpadded_sequences(name):
    layer = make(name)
    x = torch.randn(3, 16, 24, dtype=torch.float64)
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[0, :5] = 0                                                    # left padding
    mask[2, 12:] = 0                                                   # right padding
    o, _, _ = layer(x, attention_mask=mask)
    for b, (lo, hi) in enumerate([(5, 16), (0, 16), (0, 12)]):
        ref, _, _ = layer(x[b:b + 1, lo:hi])
        torch.testing.assert_close(o[b:b + 1, lo:hi], ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", [n for n in SMALL if n != "attention"])
def test_state_size_counts_the_cached_recurrent_state(name):
    layer = make(name)
    _, _, cache = layer(torch.randn(1, 5, 24, dtype=torch.float64), use_cache=True)
    state = cache[0]["recurrent_state"]
    tensors = state if isinstance(state, tuple) else (state,)
    assert sum(t.numel() for t in tensors) == layer.state_size()


def test_kalman_variance_through_output_projection():
    layer = make("kalman")
    x = torch.randn(2, 10, 24, dtype=torch.float64)
    o, var, _ = layer(x, output_variance=True)
    o_plain, none, _ = layer(x)
    assert none is None
    torch.testing.assert_close(o, o_plain)
    assert var.shape == o.shape and (var > 0).all()
    # Monte Carlo at the last token: draw each lane from its posterior N(μ, 1/λ), push through gate and out_proj
    from kalmix.ops import kalman_attention
    (q, k, v, w), (z, gate), _ = layer.project(layer.project_in(x), None)
    decay, noise = layer.dynamics()
    _, _, (lam, mu) = kalman_attention(q, k, v, w, decay, noise, output_final_state=True)
    gen = torch.Generator().manual_seed(0)
    draws = mu[0] + torch.randn(20000, *mu.shape[1:], generator=gen, dtype=mu.dtype) / lam[0].sqrt()  # [S, H, N, D]
    y = torch.einsum("hn,shnd->shd", q[0, -1], draws).reshape(20000, -1)
    y = (y + layer.skip * z[0, -1]) * torch.nn.functional.silu(gate[0, -1])
    samples = layer.out_proj(y)
    torch.testing.assert_close(samples.var(0), var[0, -1], rtol=0.05, atol=0)


def test_kalman_parameters_at_init_match_the_paper():
    layer = make("kalman")
    decay, noise = layer.dynamics()
    assert decay.min() > 0.9 and decay.max() < 1.0                     # exp(−Δ), Δ in [1e-3, 0.1]
    assert noise.max() < 1e-5 and noise.min() > 0                       # p²Δ-ish with p = 0.01


def test_bad_hidden_states_shape():
    layer = make("kaczmarz")
    with pytest.raises(ValueError, match=r"`hidden_states` must be \[B, T, 24\]"):
        layer(torch.randn(2, 5, 23, dtype=torch.float64))
