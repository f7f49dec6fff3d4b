"""Shared by the GPU check scripts: the command line (accuracy checks, then timings of each ``--configs`` entry)
and the anchor rows every timing table is read against."""
import argparse

import torch
import torch.nn.functional as F


def cuda_device(prog: str) -> torch.device:
    """The CUDA device the scripts time; without one, the script ends with a one-line message (exit status 1), as
    benchmarks/op_profile.py does."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{prog}: error: times CUDA kernels, and this machine has no CUDA device")
    return torch.device("cuda")


def _config(text: str) -> dict:
    """One ``--configs`` entry, ``KEY=VALUE,...`` with integer values ('' = the defaults), as a dict."""
    config = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            number = int(value)
        except ValueError:
            number = None
        if not key or number is None:
            raise argparse.ArgumentTypeError(f"{item!r} of {text!r} is not KEY=VALUE with a whole number VALUE")
        config[key] = number
    return config


def run(checks, timings, configs_help: str, argv=None):
    """Parse ``--configs KEY=VALUE,...`` (integer values; '' = the defaults) and ``--skip-checks``, print the GPU,
    then call ``checks(device)`` (None: the script's accuracy lives in gpu_tests/) and ``timings(device, configs)``.
    A bad entry or a machine without CUDA ends the script with a one-line message."""
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="*", type=_config, default=[{}], help=configs_help)
    p.add_argument("--skip-checks", action="store_true")
    a = p.parse_args(argv)
    device = cuda_device(p.prog)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if checks is not None and not a.skip_checks:
        checks(device)
    timings(device, a.configs)


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
