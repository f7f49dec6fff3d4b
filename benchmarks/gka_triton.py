"""Gated KalmaNet's triton impl on a GPU: the op against the fp64 torch impl and the exact solve, the Chebyshev
residual after 30 steps in fp32 and bf16, bf16 at T = 32K (finite), a 131,072-token prefill, then timings over
num_iters next to fla's chunk_delta_rule and SDPA on the same tokens, with a per-kernel profile. From the
repository root:

    python benchmarks/gka_triton.py [--configs KEY=VALUE,... ...]

(keys: C, BV and the kernels' warps, of fused.CONFIGS[16])
"""
import torch
from triton.testing import do_bench

from _gpu_script import run, time_anchors
from kalmix import ops
from kalmix.ops.common.testing import random_functional_grads, rel_err
from kalmix.ops.gka import fused
from kalmix.ops.gka.spec import layer_inputs as gka_layer_inputs

DEFAULTS = dict(fused.CONFIGS[16])
NAMES = "o H U dq dk dv dg dbeta dalpha dH0 dU0".split()


def layer_inputs(B, T, H, K, V, dev, dtype, seed=0):
    args, state = gka_layer_inputs(B, T, H, K, V, seed, dtype)
    return [x.to(dev) for x in args], [s.to(dev) for s in state]


def with_grads(args, state, dtype, impl, num_iters):
    xs = [x.to(dtype).detach().requires_grad_() for x in [*args, *state]]
    o, (Hs, Us) = ops.gated_kalmanet(*xs[:6], initial_state=tuple(xs[6:]), output_final_state=True,
                                     num_iters=num_iters, impl=impl)
    return [o.detach(), Hs.detach(), Us.detach(), *random_functional_grads([o, Hs, Us], xs)]


def residual(args, state, dtype, ridge=0.02, n_iters=30):
    """‖(H_t + λ_t I) x_t − q_t‖ / ‖q_t‖ of the kernel's iterate, with H_t summed in fp64 (B = 1)."""
    q, k, v, g, beta, alpha = (x.to(dtype) for x in args)
    flat, (coff, chunks) = fused._flatten(q, k, v, g.float(), beta.float(), alpha.float(),
                                          torch.tensor([0, q.shape[1]], dtype=torch.int32, device=q.device), False)
    cu = torch.tensor([0, q.shape[1]], dtype=torch.int32, device=q.device)
    h0, u0 = (s.float().contiguous() for s in state)
    _, _, _, x, _ = fused._forward(*flat, h0, u0, cu, coff, chunks, 1.0, ridge, n_iters, store=True)
    q64, k64, g64, b64 = (t.double()[0] for t in (q, k, g, beta))      # [T, H, *]
    Hs, res = state[0].double()[0], []
    for t in range(q.shape[1]):
        Hs = g64[t].exp()[:, None, None] * Hs + b64[t][:, None, None] * k64[t][:, :, None] * k64[t][:, None, :]
        lam = ridge * torch.linalg.matrix_norm(Hs)
        r = (Hs @ x[t].double()[:, :, None])[..., 0] + lam[:, None] * x[t].double() - q64[t]
        res.append(r.norm(dim=-1) / q64[t].norm(dim=-1))
    res = torch.stack(res)
    return res.mean().item(), res.max().item()


