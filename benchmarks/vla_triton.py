"""VLA's triton impl on a GPU: the A-path kernels (kalmix/ops/vla/apath_triton.py) against the fp64 torch A path,
the whole op against the fp64 torch impl, then timings of the A path alone and of the op next to fla's
chunk_delta_rule and SDPA on the same tokens. From the repository root:

    python benchmarks/vla_triton.py [--configs KEY=VALUE,... ...]   (keys: fwd, b, du, carry, da0 (warps), save, rows,
        cols (the per-block kernels' BLOCK_COLS), programs, carry_programs (the forward's MIN_PROGRAMS and the
        carry's CARRY_MIN_PROGRAMS; 1: no parts))
"""
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from _gpu_script import run, time_anchors
from kalmix import ops
from kalmix.ops.common.testing import random_functional_grads, rel_err
from kalmix.ops.vla import apath_triton as ap
from kalmix.ops.vla.chunk import write_directions


# every config starts from these
DEFAULTS = dict(warps=dict(ap.WARPS), save=ap.SAVE, rows=ap.ROW_BLOCK, cols=ap.BLOCK_COLS,
                programs=ap.MIN_PROGRAMS, carry_programs=ap.CARRY_MIN_PROGRAMS)


def apath_inputs(B, T, H, K, dev, lambda0=0.1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kh, uh = (F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1) for _ in range(2))
    A0 = torch.eye(K, dtype=torch.float64).expand(B, H, K, K) / lambda0
    return [x.to(dev) for x in (kh, uh, A0)]


def with_grads(f, xs, dtype):
    xs = [x.to(dtype).detach().requires_grad_() for x in xs]
    outs = f(*xs)
    return [o.detach() for o in outs] + random_functional_grads(outs, xs)


def checks(dev):
    print("== A path kernels vs the fp64 torch A path (relative RMS; dA0 symmetric parts)")
    names = "alpha A_T dk du dA0".split()
    for T in (1000, 8192):
        xs = apath_inputs(2, T, 4, 128, dev)
        ref = with_grads(write_directions, xs, torch.float64)
        got = with_grads(ap.write_directions_triton, xs, torch.float32)
        for r in (ref, got):
            r[-1] = 0.5 * (r[-1] + r[-1].mT)
        print(f"  fp32 T={T}:", " ".join(f"{n}={rel_err(a, b):.1e}" for n, a, b in zip(names, got, ref)))
    print("== the op, triton vs torch fp64 (relative RMS)")
    names = "o S A n dq dk dv du".split()
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(1)
        args = [torch.randn(2, 1000, 4, 128, generator=gen, dtype=torch.float64).to(dev) for _ in range(4)]

        def op(impl):
            return lambda *x: (lambda o, st: (o, *st))(*ops.variational_linear_attention(
                *x, output_final_state=True, impl=impl))
        ref = with_grads(op("torch"), args, torch.float64)
        got = with_grads(op("triton"), args, dtype)
        errs = " ".join(f"{n}={rel_err(a, b):.1e}" for n, a, b in zip(names, got, ref))
        print(f"  {str(dtype)[6:]:8s} T=1000:", errs)


def timings(dev, configs):
    H, K = 8, 128
    print(f"== timings, ms (do_bench median), H={H} K=V={K}, 32K tokens per call")
    for T in (2048, 8192, 16384):
        B = 32768 // T
        gen = torch.Generator().manual_seed(0)
        q, k, v, u = (torch.randn(B, T, H, K, generator=gen).to(dev, torch.bfloat16).requires_grad_()
                      for _ in range(4))
        do = torch.randn_like(v)
        beta = torch.rand(B, T, H, device=dev, dtype=torch.bfloat16).requires_grad_()
        time_anchors(T, q, F.normalize(k.detach(), dim=-1).requires_grad_(), v, beta, do)
        kh, uh, A0 = (x.float() for x in apath_inputs(B, T, H, K, dev))
        xs = [x.requires_grad_() for x in (kh, uh)]
        dal = torch.randn_like(kh)
        for cfg in configs:
            ap.WARPS.update({k: cfg.get(k, v) for k, v in DEFAULTS["warps"].items()})
            ap.SAVE = cfg.get("save", DEFAULTS["save"])
            ap.ROW_BLOCK = cfg.get("rows", DEFAULTS["rows"])
            ap.BLOCK_COLS = cfg.get("cols", DEFAULTS["cols"])
            ap.MIN_PROGRAMS = cfg.get("programs", DEFAULTS["programs"])
            ap.CARRY_MIN_PROGRAMS = cfg.get("carry_programs", DEFAULTS["carry_programs"])
            apath = lambda: ap.write_directions_triton(*xs, A0)[0]  # noqa: E731
            f = lambda: ops.variational_linear_attention(q, k, v, u, impl="triton")[0]  # noqa: E731
            with torch.no_grad():
                t_af, t_f = do_bench(apath), do_bench(f)
            t_afb, t_fb = do_bench(lambda: apath().backward(dal)), do_bench(lambda: f().backward(do))
            print(f"  T={T:5d} kalmix {cfg}: A path fwd {t_af:7.3f} fwd+bwd {t_afb:7.3f} | "
                  f"VLA op fwd {t_f:7.3f} fwd+bwd {t_fb:7.3f}")


if __name__ == "__main__":
    run(checks, timings, "A-path settings to time, e.g. 'fwd=16,bwd=16,save=8' ('' = the defaults)")
