"""Where the time of `kalmix speed` targets goes on a GPU: for each target and mode, the do_bench median (as
`kalmix speed` times it), the host's time to enqueue one call, the kernels per call, the GPU time they take and
the kernels one by one. Run from the repository root, e.g.

    python benchmarks/op_profile.py kaczmarz_attention/triton fla.chunk_gated_delta_rule/fla --modes fwd

A target is NAME/IMPL as in `kalmix speed`'s table; the shape is the speed harness's (--seq-len, --tokens,
H = 8, K = V = 128; Kalman ops H = 1, N = 16, D = 2048), bf16.
"""
import argparse
import cProfile
import pstats
import time
from collections import defaultdict

import torch
from triton.testing import do_bench

from kalmix.bench.speed import Shape, SpeedConfig, targets


def profile(fn, leaves, mode: str, rows: int, host: bool, reps: int = 5) -> None:
    if mode == "fwd":
        def call():
            with torch.no_grad():
                fn()
    else:
        def call():
            for x in leaves:               # as do_bench's grad_to_none: no gradient accumulation kernels
                x.grad = None
            out = fn()
            out.backward(torch.ones_like(out))
    for _ in range(3):
        call()
    t_bench = do_bench(call, warmup=10, rep=50, grad_to_none=leaves)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        call()
    t_host = (time.perf_counter() - t0) / 10
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += 1
            per[e.name][1] += e.device_time
    busy = sum(t for _, t in per.values()) / reps
    print(f"  do_bench {t_bench:.3f} ms | host enqueue {1e3 * t_host:.3f} ms/call | "
          f"{sum(n for n, _ in per.values()) / reps:.0f} kernels/call, GPU busy {busy / 1e3:.3f} ms/call")
    for name, (n, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:rows]:
        print(f"    {t / reps:8.1f} us  x{n / reps:<4.0f} {name[:100]}")
    if host:                          # the Python functions the host spends its time in (per call: / 20)
        with cProfile.Profile() as prof:
            for _ in range(20):
                call()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(rows)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {text!r}")
    return int(text)


def main(argv=None):
    p = argparse.ArgumentParser(prog="op_profile.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="+", help="NAME/IMPL, e.g. kaczmarz_attention/triton")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--seq-len", type=_positive, default=2048)
    p.add_argument("--tokens", type=_positive, default=32768)
    p.add_argument("--rows", type=_positive, default=15)
    p.add_argument("--host", action="store_true", help="also cProfile 20 calls (host time by function)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("op_profile.py: error: profiles CUDA kernels, and this machine has no CUDA device")
    dev = torch.device("cuda")
    cfg = SpeedConfig()
    all_t = {f"{t.name}/{t.impl}": t for t in targets((), (), cfg.d_model, cfg.heads, cfg.head_dim, cfg.d_state, dev)}
    unknown = [name for name in a.targets if name not in all_t]
    if unknown:
        p.error(f"unknown target(s) {unknown}; the targets: {', '.join(all_t)}")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for name in a.targets:
        t = all_t[name]
        s = Shape(max(1, a.tokens // a.seq_len), a.seq_len, *t.heads)
        fn, leaves = t.build(s, torch.bfloat16, dev)
        for mode in a.modes:
            print(f"== {name} {mode} bf16 {s}")
            try:
                profile(fn, leaves, mode, a.rows, a.host)
            except RuntimeError as err:
                print(f"  failed: {str(err).splitlines()[0][:120]}")
        del fn, leaves
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