def checks(dev):
    print("== the op vs torch fp64 (relative RMS): forward vs the same 30 steps, gradients vs the exact solve")
    args, state = layer_inputs(2, 1000, 4, 128, 128, dev, torch.float64)
    ref30 = with_grads(args, state, torch.float64, "torch", 30)
    exact = with_grads(args, state, torch.float64, "torch", None)
    for dtype in (torch.float32, torch.bfloat16):
        got = with_grads(args, state, dtype, "triton", 30)
        errs = " ".join(f"{n}={rel_err(a, b):.1e}" for n, a, b in zip(NAMES[:3], got, ref30))
        errs += " | " + " ".join(f"{n}={rel_err(a, b):.1e}" for n, a, b in zip(NAMES[3:], got[3:], exact[3:]))
        print(f"  {str(dtype)[6:]:8s} T=1000 K=V=128:", errs)
    print("  (torch fp64 30 steps vs exact: " + " ".join(
        f"{n}={rel_err(a, b):.1e}" for n, a, b in zip(NAMES, ref30, exact)) + ")")
    print("== Chebyshev residual after 30 steps at ridge 0.02 (B=1, T=2048, H=2, K=V=128): mean / max over tokens")
    args, state = layer_inputs(1, 2048, 2, 128, 128, dev, torch.float64, seed=1)
    for dtype in (torch.float32, torch.bfloat16):
        mean, mx = residual(args, state, dtype)
        print(f"  {str(dtype)[6:]:8s} {mean:.2e} / {mx:.2e}")
    print("== bf16, B=1, T=32768, H=8, K=V=128: forward + backward finite")
    args, state = layer_inputs(1, 32768, 8, 128, 128, dev, torch.bfloat16, seed=2)
    xs = [x.requires_grad_() for x in args]
    o, (Hs, Us) = ops.gated_kalmanet(*xs, output_final_state=True, impl="triton")
    (o.float().square().mean() + Hs.square().mean() + Us.square().mean()).backward()
    fin = all(torch.isfinite(t).all().item() for t in [o, Hs, Us, *(x.grad for x in xs)])
    print(f"  all finite: {fin}; |o| rms {o.float().square().mean().sqrt().item():.3f}")
    del o, Hs, Us, xs, args
    print("== prefill, bf16, B=1, T=131072, H=8, K=V=128, no grad")
    torch.cuda.empty_cache()
    args, state = layer_inputs(1, 131072, 8, 128, 128, dev, torch.bfloat16, seed=3)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        f = lambda: ops.gated_kalmanet(*args, output_final_state=True, impl="triton")  # noqa: E731
        o, _ = f()
        t = do_bench(f, warmup=1, rep=3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    print(f"  finite: {torch.isfinite(o).all().item()}; {t:.1f} ms; peak {peak:.2f} GiB above the inputs")


def timings(dev, configs):
    H, K = 8, 128
    print(f"== timings, ms (do_bench median), bf16, H={H} K=V={K}, 32K tokens per call")
    for T in (2048, 8192):
        B = 32768 // T
        args, _ = layer_inputs(B, T, H, K, K, dev, torch.bfloat16)
        xs = [x.requires_grad_() for x in args]
        q, k, v, _, beta, _ = xs
        do = torch.randn_like(v)
        time_anchors(T, q, k, v, beta, do)
        for cfg in configs:
            fused.CONFIGS[16] = {**DEFAULTS, **cfg}
            for n in (0, 10, 30):
                f = lambda: ops.gated_kalmanet(*xs, num_iters=n, impl="triton")[0]  # noqa: E731
                with torch.no_grad():
                    t_f = do_bench(f)
                t_fb = do_bench(lambda: f().backward(do))
                print(f"  T={T:5d} kalmix gka {cfg} num_iters={n:2d}: fwd {t_f:7.3f}  fwd+bwd {t_fb:7.3f}")
    fused.CONFIGS[16] = dict(DEFAULTS)
    print("== profile of one fwd+bwd, T=2048, B=16, num_iters=30, default config (ms per kernel)")
    args, _ = layer_inputs(16, 2048, H, K, K, dev, torch.bfloat16)
    xs = [x.requires_grad_() for x in args]
    do = torch.randn_like(xs[2])
    for _ in range(2):
        ops.gated_kalmanet(*xs, impl="triton")[0].backward(do)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.gated_kalmanet(*xs, impl="triton")[0].backward(do)
        torch.cuda.synchronize()
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
        print(f"  {e.key[:40]:40s} {e.device_time_total / 1e3:8.3f}")


if __name__ == "__main__":
    run(checks, timings, "kernel warps to time, e.g. 'fwd=16,grads=16' ('' = the defaults)")
