"""Compile kalmix's VLA A-path kernels, the fused Kalman kernels, the Gated KalmaNet kernels and the delta rule's
_grads_qw_kernel for an H100 (sm_90) on a machine without a GPU and print, per kernel, the registers and spill stores
ptxas reports (and its warning when it serialises the kernel's wgmma instructions, which had cost the GKA adjoint
solve 0.87 ms of 1.94), the barriers (bar.sync) and warp shuffles written in the PTX (a loop's body counts once), and
the shared memory; for the Kalman kernels, whose time is instruction issue, also the SASS of the main loop (its
instructions per lane and token, and the commonest opcodes), and for GKA's solves the SASS of one Chebyshev step.
With the GPU's triton (3.6, whose own ptxas it runs) the registers are the GPU's and the spill stores within a few
percent of its ``n_spills`` × 4 bytes (the VLA forward: 424 B here, 106 spills there), so register pressure and
barriers can be compared without a GPU; what they cost is the GPU's to say (GKA variants with fewer instructions and
spill stores per step ran slower). From the repository root:

    pip download triton==3.6.0 --no-deps -d /tmp/t36whl && pip install --no-deps --target /tmp/t36 /tmp/t36whl/*.whl
    PYTHONPATH=/tmp/t36:$PWD python benchmarks/kernel_report.py [--ops vla kalman gka delta]

Integer arguments and pointers are compiled as the GPU launch specialises them (divisible by 16 but H, and GKA's
n_iters and NBK; NPART = 1), at the speed harness's shape (VLA: K = 128, fp32; Kalman: H = 1, N = 16, D = 2048, bf16
activations; GKA: K = V = 128, bf16 activations, each kernel's warps and stages from its config; delta:
_grads_qw_kernel at K = V = 128, bf16 activations, its launch's warps and stages). ``--ops limits`` prints, per
activation dtype, the largest shared memory of the kernels at each op's largest head size (the ``max_head_sizes``
the ops check), and for the chunked delta rule at twice it too, against the 227 KB an H100 gives a block.
"""
import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kalmix.ops.common.delta_triton as dt
import kalmix.ops.gka.fused as gf
import kalmix.ops.kalman.fused as kf
import kalmix.ops.vla.apath_triton as ap
from kalmix.ops.common.testing import ptxas_verbose

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(fn, constexprs, num_warps, types=None, maxnreg=None, num_stages=1, indivisible=("H",)):
    """``fn`` compiled for an H100, its signature read off its own parameters: ``*_ptr`` pointers (fp32 unless
    ``types`` says otherwise), the other non-constexpr ones i32 (unless ``types`` says otherwise), the pointers and
    i32 divisible by 16 but those named in ``indivisible`` (as the launch specialises them)."""
    names = [p.name for p in fn.params]
    types = types or {}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "*fp32" if n.endswith("_ptr") else "i32")
                 for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if (signature[n] == "i32" or signature[n].startswith("*")) and n not in indivisible}
    options = dict(num_warps=num_warps, num_stages=num_stages) | ({} if maxnreg is None else dict(maxnreg=maxnreg))
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def report(label, fn, constexprs, num_warps, types=None, maxnreg=None, lane_tokens=None, num_stages=1,
           loop_steps=None, indivisible=("H",)):
    """Compile ``fn`` (``compile_sm90``) and print its registers, spills, barriers, shuffles and shared memory.
    ``lane_tokens``: the (lane, token) steps one pass of the kernel's main loop makes per thread, to print its SASS
    instructions per lane and token; ``loop_steps``: the steps one pass makes, to print its instructions per step."""
    kernel = compile_sm90(fn, constexprs, num_warps, types, maxnreg, num_stages, indivisible)
    ptx = kernel.asm["ptx"]
    out = ptxas_verbose(ptx, "sm_90a")
    info = out.stderr + out.stdout
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    print(f"{label:32s} warps {num_warps}  registers {regs.group(1) if regs else '?':>3s}  spill stores "
          f"{spills.group(1) if spills else '?':>5s} B  bar.sync {len(re.findall(r'bar.sync', ptx)):4d}  "
          f"shfl {len(re.findall(r'shfl.sync', ptx)):4d}  shared {kernel.metadata.shared} B"
          + "".join(f"  wgmma serialized ({c})" for c in re.findall(r"\((C75\d\d)\) Potential Performance Loss", info)),
          flush=True)
    if lane_tokens or loop_steps:
        body = _main_loop(kernel.asm["cubin"])
        ops = collections.Counter(op for op in body)
        per = f"{len(body) / lane_tokens:.1f} per lane and token" if lane_tokens else \
            f"{len(body) / loop_steps:.0f} per step"
        print(f"{'':32s} main loop: {len(body)} SASS instructions, {per}; "
              + ", ".join(f"{op} {n}" for op, n in ops.most_common(10)), flush=True)


