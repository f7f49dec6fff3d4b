"""The VLA notebook's own baselines against fp64 token loops written from the notebook: its unit-step gated
DeltaNet (``NotebookDeltaNet``) and its softmax attention (``SoftmaxAttention(rope=False, bias=True)``, positions
from the model). Each loop takes the kalmix layer's weights (slices of its parameters, so gradients reach the same
leaves) and is compared in outputs, final state and every gradient; a variant of the loop with one detail changed
must differ, so the comparison can fail.

Source read: Vishal-sys-code/variational-linear-attention @ 71b33b1, notebooks/07-vlav3-benchmark-fixed.ipynb,
cell 3 (``SoftmaxAttn``, ``DeltaNetAttn``)."""
import math

import pytest
import torch
import torch.nn.functional as F

from kalmix.layers import NotebookDeltaNet, SoftmaxAttention
from kalmix.ops.common.testing import assert_close, random_functional_grads
from tests.layers.test_layers import decoded

TOL = 1e-12


def deltanet_notebook(x, w, H, gate_on="value"):
    """``DeltaNetAttn.forward`` per (batch, head), x [B, T, d] -> (out [B, T, d], S [B, H, V, K]): q, k, v, g =
    x W + b; Q = elu(q) + 1, K = k/‖k‖, G = sigmoid(g) per head; per token pred = S k, err = v − pred,
    S = diag(g) S + err kᵀ (S is [V, K]: the gate scales value rows), y = S q; out = merged y W_o + b_o.
    ``gate_on="key"`` scales S's key columns instead (a wrong reading, for the must-differ check)."""
    B, T, d = x.shape
    D = d // H
    heads = lambda t: t.view(B, T, H, D)                                 # noqa: E731
    q = F.elu(heads(x @ w["Wq"].T + w["bq"])) + 1
    k = F.normalize(heads(x @ w["Wk"].T + w["bk"]), p=2, dim=-1)
    v = heads(x @ w["Wv"].T + w["bv"])
    g = torch.sigmoid(heads(x @ w["Wg"].T + w["bg"]))
    S = x.new_zeros(B, H, D, D)
    ys = []
    for t in range(T):
        kt, vt, qt, gt = k[:, t], v[:, t], q[:, t], g[:, t]
        err = vt - torch.einsum("bhde,bhe->bhd", S, kt)
        gated = gt[..., :, None] * S if gate_on == "value" else S * gt[..., None, :]
        S = gated + torch.einsum("bhd,bhe->bhde", err, kt)
        ys.append(torch.einsum("bhde,bhe->bhd", S, qt))
    return torch.stack(ys, 1).reshape(B, T, d) @ w["Wo"].T + w["bo"], S


def deltanet_weights(layer):
    """The notebook's Wq, Wk, Wv, Wg (and biases), Wo as views of the layer's fused projection."""
    d = layer.d_model
    W, b = layer.qkvg_proj.weight, layer.qkvg_proj.bias
    w = {f"W{n}": W[i * d:(i + 1) * d] for i, n in enumerate("qkvg")}
    w.update({f"b{n}": b[i * d:(i + 1) * d] for i, n in enumerate("qkvg")})
    w.update(Wo=layer.o_proj.weight, bo=layer.o_proj.bias)
    return w


def _layer(cls, d=24, **kw):
    torch.manual_seed(0)
    layer = cls(d, **kw).double()
    with torch.no_grad():                          # biases away from their zero init, so that they are tested
        for p in layer.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.5)
    return layer


