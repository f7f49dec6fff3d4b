"""What the layers save for the backward: ``recompute`` keeps a function's inputs instead of its intermediates, and
the gated RMSNorm and the SwiGLU MLP that use it give the outputs and gradients of their plain composites bit for
bit while saving less; so do VLA and the Kalman layer with contiguous copies of the views they kept before."""
import pytest
import torch
import torch.nn.functional as F

from kalmix.bench.memory import saved_tensors
from kalmix.layers import KalmanAttention, VariationalLinearAttention
from kalmix.layers.common import GatedRMSNorm, fused_kernels, recompute, upcast
from kalmix.models.modeling import SwiGLU


def plain_gated_norm(norm: GatedRMSNorm, x, z=None):
    """The gated RMSNorm as a chain of autograd ops (what it ran before ``recompute``)."""
    xf = upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps) * upcast(norm.weight)
    return (y if z is None else y * F.silu(upcast(z))).to(x.dtype)


def plain_swiglu(mlp: SwiGLU, x):
    gate, up = mlp.gate_up(x).chunk(2, dim=-1)
    return mlp.down(F.silu(gate) * up)


def grads(out, leaves, seed=0):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(out.dtype)
    return torch.autograd.grad(out, leaves, g)


def assert_same(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


PRECISIONS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "autocast": (torch.float32,
                                                                                          torch.bfloat16)}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("gated", [True, False])
def test_gated_rmsnorm_equals_its_plain_chain_bit_for_bit_and_saves_only_its_inputs(precision, gated):
    dtype, autocast = PRECISIONS[precision]
    torch.manual_seed(0)
    norm = GatedRMSNorm(64).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 37, 3, 64, dtype=dtype if autocast is None else torch.bfloat16, requires_grad=True)
    wide = torch.randn(2, 37, 3 * 64 + 7, dtype=x.dtype, requires_grad=True)   # z: a view of a wider projection
    z = wide[..., 5:5 + 3 * 64].view(2, 37, 3, 64) if gated else None
    leaves = [x, norm.weight] + ([wide] if gated else [])
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast is not None):
        got, want = norm(x, z), plain_gated_norm(norm, x, z)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert_same(grads(got, leaves), grads(want, leaves))
    rows = saved_tensors(norm, lambda: norm(x, z))
    saved = sum(r["bytes"] for r in rows)
    assert saved == x.numel() * x.element_size() * (2 if gated else 1)     # x and z's own copy; the weight is free
    before = sum(r["bytes"] for r in saved_tensors(norm, lambda: plain_gated_norm(norm, x, z)))
    assert saved < before / 2


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_swiglu_equals_its_plain_chain_bit_for_bit_and_saves_no_silu_output(precision):
    dtype, autocast = PRECISIONS[precision]
    torch.manual_seed(1)
    mlp = SwiGLU(32, 96).to(dtype)
    x = torch.randn(3, 11, 32, dtype=dtype, requires_grad=True)
    leaves = [x, *mlp.parameters()]
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast is not None):
        got, want = mlp(x), plain_swiglu(mlp, x)
        saved = sum(r["bytes"] for r in saved_tensors(mlp, lambda: mlp(x)))
        before = sum(r["bytes"] for r in saved_tensors(mlp, lambda: plain_swiglu(mlp, x)))
    assert torch.equal(got, want)
    assert_same(grads(got, leaves), grads(want, leaves))
    act = 2 if autocast is not None or dtype == torch.bfloat16 else 4
    assert before - saved == 3 * 11 * 96 * act                  # silu(gate) [B, T, hidden]


def test_recompute_gives_the_functions_gradients_and_refuses_nothing_plain_autograd_takes():
    w = torch.randn(5, requires_grad=True)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    c = torch.randn(4, 5)                                       # no gradient wanted
    fn = lambda x, w, c: (x.exp() * w.double() + c).sin()       # noqa: E731
    out = recompute(fn, x, w, c)
    assert_same(grads(out, [x, w]), grads(fn(x, w, c), [x, w]))
    (recompute(fn, x, w, c) * 2).sum().backward()               # .backward() as well as autograd.grad
    assert x.grad is not None and w.grad is not None
    with torch.no_grad():
        assert not recompute(fn, x, w, c).requires_grad
    unused = torch.randn(3, requires_grad=True)                 # an input fn does not use gets no gradient
    gx, gu = torch.autograd.grad(recompute(lambda x, u: x.exp(), x, unused).sum(), [x, unused], allow_unused=True)
    assert gu is None and torch.equal(gx, x.exp())


class ViewsVLA(VariationalLinearAttention):
    """The VLA layer as it split its convolved q, k, v before: views of one [B, T, 3·H·K] tensor."""

    def project(self, qkv, conv_state, docs=None):
        B, T, _ = qkv.shape
        qkv, conv_state = self.conv(qkv, conv_state, docs)
        q, k, v = qkv.view(B, T, 3, self.num_heads, self.head_dim).unbind(2)
        return [q, k, v, self.u_proj(k.flatten(2)).view_as(k)], None, conv_state


