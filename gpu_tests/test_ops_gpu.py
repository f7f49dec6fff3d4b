"""Every op's impl="triton" on the GPU against its fp64 torch path: outputs, final states and the gradients of
every input (including the initial state), fp32 and bf16, one length that is no multiple of any chunk, and packed
sequences with an empty one. Each comparison prints its error (``-s`` shows them)."""
import pytest
import torch
from triton.runtime.errors import OutOfResources

from kalmix import ops
from kalmix.ops import SPECS
from kalmix.ops.common import delta_triton
from kalmix.ops.common.testing import outputs_and_grads, ptxas_verbose, random_functional_grads, rel_err, run_case
from kalmix.ops.gka import fused as gka_fused
from kalmix.ops.gka.spec import layer_inputs as gka_layer_inputs
from kalmix.ops.kaczmarz import fused as kaczmarz_fused
from kalmix.ops.kalman.spec import realistic_inputs as kalman_realistic_inputs
from kalmix.ops.vla import fused as vla_fused

# fp32 kernels (3xTF32 or fp32 CUDA-core math) against fp64; bf16 activations against fp64 on the same rounded
# inputs, where the kernels' bf16 tensor-core operands and the bf16 outputs cost ~1e-2
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
SIZES = {"kalman": (2, 1000, 2, 16, 96), "gka": (2, 1000, 4, 64, 64), "kaczmarz": (2, 1000, 4, 128, 128),
         "vla": (2, 1000, 4, 64, 64)}


def _check(label, got, ref, tol):
    errs = [rel_err(a.double(), b.double()) for a, b in zip(got, ref)]
    print(f"{label}: " + " ".join(f"{e:.1e}" for e in errs))
    assert len(got) == len(ref)
    for i, (a, e) in enumerate(zip(got, errs)):
        assert torch.isfinite(a).all(), f"{label}: output/grad {i} not finite"
        assert e <= tol, f"{label}: output/grad {i} relative RMS error {e:.2e} > {tol:.0e}"


