"""kalmix's chunked delta-rule kernels (kalmix/ops/common/delta_triton.py) on a GPU: accuracy against the fp64
torch chunk path, then per-kernel and end-to-end timings next to fla's chunk_delta_rule / chunk_gated_delta_rule
on the same shape. From the repository root:

    python benchmarks/delta_triton.py [--configs KEY=VALUE,... ...]
"""
import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from _gpu_script import run
from kalmix.ops.common import delta_triton as dt
from kalmix.ops.common.delta import chunk_delta_rule
from kalmix.ops.common.testing import random_functional_grads, rel_err
from kalmix.ops.common.triton_utils import chunk_table
from kalmix.ops.common.varlen import batch_offsets


def inputs(B, T, H, K, V, dtype, dev, seed=0, same_keys=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = r(B, T, H, K)
    w = F.normalize(r(B, T, H, K), dim=-1)
    e = w if same_keys else F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, V)
    g = -0.3 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    s0 = r(B, H, K, V)
    acts = [x.to(dev, dtype) for x in (q, w, e, v)]
    return acts + [x.to(dev, torch.float32 if dtype != torch.float64 else dtype) for x in (g, beta, s0)]


def grads(f, xs):
    xs = [x.detach().requires_grad_() for x in xs]
    o, S = f(*xs)
    return [o.detach(), S.detach(), *random_functional_grads((o, S), xs)]


def checks(dev):
    names = "o S dq dw de dv dg dbeta ds0".split()
    print("== accuracy vs the fp64 torch chunk path (relative RMS)")
    for dtype, T, same in ((torch.float32, 1000, False), (torch.float32, 1000, True), (torch.bfloat16, 1000, True),
                           (torch.float32, 4097, True)):
        B, H, K, V = 2, 4, 128, 128
        ref = grads(lambda *x: chunk_delta_rule(*x[:6], scale=K ** -0.5, state=x[6]),
                    inputs(B, T, H, K, V, torch.float64, dev, same_keys=same))
        got = grads(lambda *x: dt.chunk_delta_rule_triton(*x[:6], scale=K ** -0.5, state=x[6]),
                    inputs(B, T, H, K, V, dtype, dev, same_keys=same))
        print(f"  {str(dtype)[6:]:8s} T={T} w=e={same!s:5s}",
              " ".join(f"{n}={rel_err(a, b):.1e}" for n, a, b in zip(names, got, ref)))


def timings(dev, configs):
    B, T, H, K = 16, 2048, 8, 128
    print(f"== timings, ms (do_bench median), bf16 B={B} T={T} H={H} K=V={K}")
    from fla.ops import chunk_delta_rule as fla_delta, chunk_gated_delta_rule as fla_gdn
    q, w, e, v, g, beta, s0 = inputs(B, T, H, K, K, torch.bfloat16, dev)
    do = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    xs = [x.requires_grad_() for x in (q, w, v, g, beta)]
    gb, bb = (x.detach().to(torch.bfloat16).requires_grad_() for x in (g, beta))
    anchors = [("fla chunk_delta_rule", lambda: fla_delta(q, w, v, bb)[0], True),
               ("fla chunk_gated_delta_rule", lambda: fla_gdn(q, w, v, gb, bb)[0], False)]
    for name, f, bwd in anchors:
        with torch.no_grad():
            t_f = do_bench(f)
        t_fb = f"{do_bench(lambda: f().backward(do)):.3f}" if bwd else "n/a (refused on Hopper)"
        print(f"  {name:30s} fwd {t_f:7.3f}  fwd+bwd {t_fb}")
    for cfg in configs:
        dt.CONFIGS[16] = dict(dt.CONFIGS[16], **cfg)
        f = lambda: dt.chunk_delta_rule_triton(xs[0], xs[1], xs[1], xs[2], xs[3], xs[4], scale=K ** -0.5,  # noqa
                                               state=s0)[0]
        with torch.no_grad():
            t_f = do_bench(f)
        t_fb = do_bench(lambda: f().backward(do))
        print(f"  kalmix {cfg}  fwd {t_f:7.3f}  fwd+bwd {t_fb:.3f}")
        kernel_breakdown(q, w, v, g, beta, s0, do, K)


def kernel_breakdown(q, w, v, g, beta, s0, do, K):
    """Each kernel alone, on buffers from one forward (the backward's pieces as the backward runs them)."""
    B, T, H, _ = q.shape
    V = v.shape[-1]
    qf, wf, vf, gf, bf = [x.reshape(B * T, *x.shape[2:]).contiguous().detach() for x in (q, w, v, g, beta)]
    cu = batch_offsets(B, T, q.device)
    coff, chunks = chunk_table(None, B, T, dt.CHUNK, q.device)
    NC, N = chunks.shape[0], B
    kw = dt._launch(q.dtype, K, V, dt._narrow(q.dtype, V, N * H, q.device))
    sc = K ** -0.5
    Gc, Tm, wt, ut, _, _ = dt._prep(wf, wf, vf, gf, bf, chunks)
    h, U, sT = dt._states(wf, wt, ut, Gc, s0, cu, coff, NC)
    o = torch.empty_like(U)
    dof = do.reshape(B * T, H, V).contiguous()
    dU, dh, ds0 = torch.empty_like(U), torch.empty_like(h), torch.empty_like(s0)
    dq, dw, de, dv, dg, db = (torch.empty_like(x) for x in (qf, wf, wf, vf, gf, bf))
    dwp, dwt, dG = torch.empty_like(wf), torch.empty_like(wf), torch.empty_like(gf)
    nv, nvd = triton.cdiv(V, kw["states"]["BV"]), triton.cdiv(V, kw["dstates"]["BV"])
    runs = {
        "prep": lambda: dt._prep_kernel[(NC, H)](wf, wf, vf, gf, bf, chunks, Gc, Tm, wt, ut, None, None, 0., H, K, V,
                                                 STEP=False, CHECK=False, **kw["prep"]),
        "states": lambda: dt._states_kernel[(nv, N * H)](wf, wt, ut, Gc, s0, cu, coff, h, U, sT, H, K, V,
                                                         HAS_S0=True, **kw["states"]),
        "output": lambda: dt._output_kernel[(NC, H)](qf, wf, U, Gc, h, chunks, o, sc, H, K, V, **kw["output"]),
        "dv_local": lambda: dt._dv_local_kernel[(NC, H)](qf, wf, Gc, dof, chunks, dU, sc, H, K, V, **kw["dv_local"]),
        "dstates": lambda: dt._dstates_kernel[(nvd, N * H)](qf, wf, wt, Gc, dof, s0, cu, coff, dU, dh, ds0, sc, H, K,
                                                            V, HAS_DST=False, HAS_DS0=True, **kw["dstates"]),
        "grads_qw": lambda: dt._grads_qw_kernel[(NC, H)](qf, wf, gf, bf, chunks, h, dh, U, dU, dof, dq, dwp, dwt,
                                                         dG, sc, H, K, V, **kw["grads_qw"]),
        "grads_wy": lambda: dt._grads_wy_kernel[(NC, H)](wf, wf, vf, gf, bf, chunks, Tm, dU, dwt, dG, dwp, dw, de, dv,
                                                         dg, db, 0., H, K, V, STEP=False, **kw["grads_wy"]),
    }
    print("    per kernel:", "  ".join(f"{k} {do_bench(f):.3f}" for k, f in runs.items()))


if __name__ == "__main__":
    run(checks, timings, "overrides of CONFIGS[16] to time, e.g. 'prep=8,BV=32' ('' = the defaults)")