def _main_loop(cubin):
    """The opcodes of the longest loop in the SASS (the span from a backward branch's target to the branch)."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True).stdout
    code = [re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()]
    code = [(int(m.group(1), 16), m.group(2)) for m in code if m]
    where = {addr: i for i, (addr, _) in enumerate(code)}
    best = []
    for i, (addr, text) in enumerate(code):
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr and int(target.group(1), 16) in where:
            body = code[where[int(target.group(1), 16)]:i + 1]
            best = body if len(body) > len(best) else best
    return [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for _, text in best]


def vla():
    print(f"triton {triton.__version__}, sm_90, VLA A path at K = 128, fp32")
    common = dict(BK=128, DT=tl.float32)
    for store in (True, False):
        report(f"_apath_fwd_kernel STORE={store}", ap._apath_fwd_kernel,
               dict(NPART=1, STORE=store, RINV=False, SAVE=ap.SAVE, C=ap.C_SUB, BR=ap.ROW_BLOCK, **common),
               ap.WARPS["fwd"])
    blk = dict(C=ap.SAVE * ap.C_SUB, BC=ap.BLOCK_COLS, **common)
    report("_apath_bwd_b_kernel", ap._apath_bwd_b_kernel, blk, ap.WARPS["b"])
    report("_apath_bwd_du_kernel", ap._apath_bwd_du_kernel, blk, ap.WARPS["du"])
    report("_apath_carry_kernel", ap._apath_carry_kernel,
           dict(NPART=1, HAS_B0=True, TOTAL=False, C=ap.SAVE * ap.C_SUB, BC=ap.CARRY_COLS, **common),
           ap.WARPS["carry"])


def kalman():
    print(f"triton {triton.__version__}, sm_90, fused Kalman kernels at H = 1, N = 16, D = 2048, bf16 activations")
    shape = dict(H=1, N=16, D=2048, BN=16, C=kf.CHUNK, EVEN=True, ACC=tl.float32)
    bf16 = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "w_ptr", "o_ptr", "var_ptr", "do_ptr", "dvar_ptr")}
    types = bf16 | {"cu_ptr": "*i32", "chunk_ptr": "*i32"}
    bd, warps = kf.FWD_CONFIG
    for save in (True, False):
        report(f"_kalman_fwd_kernel SAVE={save}", kf._kalman_fwd_kernel, dict(BD=bd, HAS_VAR=False, SAVE=save, **shape),
               warps, types, kf.FWD_MAXNREG, kf.CHUNK * 16 * bd // (32 * warps))
    bd1, bd2, warps = kf.BWD_CONFIG
    report("_kalman_bwd_kernel", kf._kalman_bwd_kernel,
           dict(BD1=bd1, BD2=bd2, HAS_DVAR=False, HAS_DFINAL=True, **shape), warps, types,
           lane_tokens=kf.CHUNK * 16 * bd1 * bd2 // (32 * warps))


def gka():
    print(f"triton {triton.__version__}, sm_90, Gated KalmaNet kernels at K = V = 128, bf16 activations")
    bf16 = ("q", "k", "v", "h", "u", "o", "do", "dq", "dh", "du", "dv", "dk")
    types = {f"{n}_ptr": "*bf16" for n in bf16} | {f"{n}_ptr": "*i32" for n in ("cu", "coff", "chunks")}
    types["scale"] = "fp32"
    _, _, kw = gf._launch(torch.bfloat16, 128, 128)
    BD = gf.CONFIGS[16]["BV"]
    for name, fn, extra, loop in (
            ("states", gf._states_kernel, dict(BD=BD), None),
            ("fwd", gf._fwd_kernel, dict(BV=BD, SOLVE=True, STORE=True), 1),
            ("solve_bwd", gf._solve_bwd_kernel, dict(BV=BD, SOLVE=True, TAIL=True), 1),
            ("solve_tail", gf._solve_tail_kernel, {}, None),
            ("dstates", gf._dstates_kernel, dict(BD=BD, SOLVE=True, HAS_DST=True), None),
            ("grads_u", gf._grads_u_kernel, dict(BV=BD, SOLVE=True), None),
            ("grads_h", gf._grads_h_kernel, dict(SOLVE=True), None)):
        opts = dict(kw[name])
        warps, stages = opts.pop("num_warps"), opts.pop("num_stages")
        report(f"_{name}_kernel", fn, opts | extra, warps, types, num_stages=stages, loop_steps=loop,
               indivisible=("H", "n_iters", "NBK"))            # H = 8, 30 steps, NBK = 2 column blocks


def delta():
    print(f"triton {triton.__version__}, sm_90, the delta-rule chunk kernels' _grads_qw_kernel at K = V = 128, bf16 "
          "activations (ptxas serialises its wgmma: kalmix/ops/kaczmarz/README.md)")
    names = ("q", "w", "g", "beta", "h", "dh", "u", "du", "do", "dq", "dw", "dwt")
    types = {f"{n}_ptr": "*bf16" for n in names} | {"chunks_ptr": "*i32", "dG_ptr": "*fp32", "scale": "fp32"}
    opts = dict(dt._launch(torch.bfloat16, 128, 128)["grads_qw"])
    warps, stages = opts.pop("num_warps"), opts.pop("num_stages")
    report("_grads_qw_kernel", dt._grads_qw_kernel, opts, warps, types, num_stages=stages)


H100_SHARED = 232448        # bytes of shared memory an H100 gives one block (227 KB)
_PTR = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float64: "*fp64"}


def _max_shared(label, kernels, dtype):
    """Compile each (name, fn, constexprs, warps, stages) of ``kernels`` with the tensors of ``dtype`` (fp64 runs
    keep every tensor fp64) and print the largest shared memory against the H100's; stops at the first kernel
    above it. Returns whether every kernel fits."""
    ty = _PTR[dtype]
    worst = ("", 0)
    for name, fn, constexprs, warps, stages in kernels:
        types = {p.name: ty for p in fn.params if p.name.endswith("_ptr")}
        types |= {n: "*i32" for n in ("cu_ptr", "coff_ptr", "chunks_ptr")}
        if dtype != torch.float64:      # the gates, states and their gradients: fp32
            types |= {n: "*fp32" for n in types if n.split("_ptr")[0] in (
                "g", "beta", "alpha", "Gc", "s0", "sT", "ds0", "dsT", "dG", "dg", "dbeta", "step", "ext", "h0", "u0",
                "hT", "uT", "dh0", "du0", "dhT", "duT", "coef", "x", "hn", "dalpha", "y", "c", "m", "khk", "dgam",
                "dkp", "e", "dGp", "dbp", "dge")}
        types |= {n: "fp64" if dtype == torch.float64 else "fp32" for n in ("scale", "step_eps")}
        shared = compile_sm90(fn, constexprs, warps, types, num_stages=stages).metadata.shared
        worst = max(worst, (name, shared), key=lambda x: x[1])
        if shared > H100_SHARED:
            break
    fits = worst[1] <= H100_SHARED
    print(f"{label:44s} largest shared memory {worst[1] / 1024:6.1f} KB ({worst[0]}): "
          f"{'fits' if fits else 'does not fit'} an H100's {H100_SHARED / 1024:.0f} KB", flush=True)
    return fits


def _delta_kernels(dtype, K, narrow):
    """The chunked delta rule's kernels at head size K (V = 128) with the launches the op gives them."""
    kws = dt._launch(dtype, K, 128, narrow)
    flags = dict(prep=dict(STEP=True, CHECK=True), states=dict(HAS_S0=True), dstates=dict(HAS_DST=True, HAS_DS0=True),
                 grads_wy=dict(STEP=False))
    order = ("states", "dstates", "output", "grads_wy", "grads_qw", "prep", "dv_local")      # the largest first
    out = []
    for name in order[:2] if narrow else order:
        kw = dict(kws[name])
        warps, stages = kw.pop("num_warps"), kw.pop("num_stages")
        out.append((name, getattr(dt, f"_{name}_kernel"), kw | flags.get(name, {}), warps, stages))
    return out


