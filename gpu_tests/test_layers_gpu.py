"""The layers on the GPU: the fused elementwise kernels against the torch chains they replace, every layer's
training step finite in bf16, and prefill-then-decode equal to one full forward."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kalmix.layers import MIXERS, KalmanAttention
from kalmix.layers.common import GatedRMSNorm, ShortConv, l2_normalize
from kalmix.models.modeling import RMSNorm
from kalmix.ops.common.testing import rel_err


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("T,C", [(37, 96), (2, 96), (2048, 1024)])
def test_short_conv_fused_against_torch_path(T, C, dtype, tol, dev):
    conv = ShortConv(C, 4, bias=True).to(dev, dtype)
    x = torch.randn(2, T, C, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(2, T, C, device=dev, dtype=dtype)
    res = []
    for state in (None, torch.zeros(2, C, 3, device=dev, dtype=dtype)):       # fused (no state) / torch
        y, st = conv(x, state)
        res.append([y, st, *torch.autograd.grad(y, (x, conv.weight, conv.bias), dy)])
    errs = [rel_err(a, b) for a, b in zip(*res)]
    print(f"short conv {str(dtype)[6:]} T={T} C={C}: y, state, dx, dw, db", " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) <= tol


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,D,gate", [(4 * 16384 * 8, 128, True), (4 * 16384, 1024, False), (999, 48, True)])
def test_norm_kernels_against_torch_chains(rows, D, gate, dtype, dev):
    """GatedRMSNorm's and l2_normalize's kernels (CUDA) against their torch chains (CPU path: GatedRMSNorm._norm,
    F.normalize) run in fp64 on the same inputs: output and every gradient, the gate a strided split; fp32 within
    1e-5, bf16 no further than the chain at bf16 (+ 5e-5: the H100 run measured 2.0e-5 against the chain's 1.4e-5
    for the gate's gradient, both far below bf16's 1.7e-3 rounding of the output)."""
    torch.manual_seed(0)
    norm = GatedRMSNorm(D).to(dev)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(rows, D, device=dev, dtype=dtype, requires_grad=True)
    zw = torch.randn(rows, 2 * D, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, D, device=dev, dtype=dtype)
    z = zw[:, D:] if gate else None
    leaves = (x, norm.weight) + ((zw,) if gate else ())
    runs = {}
    for name, fn in (("fused", lambda: norm(x, z)),
                     ("chain", lambda: norm._norm(x, norm.weight, z)),
                     ("fp64", lambda: norm._norm(x.double(), norm.weight.double(), None if z is None else z.double()))):
        y = fn()
        runs[name] = [y, *torch.autograd.grad(y, leaves, dy.to(y.dtype))]
    errs = {n: (rel_err(a, r), rel_err(b, r)) for n, a, b, r in zip(("y", "dx", "dw", "dzw"), *runs.values())}
    print(f"rms norm {str(dtype)[6:]} rows={rows} D={D} gate={gate}: fused / chain vs fp64",
          " ".join(f"{n} {a:.1e}/{b:.1e}" for n, (a, b) in errs.items()))
    for a, b in errs.values():      # bf16: a few elements round the other way from fp32 values a few ulp apart
        assert a <= (1e-5 if dtype == torch.float32 else 1.1 * b + 5e-5)
    if not gate:                        # the models' block norm: nn.RMSNorm's module on the same kernel
        block, plain = RMSNorm(D, eps=1e-5).to(dev), nn.RMSNorm(D, eps=1e-5).to(dev)
        block.weight.data.copy_(norm.weight.data)
        plain.load_state_dict(block.state_dict())
        ys = [m(x) for m in (block, plain)]
        assert ys[0].dtype == ys[1].dtype and rel_err(*ys) <= (1e-6 if dtype == torch.float32 else 1e-2)
    q = torch.randn(rows, D, device=dev, dtype=dtype, requires_grad=True)
    res = []
    for fn in (lambda: l2_normalize(q, 1e-6), lambda: F.normalize(q.double(), dim=-1, eps=1e-6)):
        y = fn()
        res.append([y, *torch.autograd.grad(y, q, dy.to(y.dtype))])
    errs = [rel_err(a, b) for a, b in zip(*res)]
    print(f"l2 normalize {str(dtype)[6:]}: y, dq vs fp64", " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-5), (torch.bfloat16, 2e-2)])
def test_kalman_layer_fused_against_torch_chains(dtype, tol, dev):
    torch.manual_seed(0)
    layer = KalmanAttention(512).to(dev, dtype)
    x = torch.randn(2, 1000, 512, device=dev, dtype=dtype)
    res = []
    for fused in (True, False):
        layer.fused = lambda device, fused=fused: fused
        out = layer(x)[0]
        res.append([out, *torch.autograd.grad(out.float().square().sum(), list(layer.parameters()))])
    del layer.fused
    errs = {n: rel_err(a, b) for n, a, b in zip(["out"] + [n for n, _ in layer.named_parameters()], *res)}
    print(f"kalman layer fused vs torch chains {str(dtype)[6:]}:", " ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    assert max(errs.values()) <= tol, errs


@pytest.mark.quick
@pytest.mark.parametrize("name", list(MIXERS))
def test_layer_training_step_and_decode(name, dev):
    """bf16 training step finite; fp32 prefill of 40 tokens then 3 decoded tokens equal to the 43-token forward."""
    from kalmix.bench.speed import layer_kwargs
    torch.manual_seed(0)
    kw = layer_kwargs(name, 4, 64, 16)
    layer = MIXERS[name](256, **kw).to(dev)
    x = torch.randn(2, 43, 256, device=dev)
    full = layer(x)[0]
    out, _, cache = layer(x[:, :40], use_cache=True)
    steps = [out]
    for t in range(40, 43):
        y, _, cache = layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)
        steps.append(y)
    err = rel_err(torch.cat(steps, 1), full)
    layer = layer.to(torch.bfloat16)
    xb = x.to(torch.bfloat16).requires_grad_()
    layer(xb)[0].float().square().mean().backward()
    finite = all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
    print(f"layer {name}: decode vs full forward {err:.1e}; bf16 grads finite {finite}")
    assert err <= 1e-4 and finite and torch.isfinite(xb.grad).all()


def test_speed_fp32_ceiling_is_below_the_cuda_cores_peak(dev):
    """The fp32 FMA rate `kalmix speed` measures is finite and below 128 FMAs per multiprocessor and cycle at 2.2
    GHz (above any Hopper clock): a rate above it would mean the compiler dropped FMAs from the chains."""
    from kalmix.bench.speed import ceilings
    rate = ceilings(dev, 5, 20)["fp32_TFLOPs"]
    peak = torch.cuda.get_device_properties(dev).multi_processor_count * 128 * 2 * 2.2e9 / 1e12
    assert 0.3 * peak < rate < peak, (rate, peak)


def _attention_reference(layer, x, **kwargs):
    """The layer's output and input/weight gradients with flash turned off (SDPA with a mask, fp32 weights and
    input): the reference the flash paths are compared with."""
    import kalmix.layers.attention as attention
    ref = attention.flash_eligible
    try:
        attention.flash_eligible = lambda q: False
        x32 = x.detach().float().requires_grad_()
        layer32 = layer.float()
        y = layer32(x32, **kwargs)[0]
        grads = torch.autograd.grad(y.square().sum(), [x32, *layer32.parameters()])
        return [y, *grads]
    finally:
        attention.flash_eligible = ref


@pytest.mark.quick
@pytest.mark.parametrize("B,T", [(2, 1000), (1, 4096)])
def test_attention_documents_flash_against_masked_sdpa(B, T, dev):
    """Packed documents through the varlen flash kernel (bf16) against the block-diagonal masked SDPA in fp32."""
    import kalmix.layers.attention as attention
    from kalmix.layers import SoftmaxAttention
    torch.manual_seed(0)
    layer = SoftmaxAttention(512, num_heads=4).to(dev)
    x = torch.randn(B, T, 512, device=dev)
    lens = torch.randint(1, T // 3, (64,)).cumsum(0)
    bounds = sorted(set([0] + [int(b) for b in lens if b < T * B] + list(range(0, B * T, T)) + [B * T]))
    cu = torch.tensor(bounds, device=dev, dtype=torch.int32)
    xb = x.to(torch.bfloat16).requires_grad_()
    lb = layer.to(torch.bfloat16)
    q = torch.zeros(1, 1, 1, 128, device=dev, dtype=torch.bfloat16)
    assert attention.flash_eligible(q)
    y = lb(xb, cu_seqlens=cu)[0]
    got = [y, *torch.autograd.grad(y.float().square().sum(), [xb, *lb.parameters()])]
    ref = _attention_reference(layer, x, cu_seqlens=cu)
    errs = [rel_err(a.float(), b) for a, b in zip(got, ref)]
    print(f"attention documents flash B={B} T={T} ({len(bounds) - 1} docs): out, dx, dW", " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) <= 2e-2


def test_attention_chunked_prefill_flash_against_full_forward(dev):
    """A cached prefill in two chunks (the second through the varlen flash kernel, its queries the last of the
    context's keys) against one causal forward, bf16."""
    from kalmix.layers import SoftmaxAttention
    torch.manual_seed(0)
    layer = SoftmaxAttention(512, num_heads=4).to(dev, torch.bfloat16)
    x = torch.randn(2, 900, 512, device=dev, dtype=torch.bfloat16)
    full = layer(x)[0]
    a, _, cache = layer(x[:, :300], use_cache=True)
    b, _, cache = layer(x[:, 300:], past_key_values=cache, use_cache=True)
    err = rel_err(torch.cat([a, b], 1).float(), full.float())
    print(f"attention chunked prefill flash: {err:.1e}")
    assert err <= 1e-2
