"""Check every op's parallel impl on the current device against the fp64 token loop on the CPU.

Outputs, final states and the gradients of a random functional of all of them, in fp64 and fp32, at
B=2, T=300, H=4, K=32, V=48. Run on a GPU machine from the repository root:

    python benchmarks/check_impls.py --device cuda --impl torch
"""
import argparse

import torch

from kalmix.bench.checks import check_impl
from kalmix.ops import SPECS
from kalmix.ops.common.checks import check_device
from kalmix.ops.common.testing import outputs_and_grads, rel_err


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="check_impls.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device to test")
    parser.add_argument("--impl", default="torch", choices=sorted({i for s in SPECS.values() for i in s.impls}),
                        help="impl to test against the naive fp64 loop")
    args = parser.parse_args(argv)
    try:
        dev = check_device(args.device)
        check_impl(args.impl, dev)
    except ValueError as e:
        parser.error(str(e))
    print(torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch", torch.__version__)
    print(f"{'op':9s} {'dtype':14s} {'outputs':>9s} {'grads':>9s}   (max relative RMS error vs fp64 loop)")
    for name, case in SPECS.items():
        gen = torch.Generator().manual_seed(0)
        inputs = case.inputs(2, 300, 4, 32, 48, torch.float64, gen)
        state = case.random_state(2, 4, 32, 48, torch.float64, gen)
        ref_out, ref_grad = outputs_and_grads(case, inputs, state, "naive")
        for dt in (torch.float64, torch.float32):
            x = [t.to(dev, dt) for t in inputs]
            s = tuple(t.to(dev, dt) for t in state) if isinstance(state, tuple) else state.to(dev, dt)
            out, grad = outputs_and_grads(case, x, s, args.impl)
            e_out = max(rel_err(o.cpu(), r) for o, r in zip(out, ref_out))
            e_grad = max(rel_err(g.cpu(), r) for g, r in zip(grad, ref_grad))
            print(f"{name:9s} {str(dt):14s} {e_out:9.1e} {e_grad:9.1e}")


if __name__ == "__main__":
    main()