def _gka_kernels(dtype, K):
    BK, BD, kws = gf._launch(dtype, K, K)
    out = []
    for name, extra in (("states", dict(BD=BD)), ("fwd", dict(BV=BD, SOLVE=True, STORE=True)),
                        ("solve_bwd", dict(BV=BD, SOLVE=True, TAIL=True)), ("solve_tail", {}),
                        ("dstates", dict(BD=BD, SOLVE=True, HAS_DST=True)), ("grads_u", dict(BV=BD, SOLVE=True)),
                        ("grads_h", dict(SOLVE=True))):
        kw = dict(kws[name])
        warps, stages = kw.pop("num_warps"), kw.pop("num_stages")
        out.append((name, getattr(gf, f"_{name}_kernel"), kw | extra, warps, stages))
    return out


def _vla_kernels(dtype, K):
    BK = max(16, triton.next_power_of_2(K))
    common = dict(BK=BK, DT=tl.float64 if dtype == torch.float64 else tl.float32)
    blk = dict(C=ap.SAVE * ap.C_SUB, **common)
    bc, cc = min(ap.BLOCK_COLS, BK), min(ap.CARRY_COLS, BK)
    return [("fwd", ap._apath_fwd_kernel, dict(NPART=1, STORE=True, RINV=True, SAVE=ap.SAVE, C=ap.C_SUB,
                                               BR=min(ap.ROW_BLOCK, BK), **common), ap._warps("fwd", BK), 1),
            ("b", ap._apath_bwd_b_kernel, dict(blk, BC=bc), ap._warps("b", BK), 1),
            ("du", ap._apath_bwd_du_kernel, dict(blk, BC=bc), ap._warps("du", BK), 1),
            ("carry", ap._apath_carry_kernel, dict(blk, NPART=1, HAS_B0=True, TOTAL=False, BC=cc),
             ap._warps("carry", cc), 1),
            ("da0", ap._apath_da0_kernel, dict(HAS_DAT=True, C=ap.C_SUB, **common), ap._warps("da0", BK), 1)]


