"""The command line of the GPU check scripts: accuracy checks, then timings of each ``--configs`` entry."""
import argparse

import torch


def run(checks, timings, configs_help: str):
    """Parse ``--configs KEY=VALUE,...`` (integer values; '' = the defaults) and ``--skip-checks``, print the GPU,
    then call ``checks(device)`` and ``timings(device, configs)``."""
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="*", default=[""], help=configs_help)
    p.add_argument("--skip-checks", action="store_true")
    a = p.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if not a.skip_checks:
        checks(device)
    timings(device, [{k: int(x) for k, x in (kv.split("=") for kv in c.split(",") if kv)} for c in a.configs])
