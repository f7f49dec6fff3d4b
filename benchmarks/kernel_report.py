"""Compile kalmix's VLA A-path kernels for an H100 (sm_90) on a machine without a GPU and print, per kernel, the
registers and spill stores ptxas reports, the barriers (bar.sync) and warp shuffles written in the PTX (a loop's
body counts once), and the shared memory. With the GPU's triton (3.6, whose own ptxas it runs) the registers are
the GPU's and the spill stores within a few percent of its ``n_spills`` × 4 bytes (session 19: 424 B here, 106 there),
so register pressure and barriers can be compared before spending device time. From the repository root:

    pip download triton==3.6.0 --no-deps -d /tmp/t36whl && pip install --no-deps --target /tmp/t36 /tmp/t36whl/*.whl
    PYTHONPATH=/tmp/t36:$PWD python benchmarks/kernel_report.py

Integer arguments and pointers are compiled as the GPU launch specialises them (divisible by 16, NPART = 1), at the
speed harness's shape (K = 128, fp32).
"""
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kalmix.ops.vla.apath_triton as ap

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def report(label, fn, pointers, ints, constexprs, num_warps, div16):
    signature = {n: "*fp32" for n in pointers} | {n: "i32" for n in ints} | {n: "constexpr" for n in constexprs}
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=1))
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    info = out.stderr + out.stdout
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    print(f"{label:32s} warps {num_warps}  registers {regs.group(1) if regs else '?':>3s}  spill stores "
          f"{spills.group(1) if spills else '?':>5s} B  bar.sync {len(re.findall(r'bar.sync', ptx)):4d}  "
          f"shfl {len(re.findall(r'shfl.sync', ptx)):4d}  shared {kernel.metadata.shared} B", flush=True)


def main():
    print(f"triton {triton.__version__}, sm_90, VLA A path at K = 128, fp32")
    common = dict(BK=128, DT=tl.float32)
    ptrs = ["k_ptr", "u_ptr", "a_ptr", "al_ptr", "asv_ptr", "rinv_ptr", "w_ptr", "nrm_ptr"]
    for store in (True, False):
        report(f"_apath_fwd_kernel STORE={store}", ap._apath_fwd_kernel, ptrs, ["T", "H", "K", "NSEG", "SPP"],
               dict(NPART=1, STORE=store, RINV=False, SAVE=ap.SAVE, C=ap.C_SUB, BR=ap.ROW_BLOCK, **common),
               ap.WARPS["fwd"], ptrs + ["T", "K", "NSEG", "SPP"])
    blk = dict(C=ap.SAVE * ap.C_SUB, BC=ap.BLOCK_COLS, **common)
    ptrs = ["al_ptr", "asv_ptr", "w_ptr", "nrm_ptr", "dal_ptr", "dk_ptr"]
    report("_apath_bwd_b_kernel", ap._apath_bwd_b_kernel, ptrs, ["T", "H", "K", "NSEG"], blk, ap.WARPS["b"],
           ptrs + ["T", "K", "NSEG"])
    ptrs = ["u_ptr", "al_ptr", "nrm_ptr", "dk_ptr", "du_ptr"]
    report("_apath_bwd_du_kernel", ap._apath_bwd_du_kernel, ptrs, ["T", "H", "K"], blk, ap.WARPS["du"],
           ptrs + ["T", "K"])
    ptrs = ["u_ptr", "al_ptr", "nrm_ptr", "dk_ptr", "b0_ptr", "du_ptr", "tot_ptr"]
    report("_apath_carry_kernel", ap._apath_carry_kernel, ptrs, ["T", "H", "K", "NSEG", "BPP"],
           dict(NPART=1, HAS_B0=True, TOTAL=False, C=ap.SAVE * ap.C_SUB, BC=ap.CARRY_COLS, **common),
           ap.WARPS["carry"], ptrs + ["T", "K", "NSEG", "BPP"])


if __name__ == "__main__":
    main()
