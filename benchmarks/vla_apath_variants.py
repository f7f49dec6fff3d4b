"""Where the VLA A path's forward kernel (kalmix/ops/vla/apath_triton.py) spends its time, on a GPU: the kernel
as is, and variants made by editing its source (wrong values on purpose; timing only), each at 4 and 8 warps,
with the compiler's registers and spills. From the repository root:

    python benchmarks/vla_apath_variants.py

Variants: "nochol" replaces R⁻¹ (the 16-step factorisation loop) by a scaled G; "tf32" multiplies with one TF32 pass
instead of 3×TF32; "nochol+tf32" both; "noUA" drops the products with A's row blocks (U A, K̂ A; U A and K̂ A stay zero,
and A is not read); "nodown" drops the downdate A ← A − WᵀW (A is neither read nor written there); "C32" walks
sub-chunks of 32 tokens (the factorisation 32 steps). The last column is α̂'s distance from the unedited kernel's. One
program per (batch, head): no parts.
"""
import importlib.util
import pathlib
import sys
import tempfile

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import kalmix.ops.vla.apath_triton as ap

EDITS = {
    "nochol": [("Rinv = _chol_inv(G, rows, cols, C)", "Rinv = G * 0.01")],
    "tf32": [("delta_triton import (_DT, _dot, _dot_acc,", "delta_triton import (_DT,"),
             ("@triton.jit\ndef _chol_inv", "@triton.jit\ndef _dot_acc(a, b, acc, DT: tl.constexpr):\n"
              "    return tl.dot(a, b, acc, input_precision='tf32')\n\n\n@triton.jit\n"
              "def _dot(a, b, DT: tl.constexpr):\n    return _dot_acc(a, b, None, DT)\n\n\n"
              "@triton.jit\ndef _chol_inv")],
    "noUA": [("UA = _dot_acc(_load_rows(u_ptr, t0, L, i_h, H, K, r0, BR, C), Ar, UA, DT)", "pass"),
             ("KA = _dot_acc(_load_rows(k_ptr, t0, L, i_h, H, K, r0, BR, C), Ar, KA, DT)", "pass")],
    "nodown": [("tl.store(a_work + o, _dot_acc(-tl.trans(Wr), W, tl.load(a_work + o, mask=m, other=0.), DT), mask=m)",
                "pass")],
    "C32": [("C_SUB = 16 ", "C_SUB = 32 "), ("SAVE = 4 ", "SAVE = 2 ")],
}
VARIANTS = {"base": [], "nochol": EDITS["nochol"], "tf32": EDITS["tf32"],
            "nochol+tf32": EDITS["nochol"] + EDITS["tf32"], "noUA": EDITS["noUA"], "nodown": EDITS["nodown"],
            "noUA+nodown": EDITS["noUA"] + EDITS["nodown"], "C32": EDITS["C32"]}


def variant_module(name: str, edits, tmp: pathlib.Path):
    src = pathlib.Path(ap.__file__).read_text()
    for a, b in edits:
        assert a in src, f"{name}: the kernel source changed, edit not found: {a!r}"
        src = src.replace(a, b)
    path = tmp / f"apath_{name.replace('+', '_')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


def main(B=16, T=2048, H=8, K=128):
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), f"B={B} T={T} H={H} K={K} fp32, forward without the backward's stores")
    gen = torch.Generator().manual_seed(0)
    kh, uh = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dev) for _ in range(2))
    A0 = (10 * torch.eye(K)).expand(B, H, K, K).contiguous().to(dev)
    tmp = pathlib.Path(tempfile.mkdtemp())
    ref = None
    print(f"{'variant':12s} warps      ms  regs spills  alpha vs base")
    for name, edits in VARIANTS.items():
        m = variant_module(name, edits, tmp)
        for warps in (4, 8):
            alpha = torch.full_like(kh, float("nan"))
            w = torch.empty(B * H * m.C_SUB, K, device=dev)                  # the forward's W scratch
            nseg = triton.cdiv(triton.cdiv(T, m.C_SUB), m.SAVE)
            kw = m._config(kh)

            def f():
                A = A0.clone()                                                 # A's buffer, overwritten
                return m._apath_fwd_kernel[(1, B * H)](kh, uh, A, alpha, alpha, alpha, w, alpha, T, H, K, nseg, 1,
                                                       nseg * m.SAVE, STORE=False, RINV=False, SAVE=m.SAVE,
                                                       BR=min(m.ROW_BLOCK, kw["BK"]), num_warps=warps, num_stages=1,
                                                       **kw)
            compiled = f()
            t = do_bench(f, warmup=5, rep=20)
            ref = alpha.clone() if ref is None else ref
            print(f"{name:12s} {warps:5d} {t:7.3f} {compiled.n_regs:5d} {compiled.n_spills:6d}  "
                  f"{float((alpha - ref).norm() / ref.norm()):.1e}", flush=True)


if __name__ == "__main__":
    main()