def _case_inputs(name, dev, dtype, varlen, sizes=None):
    B, T, H, K, V = SIZES[name] if sizes is None else sizes
    gen = torch.Generator().manual_seed(T + varlen)
    n_seq = 4 if varlen else B
    args = SPECS[name].inputs(1 if varlen else B, T, H, K, V, torch.float64, gen)
    state = SPECS[name].random_state(n_seq, H, K, V, torch.float64, gen)
    # the activations in the tested dtype, the reference on exactly those values; gates/dynamics stay fp32
    n_act = 4 if name in ("kalman", "vla") else 3
    args = [(a.to(dtype) if i < n_act else a.float()).double().to(dev) for i, a in enumerate(args)]
    state = tuple(s.to(dev) for s in state) if isinstance(state, tuple) else state.to(dev)
    cu = torch.tensor([0, T // 3, T // 3 + 1, T // 3 + 1, T], device=dev) if varlen else None
    low = [(a.to(dtype) if i < n_act else a.float()) for i, a in enumerate(args)]
    low_state = tuple(s.float() for s in state) if isinstance(state, tuple) else state.float()
    return args, state, low, low_state, cu


def _op_cases():
    """Every Triton op in fp32 and bf16, plain and packed; the quick group takes one case per op (bf16, packed: the
    training regime, with the documents' kernels)."""
    for name in (n for n, spec in SPECS.items() if "triton" in spec.impls):
        for dtype in (torch.float32, torch.bfloat16):
            for varlen in (False, True):
                quick = dtype == torch.bfloat16 and varlen
                yield pytest.param(name, dtype, varlen, marks=[pytest.mark.quick] if quick else [],
                                   id=f"{name}-{str(dtype)[6:]}-{'packed' if varlen else 'plain'}")


@pytest.mark.parametrize("name,dtype,varlen", list(_op_cases()))
def test_op_triton_against_fp64(name, dtype, varlen, dev):
    args, state, low, low_state, cu = _case_inputs(name, dev, dtype, varlen)
    ref_out, ref_grad = outputs_and_grads(SPECS[name], args, state, "torch", cu_seqlens=cu)
    out, grad = outputs_and_grads(SPECS[name], low, low_state, "triton", cu_seqlens=cu)
    _check(f"{name} {str(dtype)[6:]} varlen={varlen}", out + grad, ref_out + ref_grad, TOL[dtype])


@pytest.mark.parametrize("head", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["kaczmarz", "vla"])
def test_delta_kernels_small_heads(name, dtype, head, dev):
    """K = V = 16 or 32, T below one chunk and across two. With 16-wide tiles the kernels made illegal memory
    accesses at 8 warps and returned garbage in bf16; small heads now run at most 4 warps and 16-bit tiles are
    at least 32 wide."""
    for T in (40, 130):
        args, state, low, low_state, _ = _case_inputs(name, dev, dtype, False, sizes=(2, T, 2, head, head))
        ref_out, ref_grad = outputs_and_grads(SPECS[name], args, state, "torch")
        out, grad = outputs_and_grads(SPECS[name], low, low_state, "triton")
        _check(f"{name} {str(dtype)[6:]} K=V={head} T={T}", out + grad, ref_out + ref_grad, TOL[dtype])


@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("name", ["kaczmarz", "vla"])
def test_delta_kernels_at_both_launches(name, narrow, dev, monkeypatch):
    """The states and dstates kernels at both of their 16-bit launches (CONFIGS' usual V block and the "narrow"
    one the op picks when few (sequence, head) programs would leave multiprocessors idle; at these sizes it
    picks narrow), bf16 against fp64."""
    monkeypatch.setattr(delta_triton, "_narrow", lambda *a: narrow)
    args, state, low, low_state, _ = _case_inputs(name, dev, torch.bfloat16, False)
    ref_out, ref_grad = outputs_and_grads(SPECS[name], args, state, "torch")
    out, grad = outputs_and_grads(SPECS[name], low, low_state, "triton")
    _check(f"{name} bf16 narrow={narrow}", out + grad, ref_out + ref_grad, TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["kaczmarz", "gka", "vla"])
def test_ops_run_at_their_largest_head_size(name, dtype, dev, monkeypatch):
    """At the largest K the op takes for the dtype (``max_head_sizes``, kalmix's engine for Kaczmarz) every kernel
    fits the GPU and the op matches its fp64 torch path, forward and backward."""
    monkeypatch.setattr(kaczmarz_fused, "engine", lambda device, dtype: "kalmix")
    module = {"kaczmarz": kaczmarz_fused, "gka": gka_fused, "vla": vla_fused}[name]
    K = module.max_head_sizes(dtype, dev)["K"][0]
    args, state, low, low_state, _ = _case_inputs(name, dev, dtype, False, sizes=(1, 130, 2, K, 64))
    if dtype == torch.float64:
        low, low_state = args, state
    ref_out, ref_grad = outputs_and_grads(SPECS[name], args, state, "torch")
    out, grad = outputs_and_grads(SPECS[name], low, low_state, "triton")
    _check(f"{name} {str(dtype)[6:]} K={K}", out + grad, ref_out + ref_grad, TOL.get(dtype, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_delta_kernels_run_out_of_shared_memory_above_their_limit(dtype, dev):
    """The limit is the largest that fits: at twice MAX_K (the next tile width) a kernel of the chunked delta rule
    asks for more shared memory than the GPU gives a block."""
    K = 2 * delta_triton.MAX_K[dtype]
    gen = torch.Generator().manual_seed(0)
    q, w, v = (torch.randn(1, 130, 2, d, generator=gen).to(dev, dtype).requires_grad_() for d in (K, K, 64))
    g = torch.zeros(1, 130, 2, device=dev, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    with pytest.raises(OutOfResources, match="shared memory"):
        o, _ = delta_triton.chunk_delta_rule_triton(q, w, w, v, g, g + 0.5, scale=K ** -0.5, state=None)
        o.float().sum().backward()


def test_kaczmarz_fla_engine_forward(dev):
    """fla's chunk_gated_delta_rule engine (forward only where fla refuses its backward) on the same check."""
    args, state, low, low_state, cu = _case_inputs("kaczmarz", dev, torch.float32, False)
    with torch.no_grad():
        ref = run_case(SPECS["kaczmarz"], args, state, "torch")
        saved = kaczmarz_fused.engine
        kaczmarz_fused.engine = lambda device, dtype: "fla"
        try:
            got = run_case(SPECS["kaczmarz"], low, low_state, "triton")
        finally:
            kaczmarz_fused.engine = saved
    _check("kaczmarz fla engine fp32 forward", got, ref, 1e-3)   # fla computes with bf16/tf32 operands


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eng", ["kalmix", "fla"])
def test_kaczmarz_key_norms_spread_over_two_decades(eng, dtype, dev):
    """The kernels run the delta rule on the raw keys with β = η/(‖k‖² + eps): key norms spread over 0.1..10
    inside every chunk. kalmix's engine forward and backward; fla's forward (its gated backward may be
    refused here)."""
    B, T, H, K, V = SIZES["kaczmarz"]
    gen = torch.Generator().manual_seed(11)
    args = SPECS["kaczmarz"].inputs(B, T, H, K, V, torch.float64, gen)
    args[1] = args[1] / args[1].norm(dim=-1, keepdim=True) * 10 ** (2 * torch.rand(B, T, H, 1, generator=gen,
                                                                                    dtype=torch.float64) - 1)
    state = SPECS["kaczmarz"].random_state(B, H, K, V, torch.float64, gen).to(dev)
    args = [(a.to(dtype) if i < 3 else a.float()).double().to(dev) for i, a in enumerate(args)]
    low = [(a.to(dtype) if i < 3 else a.float()) for i, a in enumerate(args)]
    saved = kaczmarz_fused.engine
    kaczmarz_fused.engine = lambda device, dtype: eng
    try:
        if eng == "kalmix":
            ref_out, ref_grad = outputs_and_grads(SPECS["kaczmarz"], args, state, "torch")
            out, grad = outputs_and_grads(SPECS["kaczmarz"], low, state.float(), "triton")
            got, ref = out + grad, ref_out + ref_grad
        else:
            with torch.no_grad():
                ref = run_case(SPECS["kaczmarz"], args, state, "torch")
                got = run_case(SPECS["kaczmarz"], low, state.float(), "triton")
    finally:
        kaczmarz_fused.engine = saved
    # fla multiplies fp32 inputs in TF32 (10-bit mantissa): 1.45e-3 on o here (H200)
    _check(f"kaczmarz spread key norms {eng} {str(dtype)[6:]}", got, ref,
           TOL[dtype] if eng == "kalmix" or dtype == torch.bfloat16 else 3e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kalman_realistic_regime(dtype, dev):
    """Decay 0.9..0.999, process noise 1e-7..1e-6, value precision to 1e4 (λ reaches ~1e6)."""
    base = [x.to(dev) for x in kalman_realistic_inputs(1000, torch.float64, seed=1, B=2, H=2, N=16, D=96)]
    base = [(x.to(dtype) if i < 4 else x.float()).double() for i, x in enumerate(base)]

    def run(xs, impl):
        xs = [x.detach().requires_grad_() for x in xs]
        o, var, (lam, mu) = ops.kalman_attention(*xs, output_final_state=True, output_variance=True, impl=impl)
        return [o, var, lam, mu] + random_functional_grads([o, var, mu], xs)

    ref = run(base, "torch")
    got = run([(x.to(dtype) if i < 4 else x.float()) for i, x in enumerate(base)], "triton")
    _check(f"kalman realistic {str(dtype)[6:]}", got, ref, TOL[dtype])


def test_kalman_65536_tokens(dev):
    x = [t.to(dev) for t in kalman_realistic_inputs(65536, torch.float32, seed=3, B=1, H=1, N=16, D=64)]
    with torch.no_grad():
        a = ops.kalman_attention(*x, output_final_state=True, output_variance=True, impl="triton")
        b = ops.kalman_attention(*x, output_final_state=True, output_variance=True, impl="torch")
    _check("kalman T=65536 fp32 vs torch fp32", [a[0], a[1], *a[2]], [b[0], b[1], *b[2]], 2e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_vla_16384_tokens_in_parts(packed, dev):
    """One sequence of 16384 tokens and two heads: the A path's forward runs 32 parts of 512 tokens, each from its
    start formed from fp64 Gram sums, and the backward's carry runs in parts; fp32 against fp64, every gradient.
    Packed, the same tokens as sequences of 5461, 1, 0 and 10922 tokens: the longest in 16 parts, the first in 8
    (its parts as long), each part's start from its own sequence's sums. The initial A's gradient (carried back over
    all 16384 tokens, the same with or without parts) shrinks with T while fp32's rounding in the carry does not:
    9e-4 here, 2e-4 at T = 8192, 6e-6 at T = 1000."""
    args, state, low, low_state, cu = _case_inputs("vla", dev, torch.float32, packed, sizes=(1, 16384, 2, 64, 64))
    ref_out, ref_grad = outputs_and_grads(SPECS["vla"], args, state, "torch", cu_seqlens=cu)
    out, grad = outputs_and_grads(SPECS["vla"], low, low_state, "triton", cu_seqlens=cu)
    got, ref = out + grad, ref_out + ref_grad
    _check(f"vla fp32 T=16384 packed={packed}", got[:9] + got[10:], ref[:9] + ref[10:], TOL[torch.float32])
    _check(f"vla fp32 T=16384 packed={packed} dA0", got[9:10], ref[9:10], 3e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gka_layer_regime_against_exact_solve(dtype, dev):
    """ridge 0.02, 30 steps: the forward against fp64 with the same 30 steps, the implicit gradients against
    the fp64 exact solve's (their difference is the 30-step Chebyshev error, ~4e-4)."""
    args, state = gka_layer_inputs(2, 1000, 4, 128, 128, seed=0)
    args, state = [x.to(dev) for x in args], [s.to(dev) for s in state]

    def run(dt, impl, iters):
        xs = [(x.to(dt) if i < 3 or i >= 6 or dt == torch.float64 else x.float()).detach().requires_grad_()
              for i, x in enumerate([*args, *state])]
        o, (Hs, Us) = ops.gated_kalmanet(*xs[:6], initial_state=tuple(xs[6:]), output_final_state=True,
                                         num_iters=iters, impl=impl)
        return [o, Hs, Us] + random_functional_grads([o, Hs, Us], xs)

    got = run(dtype, "triton", 30)
    _check(f"gka forward {str(dtype)[6:]} vs fp64 30 steps", got[:3], run(torch.float64, "torch", 30)[:3],
           TOL[dtype])
    _check(f"gka grads {str(dtype)[6:]} vs fp64 exact solve", got[3:], run(torch.float64, "torch", None)[3:],
           1e-3 if dtype == torch.float32 else TOL[dtype])


def test_gka_bf16_32k_tokens_finite(dev):
    args, state = gka_layer_inputs(1, 32768, 8, 128, 128, seed=2, dtype=torch.bfloat16)
    xs = [x.to(dev).requires_grad_() for x in args]
    o, (Hs, Us) = ops.gated_kalmanet(*xs, output_final_state=True, impl="triton")
    (o.float().square().mean() + Hs.square().mean() + Us.square().mean()).backward()
    for name, t in zip(["o", "H", "U", "dq", "dk", "dv", "dg", "dbeta", "dalpha"], [o, Hs, Us, *(x.grad for x in xs)]):
        assert torch.isfinite(t).all(), name


def _compiled(kernel_fn):
    """Every compiled variant of the Triton kernel ``kernel_fn`` that this process launched, on any device."""
    return [kernel for caches in kernel_fn.device_caches.values() for kernel in caches[0].values()]


def test_gka_kernels_get_the_carveout_that_keeps_their_occupancy(dev):
    """Every GKA kernel the op launched carries the shared-memory carveout of ``carveout_percent`` (the rest of
    the multiprocessor's memory is L1 for its spills), read back from the driver."""
    import ctypes
    from kalmix.ops.common import carveout
    args, _ = gka_layer_inputs(1, 300, 2, 128, 128, seed=5, dtype=torch.bfloat16)
    xs = [x.to(dev).requires_grad_() for x in args]
    ops.gated_kalmanet(*xs, impl="triton")[0].float().sum().backward()
    sizes = carveout.SIZES_KB[torch.cuda.get_device_capability(dev)]
    names = [n for n in dir(gka_fused) if n.endswith("_kernel")]
    checked = 0
    for name in names:
        for kernel in _compiled(getattr(gka_fused, name)):
            if kernel.function is None:
                continue
            value = ctypes.c_int(-2)
            assert carveout._driver().cuFuncGetAttribute(ctypes.byref(value), carveout._CARVEOUT,
                                                          ctypes.c_void_p(kernel.function)) == 0
            want = carveout.carveout_percent(kernel.n_regs, kernel.metadata.num_warps, kernel.metadata.shared, sizes)
            assert value.value == want, (name, value.value, want)
            checked += 1
    assert checked >= len(names), (checked, names)


def test_gka_solves_keep_their_tensor_core_pipeline(dev):
    """ptxas does not serialise the tensor-core instructions of the two Chebyshev solves (its C7515 / C7512
    warning), at K = 64 and 128 and every variant the process compiled: serialised, the adjoint solve took 1.94 ms
    instead of 1.07 at B = 16, T = 2048 on an H100."""
    major, minor = torch.cuda.get_device_capability(dev)
    if major != 9:
        pytest.skip("wgmma (what ptxas serialises) is Hopper's")
    for K in (64, 128):
        args, _ = gka_layer_inputs(1, 256, 8, K, K, seed=6, dtype=torch.bfloat16)
        xs = [x.to(dev).requires_grad_() for x in args]
        ops.gated_kalmanet(*xs, impl="triton")[0].float().sum().backward()
    checked = 0
    for name in ("_fwd_kernel", "_solve_bwd_kernel"):
        for kernel in _compiled(getattr(gka_fused, name)):
            out = ptxas_verbose(kernel.asm["ptx"], f"sm_{major}{minor}a")
            assert out.returncode == 0, out.stderr
            assert "serialized" not in out.stderr + out.stdout, (name, out.stderr)
            checked += 1
    assert checked >= 4, checked


@pytest.mark.quick
def test_value_errors_on_cuda(dev):
    """On CUDA the value checks are read back after the op's kernels are queued; they still raise before the op
    returns, with the same messages as on CPU."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, w, a, p = (x.to(dev) for x in SPECS["kalman"].inputs(2, 40, 2, 4, 8, torch.float32, gen))
    with pytest.raises(ValueError, match=r"`v_precision` contains NaN"):
        ops.kalman_attention(q, k, v, w.clone().index_fill_(1, torch.tensor([3], device=dev), float("nan")), a, p)
    with pytest.raises(ValueError, match=r"`decay` must lie in \(0.0, 1.0\]"):
        ops.kalman_attention(q, k, v, w, a + 1.0, p)
    q, k, v, g, eta = (x.to(dev) for x in SPECS["kaczmarz"].inputs(2, 40, 2, 16, 16, torch.float32, gen))
    with pytest.raises(ValueError, match=r"`g` must lie in"):
        ops.kaczmarz_attention(q, k, v, -g + 0.1, eta)
    # Kaczmarz checks in its step kernel, with either engine (fla's without gradients, kalmix's with them here)
    nan_eta = eta.clone().index_fill_(1, torch.tensor([39], device=dev), float("nan"))
    for grad in (False, True):
        leaves = [x.detach().requires_grad_(grad) for x in (q, k, v)]
        with pytest.raises(ValueError, match=r"`eta` contains NaN"):
            ops.kaczmarz_attention(*leaves, g, nan_eta)
        with pytest.raises(ValueError, match=r"`eta` must lie in \(0.0, 1.0\]"):
            ops.kaczmarz_attention(*leaves, g, eta + 1.0)
        assert torch.isfinite(ops.kaczmarz_attention(*leaves, g, eta)[0]).all()
    q, k, v, g, beta, alpha = (x.to(dev) for x in SPECS["gka"].inputs(2, 40, 2, 16, 16, torch.float32, gen))
    with pytest.raises(ValueError, match=r"`beta` must lie in \[0.0, inf\)"):
        ops.gated_kalmanet(q, k, v, g, -beta, alpha)
    assert torch.isfinite(ops.gated_kalmanet(q, k, v, g, beta, alpha)[0]).all()     # and valid input passes
