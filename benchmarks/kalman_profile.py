"""Where the time of the fused Kalman op and layer goes, on a GPU. Run from the repository root:

    python benchmarks/kalman_profile.py op          # one forward + backward at the issue-4 op shape (for ncu)
    python benchmarks/kalman_profile.py layer       # timings and a profile of the layer training step

ncu reads the op's kernels: ``ncu --clock-control none -k regex:_kalman --section WarpStateStats ...
python benchmarks/kalman_profile.py op``. The layer step is issue 4's target 3: B = 8, T = 2048, d_model = 512,
N = 16, bf16. The accuracy of the layer's fused kernels is checked by gpu_tests/test_layers_gpu.py.
"""
import argparse
import time

import torch

from kalmix import ops
from kalmix.layers import KalmanAttention
from kalmix.ops.common.testing import kalman_realistic_inputs


def op_step():
    B, T, H, N, D = 16, 2048, 1, 16, 2048
    x = [t.cuda() for t in kalman_realistic_inputs(T, torch.float32, seed=0, B=B, H=H, N=N, D=D)]
    xs = [(t.to(torch.bfloat16) if i < 4 else t).requires_grad_() for i, t in enumerate(x)]
    o = ops.kalman_attention(*xs, impl="triton")[0]
    o.backward(torch.randn_like(o))
    torch.cuda.synchronize()


def layer_profile(rows: int):
    """Issue 4's target-3 step: do_bench fwd and fwd+bwd (as `kalmix speed` times them), the host's time to
    enqueue a step, the kernels per step and their GPU time, then torch.profiler's table."""
    from triton.testing import do_bench
    layer = KalmanAttention(512).cuda().to(torch.bfloat16)
    x = torch.randn(8, 2048, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    leaves = [x, *layer.parameters()]

    def step():
        out = layer(x)[0]
        out.backward(torch.ones_like(out))

    for _ in range(3):
        step()
    with torch.no_grad():
        t_fwd = do_bench(lambda: layer(x), warmup=5, rep=30)
    t_step = do_bench(step, warmup=5, rep=30, grad_to_none=leaves)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"layer step B=8 T=2048 d_model=512 bf16: fwd {t_fwd:.3f} ms, fwd+bwd {t_step:.3f} ms; host enqueue "
          f"{1e3 * (t1 - t0) / 10:.3f} ms/step; {len(kernels) / 5:.0f} kernels/step, GPU busy "
          f"{sum(e.device_time for e in kernels) / 5e3:.3f} ms/step")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["op", "layer"])
    parser.add_argument("--rows", type=int, default=25, help="rows of the layer table")
    args = parser.parse_args()
    op_step() if args.what == "op" else layer_profile(args.rows)


if __name__ == "__main__":
    main()