def limits():
    """The head-size limits the ops check (``max_head_sizes``) against the kernels' shared memory: the chunked
    delta rule's kernels fit an H100 at their MAX_K and not at twice it, per activation dtype (both launches of the
    sequential kernels for 16-bit); GKA's and the VLA A path's fit at their MAX_K (their register tiles)."""
    print(f"triton {triton.__version__}, sm_90: shared memory per block at each op's largest head size")
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        K = dt.MAX_K[dtype]
        for narrow in (False, True) if dtype.itemsize == 2 else (False,):
            tag = " narrow" if narrow else ""
            _max_shared(f"delta rule {str(dtype)[6:]} K = {K}{tag}", _delta_kernels(dtype, K, narrow), dtype)
        _max_shared(f"delta rule {str(dtype)[6:]} K = {2 * K} (refused)", _delta_kernels(dtype, 2 * K, False),
                    dtype)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        _max_shared(f"gated_kalmanet {str(dtype)[6:]} K = {gf.MAX_K}", _gka_kernels(dtype, gf.MAX_K), dtype)
    for dtype in (torch.float32, torch.float64):
        _max_shared(f"VLA A path {str(dtype)[6:]} K = {ap.MAX_K}", _vla_kernels(dtype, ap.MAX_K), dtype)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", choices=["vla", "kalman", "gka", "delta", "limits"],
                        default=["vla", "kalman", "gka", "delta"])
    for op in parser.parse_args().ops:
        {"vla": vla, "kalman": kalman, "gka": gka, "delta": delta, "limits": limits}[op]()


if __name__ == "__main__":
    main()
