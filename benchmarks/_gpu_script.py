"""Shared by the GPU check scripts: the command line (accuracy checks, then timings of each ``--configs`` entry)
and the anchor rows every timing table is read against."""
import argparse

import torch
import torch.nn.functional as F


def run(checks, timings, configs_help: str):
    """Parse ``--configs KEY=VALUE,...`` (integer values; '' = the defaults) and ``--skip-checks``, print the GPU,
    then call ``checks(device)`` (None: the script's accuracy lives in gpu_tests/) and ``timings(device, configs)``."""
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="*", default=[""], help=configs_help)
    p.add_argument("--skip-checks", action="store_true")
    a = p.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if checks is not None and not a.skip_checks:
        checks(device)
    timings(device, [{k: int(x) for k, x in (kv.split("=") for kv in c.split(",") if kv)} for c in a.configs])


def time_anchors(T, q, k, v, beta, do):
    """Print fla's chunk_delta_rule (k unit-norm) and SDPA causal on q, k, v [B, T, H, K], fwd and fwd+bwd
    (do_bench median, ms), the rows each kalmix timing is read against."""
    from fla.ops import chunk_delta_rule
    from triton.testing import do_bench
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    anchors = {"fla chunk_delta_rule": lambda: chunk_delta_rule(q, k, v, beta)[0],
               "sdpa causal": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)}
    for name, f in anchors.items():
        with torch.no_grad():
            t_f = do_bench(f)
        print(f"  T={T:5d} {name:28s} fwd {t_f:7.3f}  fwd+bwd {do_bench(lambda: f().backward(do)):7.3f}")
