"""Where the time of the fused Kalman op and layer goes, on a GPU. Run from the repository root:

    python benchmarks/kalman_profile.py op          # one forward + backward at the issue-4 op shape (for ncu)
    python benchmarks/kalman_profile.py layer       # torch.profiler table of one layer training step

ncu reads the op's kernels: ``ncu --clock-control none -k regex:_kalman --section WarpStateStats ...
python benchmarks/kalman_profile.py op``. The layer step is issue 4's target 3: B = 8, T = 2048, d_model = 512,
N = 16, bf16.
"""
import argparse

import torch

from kalmix import ops
from kalmix.layers import KalmanAttention
from kalmix.ops.common.testing import kalman_realistic_inputs, rel_err


def op_step():
    B, T, H, N, D = 16, 2048, 1, 16, 2048
    x = [t.cuda() for t in kalman_realistic_inputs(T, torch.float32, seed=0, B=B, H=H, N=N, D=D)]
    xs = [(t.to(torch.bfloat16) if i < 4 else t).requires_grad_() for i, t in enumerate(x)]
    o = ops.kalman_attention(*xs, impl="triton")[0]
    o.backward(torch.randn_like(o))
    torch.cuda.synchronize()


def conv_check():
    """ShortConv's fla path (CUDA, no state) against its torch path (given a zero state): output, state and
    every gradient, bf16 and fp32, with a length shorter than the kernel too."""
    from kalmix.layers.common import ShortConv
    for dt in (torch.bfloat16, torch.float32):
        for T in (37, 2):
            conv = ShortConv(96, 4, bias=True).cuda().to(dt)
            x = torch.randn(2, T, 96, device="cuda", dtype=dt, requires_grad=True)
            dy = torch.randn(2, T, 96, device="cuda", dtype=dt)
            res = []
            for state in (None, torch.zeros(2, 96, 3, device="cuda", dtype=dt)):
                y, st = conv(x, state)
                grads = torch.autograd.grad(y, (x, conv.weight, conv.bias), dy)
                res.append([y, st, *grads])
            errs = [rel_err(a, b) for a, b in zip(*res)]
            print(f"ShortConv fla vs torch {str(dt)[6:]} T={T}: y, state, dx, dw, db rel err",
                  " ".join(f"{e:.1e}" for e in errs))


def layer_profile(rows: int):
    conv_check()
    layer = KalmanAttention(512).cuda().to(torch.bfloat16)
    x = torch.randn(8, 2048, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        layer(x)[0].sum().backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            layer(x)[0].sum().backward()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["op", "layer"])
    parser.add_argument("--rows", type=int, default=25, help="rows of the layer table")
    args = parser.parse_args()
    op_step() if args.what == "op" else layer_profile(args.rows)


if __name__ == "__main__":
    main()
