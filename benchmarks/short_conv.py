"""ShortConv's fused causal-conv kernels (kalmix/layers/fused.py) on a GPU, timed at a layer's shape next to
fla's ``causal_conv1d`` and the torch path (their accuracy against the torch path is checked by
gpu_tests/test_layers_gpu.py). From the repository root:

    python benchmarks/short_conv.py [--configs FT=8,FC=128,FW=4,BT=4,BC=128,BW=4,BN=16 ...]

FT/FC/FW: forward tokens, channels and warps per program; BT/BC/BW: the same for the backward, whose programs
walk BN blocks of BT tokens each.
"""
import torch
from triton.testing import do_bench

from _gpu_script import run
from kalmix.layers import fused
from kalmix.layers.common import ShortConv


def timings(dev, configs):
    B, T, C = 8, 2048, 1024
    src = torch.empty(1 << 28, device=dev)
    copy = 2 * src.numel() * 4 / do_bench(lambda: torch.empty_like(src).copy_(src)) / 1e6     # GB/s (ms -> s)
    nbytes = B * T * C * 2
    print(f"== timings, ms (do_bench median), bf16 B={B} T={T} C={C}; bytes floor at the {copy:.0f} GB/s copy rate:"
          f" fwd {2 * nbytes / copy / 1e6:.3f} (x, y), fwd+bwd {5 * nbytes / copy / 1e6:.3f} (+ x, dy, dx)")
    from fla.modules.causal_conv1d import causal_conv1d
    conv = ShortConv(C, 4, bias=True).to(dev, torch.bfloat16)
    x = torch.randn(B, T, C, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    zero = torch.zeros(B, C, 3, device=dev, dtype=torch.bfloat16)
    leaves = [x, conv.weight, conv.bias]
    rows = [("torch path (zero state)", lambda: conv(x, zero)[0]),
            ("fla causal_conv1d", lambda: causal_conv1d(x, conv.weight, conv.bias, activation="silu")[0])]
    default = fused._CONV_FWD, fused._CONV_BWD
    for cfg in configs:
        f = (cfg.get("FT", default[0][0]), cfg.get("FC", default[0][1]), cfg.get("FW", default[0][2]))
        b = tuple(cfg.get(k, d) for k, d in zip(("BT", "BC", "BW", "BN"), default[1]))

        def call(f=f, b=b):
            fused._CONV_FWD, fused._CONV_BWD = f, b
            return conv(x)[0]
        rows.append((f"fused fwd {f} bwd {b}", call))
    for name, fn in rows:
        with torch.no_grad():
            t_f = do_bench(fn)
        t_fb = do_bench(lambda: fn().backward(dy), grad_to_none=leaves)
        print(f"  {name:44s} fwd {t_f:7.3f}  fwd+bwd {t_fb:7.3f}")
    fused._CONV_FWD, fused._CONV_BWD = default


if __name__ == "__main__":
    run(None, timings, "FT,FC,FW / BT,BC,BW,BN: forward / backward tokens, channels, warps per program (and "
                         "token blocks per backward program)")
