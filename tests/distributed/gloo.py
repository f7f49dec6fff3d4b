"""One gloo process group per world size that runs a file's named cases on every rank and reports per case."""
from __future__ import annotations

import datetime
import json
import os
import tempfile
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, cases: Callable[[], dict], store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))    # a hang fails instead of stalling the suite
    results = {}
    try:
        for name, case in cases().items():
            try:
                results[name] = case(rank, world)
            except Exception as e:           # reported per case; a rank that fails alone times the others out
                results[name] = f"rank {rank}: {type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def run_cases(world: int, cases: Callable[[], dict]) -> dict:
    """Spawn ``world`` gloo ranks; each runs every ``case(rank, world)`` of ``cases()`` (a module-level function
    returning {name: case}); returns rank 0's {name: "ok" or what went wrong}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.spawn(_worker, args=(world, cases, os.path.join(tmp, "store"), out), nprocs=world)
        with open(out) as f:
            return json.load(f)