@pytest.mark.parametrize("impl", ["naive", "torch"])
@pytest.mark.parametrize("T", [1, 7, 33, 70])
def test_deltanet_is_the_notebooks(T, impl):
    layer = _layer(NotebookDeltaNet, num_heads=3, impl=impl)
    x = torch.randn(2, T, 24, dtype=torch.float64, requires_grad=True)
    leaves = [x, *layer.parameters()]
    out, _, cache = layer(x, use_cache=True)
    S = cache[0]["recurrent_state"]                                      # [B, H, K, V]
    ref, ref_S = deltanet_notebook(x, deltanet_weights(layer), 3)
    assert_close("out", out, ref, TOL)
    assert_close("final state", S, ref_S.transpose(-1, -2), TOL)
    got = random_functional_grads([out, S], leaves)
    want = random_functional_grads([ref, ref_S.transpose(-1, -2)], leaves)
    for name, a, b in zip(["x", *(n for n, _ in layer.named_parameters())], got, want, strict=True):
        assert_close(f"d{name}", a, b, TOL)
    if T > 1:
        other, _ = deltanet_notebook(x, deltanet_weights(layer), 3, gate_on="key")
        assert (other - ref).norm() > 1e-3 * ref.norm()


def test_deltanet_strong_gates_stay_finite_and_match_the_loop():
    """Gates near 0 (logits of −30): fp32 through the chunked op against the fp64 loop."""
    layer = _layer(NotebookDeltaNet, num_heads=2)
    with torch.no_grad():
        layer.qkvg_proj.bias[72:].fill_(-30.0)
    x = torch.randn(1, 100, 24, dtype=torch.float64)
    with torch.no_grad():
        ref, _ = deltanet_notebook(x, deltanet_weights(layer), 2)
    out, _, _ = layer.float()(x.float().requires_grad_())
    assert_close("out", out, ref, 1e-5)
    out.square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_deltanet_refuses_bad_arguments():
    with pytest.raises(ValueError, match="there is no Triton kernel"):
        NotebookDeltaNet(16, impl="triton")
    with pytest.raises(ValueError, match="`bias` must be True or False, got 'yes'"):
        NotebookDeltaNet(16, bias="yes")
    with pytest.raises(ValueError, match="num_heads"):
        NotebookDeltaNet(16, num_heads=3)


def softmax_notebook(x, w, H):
    """``SoftmaxAttn.forward``: q, k, v = x W_qkv + b split in three, per head softmax(q kᵀ/√D + causal mask) v,
    merged, W_o + b_o. No positions: the notebook's model adds learned ones to the tokens."""
    B, T, d = x.shape
    D = d // H
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (x @ w["W"].T + w["b"]).chunk(3, dim=-1))
    s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, d)
    return o @ w["Wo"].T + w["bo"]


@pytest.mark.parametrize("T", [1, 9, 40])
def test_attention_without_rope_with_biases_is_the_notebooks(T):
    layer = _layer(SoftmaxAttention, d=24, num_heads=3, rope=False, bias=True)
    x = torch.randn(2, T, 24, dtype=torch.float64, requires_grad=True)
    leaves = [x, *layer.parameters()]
    w = dict(W=layer.qkv_proj.weight, b=layer.qkv_proj.bias, Wo=layer.o_proj.weight, bo=layer.o_proj.bias)
    out, ref = layer(x)[0], softmax_notebook(x, w, 3)
    assert_close("out", out, ref, TOL)
    for i, (a, b) in enumerate(zip(random_functional_grads([out], leaves), random_functional_grads([ref], leaves))):
        assert_close(f"grad {i}", a, b, TOL)
    if T > 1:
        layer.rope = True
        assert (layer(x)[0] - ref).norm() > 1e-3 * ref.norm()


def test_attention_without_rope_decodes_and_takes_odd_heads():
    """rope=False lifts the even-head-size rule (nothing is rotated); cached decoding equals the full forward."""
    layer = _layer(SoftmaxAttention, d=15, num_heads=3, rope=False, bias=True)
    x = torch.randn(2, 11, 15, dtype=torch.float64)
    torch.testing.assert_close(decoded(layer, x, 6), layer(x)[0], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="must be even"):
        SoftmaxAttention(15, num_heads=3)
    for arg in ("rope", "bias"):
        with pytest.raises(ValueError, match=f"`{arg}` must be True or False, got 1"):
            SoftmaxAttention(16, **{arg: 1})