def run_equal(classes, kwargs, x, autocast):
    """Each class built from the same seed with ``kwargs`` and run on x (bf16 autocast when ``autocast``): asserts
    their outputs and gradients equal bit for bit; -> (the layers, the bytes each saved for the backward)."""
    layers, outs, saved, gs = [], [], [], []
    for cls in classes:
        torch.manual_seed(0)
        layers.append(cls(**kwargs))
    for layer in layers:
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            outs.append(layer(x)[0])
            saved.append(sum(r["bytes"] for r in saved_tensors(layer, lambda: layer(x)[0])))
        gs.append(grads(outs[-1], [x, *layer.parameters()]))
    assert torch.equal(outs[0], outs[1])
    assert_same(*gs)
    return layers, saved


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("autocast", [False, True])
def test_vla_u_proj_saves_a_copy_of_k_not_the_whole_convolution_output(autocast, impl):
    """u_proj takes a contiguous copy of the convolved k: the view it took (one row: B = 1, where the view folds into
    a matrix without a copy) kept the whole convolution output [B, T, 3·H·K] for the backward. Under autocast (how
    models train) that saves two of q, k, v in both impls; output and gradients are the same bit for bit."""
    layers, saved = run_equal([VariationalLinearAttention, ViewsVLA], dict(d_model=64, num_heads=2, impl=impl),
                              torch.randn(1, 40, 64, requires_grad=True), autocast)
    width = 40 * 64 * (2 if autocast else 4)                         # the bytes of one of q, k, v
    # fp32 on the torch path: its op keeps views of the convolution output itself, so the copy costs one more
    assert saved[1] - saved[0] == (-1 if impl == "torch" and not autocast else 2) * width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vla_triton_copies_views_once(dtype):
    """The Triton path makes q, k, v, u contiguous once (its prologue, delta rule and readout each copied the views
    they were given): on views of one [B, T, 4, H, K] tensor it saves what it saves on contiguous copies of them
    (the copies), with the same output and gradients bit for bit."""
    from kalmix.ops import variational_linear_attention
    g = torch.Generator().manual_seed(3)
    qkvu = torch.randn(2, 40, 4, 2, 32, generator=g).to(dtype).requires_grad_()
    views = qkvu.unbind(2)
    copies = [x.detach().contiguous().requires_grad_() for x in views]

    def run(*xs):
        return variational_linear_attention(*xs, lambda0=3.2, write_key="feature", impl="triton")[0]

    outs = [run(*views), run(*copies)]
    assert torch.equal(outs[0], outs[1])
    assert_same(grads(outs[0], [qkvu])[0].unbind(2), grads(outs[1], copies))
    root = torch.nn.Module()
    on_views, on_copies = (sum(r["bytes"] for r in saved_tensors(root, lambda: run(*xs))) for xs in (views, copies))
    assert on_views == on_copies


class ViewsKalman(KalmanAttention):
    """The Kalman layer as it kept its gate before: a view of the input projection's [B, T, 2·d_inner] output."""

    def project(self, h, conv_state, docs=None):
        B, T, _ = h.shape
        H, N, D = self.num_heads, self.d_state, self.head_dim
        z, gate = h.chunk(2, dim=-1)
        z, conv_state = self.conv(z, conv_state, docs)
        if self.fused(h.device):
            v, w, k, q = fused_kernels().sensor_split(self.sensor_proj(z), H, N)
            return [q, k, v.view(B, T, H, D), w.view(B, T, H, D)], (z, gate), conv_state
        v, s, k, q = self.sensor_proj(z).split([self.d_inner, self.d_inner, H * N, H * N], dim=-1)
        k, q = F.normalize(k.view(B, T, H, N), dim=-1), F.normalize(q.view(B, T, H, N), dim=-1)
        w = 1.0 / (F.softplus(upcast(s)) + 1e-4)
        return [q, k, v.view(B, T, H, D), w.view(B, T, H, D).to(v.dtype)], (z, gate), conv_state


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("autocast", [False, True])
def test_kalman_saves_a_contiguous_gate_not_the_whole_input_projection(autocast, impl):
    """The Kalman layer's readout keeps a contiguous gate: the view it kept held the whole input projection
    [B, T, 2·d_inner], z's half included, which the convolution has consumed. Output and gradients are the same bit
    for bit, in both impls (the torch chain and the fused kernels)."""
    layers, saved = run_equal([KalmanAttention, ViewsKalman], dict(d_model=32, d_state=4, num_heads=1, impl=impl),
                              torch.randn(1, 16, 32, requires_grad=True), autocast)
    assert saved[1] - saved[0] == 16 * layers[0].d_inner * (2 if autocast else 4)     # the gate's size
