"""The fused Kalman kernels on a GPU: accuracy at realistic sizes, then kernel configurations timed side by side
with fla's chunk_delta_rule (the issue-4 anchor). Run from the repository root:

    python benchmarks/kalman_fused.py                 # checks + the default configuration
    python benchmarks/kalman_fused.py --configs 4,16,1,2,4,1 8,8,1,2,4,1

A configuration is CHUNK,FWD_BD,FWD_WARPS,BWD_BD1,BWD_BD2,BWD_WARPS (see kalmix/ops/kalman/fused.py).
"""
import argparse

import torch
from triton.testing import do_bench

from _gpu_script import cuda_device
from kalmix import ops
from kalmix.ops.common.testing import rel_err
from kalmix.ops.kalman import fused
from kalmix.ops.kalman.spec import realistic_inputs as kalman_realistic_inputs


def _run(args, impl, state=None, cu_seqlens=None):
    return ops.kalman_attention(*args, initial_state=state, output_final_state=True, output_variance=True,
                                cu_seqlens=cu_seqlens, impl=impl)


def _outputs_and_grads(args, impl, cu_seqlens=None):
    args = [a.detach().requires_grad_() for a in args]
    o, var, (lam, mu) = _run(args, impl, cu_seqlens=cu_seqlens)
    gen = torch.Generator(device=o.device).manual_seed(0)
    loss = sum((x.double() * torch.randn(x.shape, generator=gen, device=x.device, dtype=torch.float64)).sum()
               for x in (o, var, mu))
    return [o, var, lam, mu], torch.autograd.grad(loss, args)


def checks(dev):
    print("== accuracy (relative RMS error; realistic regime: decay 0.9-0.999, noise 1e-7-1e-6, precision to 1e4)")
    names = ["o", "var", "lam", "mu"] + ["dq", "dk", "dv", "dw", "da", "dp"]
    for dt, T in ((torch.float32, 1000), (torch.bfloat16, 1000)):
        base = [x.to(dev) for x in kalman_realistic_inputs(T, torch.float64, seed=1, B=2, H=2, N=16, D=96)]
        ref_out, ref_grad = _outputs_and_grads(base, "torch")
        x = [t.to(dt) if i < 4 else t.float() for i, t in enumerate(base)]
        out, grad = _outputs_and_grads(x, "triton")
        errs = [rel_err(a, b) for a, b in zip(list(out) + list(grad), list(ref_out) + list(ref_grad))]
        print(f"  triton {str(dt):15s} T={T} vs fp64:", " ".join(f"{n}={e:.1e}" for n, e in zip(names, errs)))
    base = [x.to(dev) for x in kalman_realistic_inputs(1001, torch.float32, seed=2, B=1, H=2, N=16, D=64)]
    cu = torch.tensor([0, 300, 301, 301, 1001], device=dev)
    a, ga = _outputs_and_grads(base, "triton", cu)
    b, gb = _outputs_and_grads(base, "torch", cu)
    errs = [rel_err(x, y) for x, y in zip(a + list(ga), b + list(gb))]
    print("  varlen triton vs torch (fp32):", " ".join(f"{n}={e:.1e}" for n, e in zip(names, errs)))
    x = [t.to(dev) for t in kalman_realistic_inputs(65536, torch.float32, seed=3, B=1, H=1, N=16, D=64)]
    with torch.no_grad():
        a, b = _run(x, "triton"), _run(x, "torch")
    fin = all(torch.isfinite(t).all().item() for t in (a[0], a[1], *a[2]))
    print(f"  T=65536 fp32: finite={fin}, triton vs torch: o={rel_err(a[0], b[0]):.1e} var={rel_err(a[1], b[1]):.1e}"
          f" lam={rel_err(a[2][0], b[2][0]):.1e} mu={rel_err(a[2][1], b[2][1]):.1e}")


def timings(dev, configs):
    B, T, H, N, D = 16, 2048, 1, 16, 2048
    print(f"== timings, ms (median of do_bench): B={B} T={T} H={H} N={N} D={D}; anchor fla chunk_delta_rule "
          f"H=8 K=V=128 bf16 on the same tokens")
    from fla.ops.delta_rule import chunk_delta_rule
    qa, ka, va = (torch.randn(B, T, 8, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    ka = torch.nn.functional.normalize(ka.float(), dim=-1).to(torch.bfloat16)
    beta = torch.rand(B, T, 8, device=dev, dtype=torch.bfloat16)
    xs = [t.requires_grad_() for t in (qa, ka, va, beta)]
    do_a = torch.randn_like(va)
    f_a = lambda: chunk_delta_rule(*xs)[0]  # noqa: E731
    with torch.no_grad():
        t_fwd = do_bench(f_a)
    t_fb = do_bench(lambda: f_a().backward(do_a))
    print(f"  fla chunk_delta_rule            fwd {t_fwd:7.3f}  fwd+bwd {t_fb:7.3f}")
    for cfg in configs:
        c, fbd, fw, b1, b2, bw = cfg
        fused.CHUNK, fused.FWD_CONFIG, fused.BWD_CONFIG = c, (fbd, fw), (b1, b2, bw)
        for dt in (torch.float32, torch.bfloat16):
            x = [t.to(dev) for t in kalman_realistic_inputs(T, torch.float32, seed=0, B=B, H=H, N=N, D=D)]
            x = [t.to(dt) if i < 4 else t for i, t in enumerate(x)]
            xs = [t.requires_grad_() for t in x]
            do = torch.randn(B, T, H, D, device=dev, dtype=dt)

            def fwd():
                return ops.kalman_attention(*xs, impl="triton")[0]
            with torch.no_grad():
                tf = do_bench(fwd)
            torch.cuda.reset_peak_memory_stats()
            tb = do_bench(lambda: fwd().backward(do))
            peak = torch.cuda.max_memory_allocated() / 2 ** 30
            io = B * T * H * D * 3 * x[0].element_size()          # v, w read, o written
            print(f"  kalman {str(cfg):24s} {str(dt)[6:]:8s} fwd {tf:7.3f} ({io / tf / 1e6:6.0f} GB/s)  "
                  f"fwd+bwd {tb:7.3f}  ratio to anchor {tb / t_fb:5.2f}  peak {peak:.1f} GiB")


def _config(text: str) -> tuple[int, ...]:
    default = (fused.CHUNK, *fused.FWD_CONFIG, *fused.BWD_CONFIG)
    values = text.split(",")
    if len(values) != len(default) or not all(v.strip().isdigit() for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not {len(default)} whole numbers separated by commas "
                                         f"(e.g. {','.join(map(str, default))})")
    return tuple(int(v) for v in values)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="kalman_fused.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", type=_config, default=None, help="kernel configurations to time")
    parser.add_argument("--no-checks", action="store_true", help="skip the accuracy checks")
    args = parser.parse_args(argv)
    dev = cuda_device(parser.prog)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if not args.no_checks:
        checks(dev)
    default = (fused.CHUNK, *fused.FWD_CONFIG, *fused.BWD_CONFIG)
    timings(dev, args.configs or [default])


if __name__ == "__main__":
    main()
