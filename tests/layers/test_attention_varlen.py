"""The varlen flash paths of softmax attention (packed documents, chunked prefill) on CPU: the CUDA kernel's
contract — sequences laid end to end, causal with each sequence's queries the last of its keys — is played by
a pure-PyTorch stand-in, so the layer's calls into it (layouts, offsets, lengths, positions) are checked
against the masked SDPA path in fp64. The kernel itself runs in gpu_tests/test_layers_gpu.py."""
import pytest
import torch

import kalmix.layers.attention as attention
from kalmix.layers import SoftmaxAttention


def varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k):
    """What torch's varlen flash kernel computes (causal, bottom-right aligned), one sequence at a time."""
    assert q.dim() == 3 and k.shape == v.shape and q.shape[1:] == k.shape[1:]
    assert cu_q.dtype == cu_k.dtype == torch.int32 and len(cu_q) == len(cu_k)
    out = torch.full_like(q, float("nan"))
    for i in range(len(cu_q) - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        assert b - a <= max_q and d - c <= max_k
        Tq, Tk = b - a, d - c
        mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
        o = torch.nn.functional.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[c:d].transpose(0, 1),
                                                             v[c:d].transpose(0, 1), attn_mask=mask)
        out[a:b] = o.transpose(0, 1)
    return out


@pytest.fixture
def stand_in(monkeypatch):
    def use(on: bool):
        monkeypatch.setattr(attention, "flash_eligible", lambda q: on)
        monkeypatch.setattr(attention, "varlen_causal", varlen_stand_in)
    return use


def _outputs(layer, x, **kw):
    x = x.clone().requires_grad_()
    y = layer(x, **kw)[0]
    return [y, *torch.autograd.grad(y.square().sum(), [x, *layer.parameters()])]


def test_documents_through_varlen_equal_masked_sdpa(stand_in):
    torch.manual_seed(0)
    layer = SoftmaxAttention(32, num_heads=4).double()
    x = torch.randn(3, 17, 32, dtype=torch.float64)
    cu = torch.tensor([0, 5, 17, 18, 30, 34, 40, 51], dtype=torch.int32)
    stand_in(False)
    ref = _outputs(layer, x, cu_seqlens=cu)
    stand_in(True)
    got = _outputs(layer, x, cu_seqlens=cu)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_chunked_prefill_through_varlen_equals_full_forward(stand_in):
    torch.manual_seed(0)
    layer = SoftmaxAttention(32, num_heads=4).double()
    x = torch.randn(2, 23, 32, dtype=torch.float64)
    full = layer(x)[0]
    stand_in(True)
    a, _, cache = layer(x[:, :9], use_cache=True)
    b, _, cache = layer(x[:, 9:], past_key_values=cache, use_cache=True)
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=1e-10, atol=1e-10)
