"""kaczmarz_attention(impl="triton") on a GPU with each engine (fla's chunk_gated_delta_rule, kalmix's own chunk
kernels), checked against the fp64 chunked torch path (outputs, final state, every gradient where the engine
trains), then timed next to fla's GDN and DeltaNet. From the repository root:

    python benchmarks/kaczmarz_fused.py
"""
import torch
from triton.testing import do_bench

from _gpu_script import cuda_device
from kalmix import ops
from kalmix.ops import SPECS
from kalmix.ops.common.testing import outputs_and_grads, rel_err, run_case
from kalmix.ops.kaczmarz import fused


def checks(dev):
    names = ["o", "S", "dq", "dk", "dv", "dg", "deta", "dS0"]
    refused = fused.fla_gated_backward_refused(dev)
    print(f"== accuracy vs the fp64 torch path (relative RMS); fla's gated backward refused here: {refused}")
    for eng in ("fla", "kalmix"):
        fused.engine = (lambda device, dtype, e=eng: e)
        for dt, T, cu in ((torch.float32, 1000, None), (torch.bfloat16, 1000, None),
                          (torch.float32, 1001, torch.tensor([0, 300, 301, 301, 1001], device=dev))):
            gen = torch.Generator().manual_seed(T)
            B = 1 if cu is not None else 2
            args = [x.to(dev) for x in SPECS["kaczmarz"].inputs(B, T, 4, 64, 64, torch.float64, gen)]
            state = SPECS["kaczmarz"].random_state(B if cu is None else 4, 4, 64, 64, torch.float64, gen).to(dev)
            ref_out, ref_grad = outputs_and_grads(SPECS["kaczmarz"], args, state, "torch", cu_seqlens=cu)
            x = [a.to(dt) if i < 3 else a.float() for i, a in enumerate(args)]
            if eng == "fla" and refused:
                with torch.no_grad():
                    out, grad = run_case(SPECS["kaczmarz"], x, state.float(), "triton", cu_seqlens=cu), []
            else:
                out, grad = outputs_and_grads(SPECS["kaczmarz"], x, state.float(), "triton", cu_seqlens=cu)
            ref, got = ref_out + ref_grad, out + grad
            print(f"  {eng:6s} {str(dt)[6:]:8s} T={T} varlen={cu is not None!s:5s}",
                  " ".join(f"{n}={rel_err(a.double(), b):.1e}" for n, a, b in zip(names, got, ref)))
    fused.engine = _engine


def timings(dev):
    B, T, H, K = 16, 2048, 8, 128
    print(f"== timings, ms (do_bench median), bf16 B={B} T={T} H={H} K=V={K}")
    from fla.ops import chunk_delta_rule, chunk_gated_delta_rule
    gen = torch.Generator().manual_seed(0)
    args = [a.to(dev, torch.bfloat16) if i < 3 else a.to(dev) for i, a in
            enumerate(SPECS["kaczmarz"].inputs(B, T, H, K, K, torch.float32, gen))]
    xs = [a.requires_grad_() for a in args]
    do = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    q, k, v, g, eta = xs
    # the anchors: GDN / DeltaNet on unit keys, gates in bf16 like the activations
    kn, gb, bb = (t.detach().to(torch.bfloat16).requires_grad_() for t in
                  (torch.nn.functional.normalize(k.detach().float(), dim=-1), g, eta))
    rows = [("kaczmarz_attention triton", lambda: ops.kaczmarz_attention(*xs, impl="triton")[0]),
            ("  kalmix kernels forced", lambda: forced_kalmix(*xs)),
            ("fla chunk_gated_delta_rule", lambda: chunk_gated_delta_rule(q, kn, v, gb, bb)[0]),
            ("fla chunk_delta_rule", lambda: chunk_delta_rule(q, kn, v, bb)[0])]
    for name, f in rows:
        with torch.no_grad():
            t_f = do_bench(f)
        try:
            t_fb = f"{do_bench(lambda: f().backward(do)):8.3f}"
        except RuntimeError as e:       # fla's refusal of the gated backward
            t_fb = f"n/a ({str(e)[:40]}...)"
        print(f"  {name:28s} fwd {t_f:7.3f}  fwd+bwd {t_fb}")


def forced_kalmix(*xs):
    fused.engine = (lambda device, dtype: "kalmix")
    try:
        return ops.kaczmarz_attention(*xs, impl="triton")[0]
    finally:
        fused.engine = _engine


_engine = fused.engine

if __name__ == "__main__":
    device = cuda_device("kaczmarz_fused.py")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    checks(device)
    timings(device)
