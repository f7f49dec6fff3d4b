"""The layers' fused kernels (kalmix/layers/fused.py, interpreter on CPU) against the torch chains they replace
(the Kalman layer's sensor split, OU dynamics and gated skip, and ShortConv's convolution): values and every
gradient, in fp64 and fp32, with the edge cases of each formula."""
import types

import pytest
import torch
import torch.nn.functional as F

from kalmix.layers import KalmanAttention
from kalmix.layers.common import GatedRMSNorm, upcast
from kalmix.layers.fused import gated_skip, l2_normalize, ou_dynamics, rms_norm, sensor_split
from kalmix.ops.common.testing import assert_close, random_functional_grads, rel_err

TOL = {torch.float64: 1e-12, torch.float32: 2e-6}


def _grads(fn, inputs, seed):
    """Outputs of fn(*inputs) and the gradients of a random linear functional of them w.r.t. the inputs."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    outs = fn(*xs)
    return [o.detach() for o in outs], random_functional_grads(outs, xs, seed)


def _sensor_torch(p, H, N):
    B, T, W = p.shape
    M = (W - 2 * H * N) // 2
    v, s, k, q = p.split([M, M, H * N, H * N], dim=-1)
    w = (1.0 / (F.softplus(upcast(s)) + 1e-4)).to(p.dtype)
    return v, w, F.normalize(k.view(B, T, H, N), dim=-1), F.normalize(q.view(B, T, H, N), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sensor_split(dtype):
    """M = 300 spans two column blocks (the last partial), H = 3, N = 5 pad the head tile, 37 rows three row
    blocks; s reaches past softplus's threshold (20) and down to −30 (where log(1 + e^s) needs log1p), and one
    row's k is zero (F.normalize's eps branch)."""
    H, N, M = 3, 5, 300
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(1, 37, 2 * M + 2 * H * N, generator=gen, dtype=dtype)
    p[..., M:2 * M] *= 12
    p[0, 3, M:M + 4] = torch.tensor([-30.0, 25.0, 20.0, -17.0], dtype=dtype)
    p[0, 5, 2 * M:2 * M + H * N] = 0
    ref_out, ref_grad = _grads(lambda x: _sensor_torch(x, H, N), [p], 1)
    out, grad = _grads(lambda x: sensor_split(x, H, N), [p], 1)
    for name, a, b in zip(("v", "Λv", "k", "q", "dp"), out + grad, ref_out + ref_grad):
        assert_close(name, a.reshape(b.shape), b, TOL[dtype])


def test_sensor_split_without_some_gradients():
    """Outputs nobody differentiates (Λv, k here) give zero gradient to their part of the projection."""
    gen = torch.Generator().manual_seed(2)
    p = torch.randn(2, 9, 2 * 20 + 2 * 4, generator=gen, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 9, 1, 4, generator=gen, dtype=torch.float64)
    v, w, k, q = sensor_split(p, 1, 4)
    (dp,) = torch.autograd.grad((v * 2).sum() + (q * c).sum(), p)
    rv, _, _, rq = _sensor_torch(p, 1, 4)
    (ref,) = torch.autograd.grad((rv * 2).sum() + (rq * c).sum(), p)
    assert_close("dp", dp, ref, 1e-12)
    assert (dp[..., 20:44] == 0).all() and (dp[..., 44:] != 0).all()


def _ou_torch(A_log, dt_raw, p):
    a = upcast(A_log).exp()
    dt = F.softplus(upcast(dt_raw))
    return torch.exp(-a * dt), upcast(p) ** 2 / (2 * a) * -torch.expm1(-2 * a * dt)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ou_dynamics(dtype):
    """aΔ from 1e-4 (the trained regime, where 1 − e^{−2aΔ} and its derivative need their series) to 30,
    across the 0.1 switch of the series; 1100 elements span two blocks."""
    gen = torch.Generator().manual_seed(3)
    n = 1100
    dt = torch.exp(torch.rand(n, generator=gen, dtype=torch.float64) * 10 - 9)          # 1.2e-4 .. 2.7
    dt_raw = (dt + torch.log(-torch.expm1(-dt))).to(dtype)
    A_log = (torch.rand(n, generator=gen, dtype=torch.float64) * 5 - 2).to(dtype)       # a in 0.14 .. 20
    p = (torch.rand(n, generator=gen, dtype=torch.float64) * 0.1).to(dtype)
    ref64 = _grads(_ou_torch, [x.double() for x in (A_log, dt_raw, p)], 4)
    out, grad = _grads(ou_dynamics, [A_log.view(11, 4, 25), dt_raw.view(11, 4, 25), p.view(11, 4, 25)], 4)
    for name, a, b in zip(("ā", "p̄", "dA_log", "ddt_raw", "dp"), out + grad, ref64[0] + ref64[1]):
        assert_close(name, a.reshape(-1).double(), b, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gated_skip(dtype):
    """gate as the strided half of a projection's output, like the layer's; 300 channels, 21 rows."""
    gen = torch.Generator().manual_seed(5)
    o, z = (torch.randn(3, 7, 300, generator=gen, dtype=dtype) for _ in range(2))
    zg = torch.randn(3, 7, 600, generator=gen, dtype=dtype) * 4
    skip = torch.tensor(-0.7, dtype=dtype)

    def ref(o, z, zg, skip):
        return [(o + skip * z) * F.silu(zg.chunk(2, dim=-1)[1])]

    def fused(o, z, zg, skip):
        return [gated_skip(o, z, zg.chunk(2, dim=-1)[1], skip)]

    ref_out, ref_grad = _grads(ref, [o, z, zg, skip], 6)
    out, grad = _grads(fused, [o, z, zg, skip], 6)
    for name, a, b in zip(("y", "do", "dz", "dgate", "dskip"), out + grad, ref_out + ref_grad):
        assert_close(name, a, b, TOL[dtype])


def test_layer_fused_matches_torch_chains():
    """The whole layer with the fused kernels (impl="triton") against the same weights on the torch chains
    (impl="naive"; the op's impls agree to 1e-12 in fp64, tests/ops): output and every parameter gradient."""
    torch.manual_seed(7)
    ref = KalmanAttention(24, d_state=4, num_heads=2, impl="naive").double()
    fused = KalmanAttention(24, d_state=4, num_heads=2, impl="triton").double()
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    grads = {}
    for name, layer in (("ref", ref), ("fused", fused)):
        out = layer(x)[0]
        grads[name] = [out.detach()] + list(torch.autograd.grad((out * out).sum(), list(layer.parameters())))
    names = ["out"] + [n for n, _ in ref.named_parameters()]
    for name, a, b in zip(names, grads["fused"], grads["ref"]):
        assert_close(name, a, b, 1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,silu,bias", [(37, True, True), (2, True, False), (70, False, True)])
def test_short_conv(dtype, T, silu, bias):
    """The fused causal conv against ShortConv's torch path from a zero state: y, dx, dw, db. 200 channels span
    two channel blocks; T = 2 is shorter than the kernel, 70 spans three token blocks."""
    from kalmix.layers.common import ShortConv
    from kalmix.layers.fused import short_conv
    torch.manual_seed(8)
    conv = ShortConv(200, 4, bias=bias, activation=silu).to(dtype)
    if bias:
        conv.bias.data.normal_()
    x = torch.randn(3, T, 200, dtype=dtype)
    params = [conv.weight] + ([conv.bias] if bias else [])

    def ref(x, *ps):
        return [torch.func.functional_call(conv, dict(zip(["weight", "bias"], ps)), (x,))[0]]

    def fused(x, w, b=None):
        return [short_conv(x, w, b, silu)]

    ref_out, ref_grad = _grads(ref, [x, *params], 9)
    out, grad = _grads(fused, [x, *params], 9)
    for name, a, b in zip(("y", "dx", "dw", "db"), out + grad, ref_out + ref_grad):
        assert_close(name, a, b, TOL[dtype])


def test_short_conv_state_keeps_the_last_kernel_minus_one_inputs():
    """The decode state is the last K − 1 inputs, zero-padded when T < K − 1, and empty for K = 1 (the torch
    path used to return the whole input there)."""
    from kalmix.layers.common import ShortConv
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    for K, want in ((1, x[:, :0]), (4, x[:, 2:]), (8, torch.cat([x.new_zeros(2, 2, 3), x], 1))):
        conv = ShortConv(3, K).double()
        _, state = conv(x)
        assert torch.equal(state, want.transpose(1, 2)), K
        y2, _ = conv(x[:, 3:], conv(x[:, :3])[1])          # chaining through the state continues exactly
        assert_close(f"K={K} chained", y2, conv(x)[0][:, 3:], 1e-15)


def _rms_torch(x, w, z, eps):
    return [GatedRMSNorm._norm(types.SimpleNamespace(eps=eps), x, w, z)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("D,rows,gate", [(128, 600, True), (5, 37, True), (300, 21, False), (1024, 9, False)])
def test_rms_norm(dtype, D, rows, gate):
    """The gated RMSNorm's kernels against its torch chain (``GatedRMSNorm._norm``): output and the gradients of
    x, the weight and the gate, the gate a strided half of a wider projection as in the layers. 600 rows of 128
    span several row tiles of one backward program and a partial last program; D = 5 and 300 pad the tile; one
    row of x is zero (rstd = eps^-1/2) and one gate reaches ±30."""
    gen = torch.Generator().manual_seed(D)
    x = torch.randn(rows, D, generator=gen, dtype=dtype) * 3
    x[1] = 0
    w = 1 + 0.5 * torch.randn(D, generator=gen, dtype=dtype)
    zw = torch.randn(rows, 2 * D, generator=gen, dtype=dtype) * 4
    zw[2, D:D + 2] = torch.tensor([30.0, -30.0], dtype=dtype)
    eps = 1e-5

    def run(norm):
        def fn(x, w, zw):
            return norm(x.view(rows // 1, 1, D), w, zw[:, D:].view(rows, 1, D) if gate else None, eps)
        return fn

    ref_out, ref_grad = _grads(run(lambda x, w, z, e: _rms_torch(x, w, z, e)), [x, w, zw], 8)
    out, grad = _grads(run(lambda x, w, z, e: [rms_norm(x, w, z, e)]), [x, w, zw], 8)
    for name, a, b in zip(("y", "dx", "dweight", "dgate"), out + grad, ref_out + ref_grad):
        assert_close(name, a, b, TOL[dtype] * (10 if name == "dweight" else 1))


def test_rms_norm_bf16_with_fp32_weight():
    """Under autocast the layers hand bf16 activations and gates with an fp32 weight: the kernels compute in fp32
    and return x's dtype, like the chain, and are no further from the fp64 chain than the chain at these dtypes
    (the output's gradient reaches both rounded to bf16)."""
    gen = torch.Generator().manual_seed(11)
    x, z = (torch.randn(3, 50, 4, 64, generator=gen).bfloat16() for _ in range(2))
    w = torch.rand(64, generator=gen) + 0.5
    ref64 = _grads(lambda x, w, z: _rms_torch(x.double(), w.double(), z.double(), 1e-5), [x, w, z], 9)
    chain = _grads(lambda x, w, z: _rms_torch(x, w, z, 1e-5), [x, w, z], 9)
    out, grad = _grads(lambda x, w, z: [rms_norm(x, w, z, 1e-5)], [x, w, z], 9)
    assert out[0].dtype == torch.bfloat16 and [g.dtype for g in grad] == [torch.bfloat16, torch.float32,
                                                                          torch.bfloat16]
    for name, a, b, r in zip(("y", "dx", "dweight", "dgate"), out + grad, chain[0] + chain[1], ref64[0] + ref64[1]):
        rounding = 2.2 if a.dtype == torch.bfloat16 else 1.1     # the interpreter truncates to bf16 (GPUs round)
        assert rel_err(a, r) <= rounding * rel_err(b, r) + 1e-6, (name, rel_err(a, r), rel_err(b, r))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("eps", [1e-6, 1e-12])
def test_l2_normalize(dtype, eps):
    """``l2_normalize`` against ``F.normalize`` on a head view of a split (rows of two strides), with a zero row
    and a row whose norm is below eps (the clamp's branch, where the gradient is dy / eps)."""
    gen = torch.Generator().manual_seed(12)
    qkv = torch.randn(2, 13, 3 * 4 * 48, generator=gen, dtype=dtype)
    qkv[0, 3, :48] = 0
    qkv[1, 5, 48:96] *= 1e-13

    def run(normalize):
        return lambda qkv: [normalize(qkv[..., :4 * 48].view(2, 13, 4, 48))]

    ref_out, ref_grad = _grads(run(lambda q: F.normalize(q, dim=-1, eps=eps)), [qkv], 13)
    out, grad = _grads(run(lambda q: l2_normalize(q, eps)), [qkv], 13)
    for name, a, b in zip(("y", "dqkv"), out + grad, ref_out + ref_grad):
        assert_close(name, a, b, TOL[dtype])


def test_l2_normalize_bf16_keeps_its_output_not_its_input():
    """In bf16 the backward works from the rounded output and the fp32 norms (what it keeps, as fla's l2norm does):
    the output as close to fp64 as the chain's (the interpreter truncates to bf16, GPUs round), the gradient within
    bf16's rounding; what autograd saved is the output's storage and the [R] norms, not a copy of the input."""
    gen = torch.Generator().manual_seed(14)
    x = (torch.randn(2, 33, 4, 48, generator=gen) * 3).bfloat16()
    ref = _grads(lambda x: [F.normalize(x.double(), dim=-1, eps=1e-6)], [x], 15)
    chain = _grads(lambda x: [F.normalize(x, dim=-1, eps=1e-6)], [x], 15)
    out, grad = _grads(lambda x: [l2_normalize(x, 1e-6)], [x], 15)
    assert rel_err(out[0], ref[0][0]) <= 2.2 * rel_err(chain[0][0], ref[0][0])
    assert rel_err(grad[0], ref[1][0]) <= 1e-2
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = l2_normalize(x.clone().requires_grad_(), 1e-6)
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(torch.bfloat16, (264, 48)), (torch.float32, (264,))]
    assert saved[0].untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
