"""Context parallelism on GPUs over NCCL, one process per GPU (``torchrun --nproc-per-node N``):

    torchrun --nproc-per-node 4 gpu_tests/cp_nccl.py check      # CP equal to one device (fp32 and bf16)
    torchrun --nproc-per-node 4 gpu_tests/cp_nccl.py speed [T] [MODELS]   # a training step at T tokens, 1 GPU vs N
    python gpu_tests/cp_nccl.py table docs/results/multigpu/cp_speed.jsonl     # the markdown table of speed's rows

``check``: every kalmix mixer, the baselines and a GDN + attention hybrid, each rank's piece of a [2, 2048]
batch through ``context_parallel_model`` (relay, and combine for the affine ops) on the Triton path, against the
whole batch on one device: logits, loss and the summed parameter gradients (all parameters' gradients as one
vector; the worst single parameter is printed beside), relative error ≤ 1e-5 in fp32
(matmuls without TF32); the hybrid also in bf16 through the flash kernel (≤ 2e-2). ``speed``: forward + backward
+ the gradient all-reduce of an 8-layer d_model 1024 model (bf16 autocast) on one sequence of T tokens, on rank
0 alone and then split over all ranks; prints a table and appends JSON rows to ``$OUT``/cp_speed.jsonl if set
(stamped with ``$KALMIX_COMMIT``).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from kalmix.distributed import context_parallel_model
from kalmix.models import KalmixConfig, KalmixForCausalLM

KW = {"gdn": {"num_heads": 4}, "kaczmarz": {"num_heads": 4}, "gka": {"num_heads": 4}, "vla": {"num_heads": 4},
      "kalman": {"d_state": 16, "num_heads": 4}, "attention": {"num_heads": 4}, "linear_attention": {"num_heads": 4},
      "gla": {"num_heads": 4}, "mamba2": {"d_state": 16, "head_dim": 64}}
MODELS = {"gdn": ["gdn"] * 2, "kaczmarz": ["kaczmarz"] * 2, "gka": ["gka"] * 2, "vla": ["vla"] * 2,
          "kalman": ["kalman"] * 2, "hybrid": ["gdn", "attention"], "baselines": ["linear_attention", "gla", "mamba2"]}
COMBINE = ("kaczmarz", "gka", "baselines")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def model_of(mixers, d=256, vocab=512, **kw):
    torch.manual_seed(0)
    cfg = KalmixConfig(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=len(mixers),
                       mixers=mixers, mixer_kwargs={m: KW[m] for m in set(mixers)}, **kw)
    return KalmixForCausalLM(cfg).cuda()


def check(rank, world):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    B, T = 2, 2048
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (B, T), generator=gen).cuda()
    piece = T // world
    cut = slice(rank * piece, (rank + 1) * piece)
    cases = [(n, "relay", None) for n in MODELS] + [(n, "combine", None) for n in COMBINE] + \
            [("hybrid", "relay", torch.bfloat16)]
    worst = 0.0
    failed = []
    for name, mode, dtype in cases:
        model = model_of(MODELS[name])
        params = [p for p in model.parameters() if p.requires_grad]
        ctx = torch.autocast("cuda", dtype=dtype) if dtype else torch.autocast("cuda", enabled=False)
        with ctx:
            ref = model(input_ids=ids, labels=ids, use_cache=False)
        ref_grads = torch.autograd.grad(ref.loss, params)
        with ctx, context_parallel_model(model, mode=mode):
            out = model(input_ids=ids[:, cut], labels=ids[:, cut])
        grads = torch.autograd.grad(out.loss, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        for g in grads:
            dist.all_reduce(g)
        logits = [torch.empty_like(out.logits) for _ in range(world)]
        dist.all_gather(logits, out.logits.contiguous())
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        per = {n: rel(g, r) for n, g, r in zip(names, grads, ref_grads)}
        worst_param = max(per, key=per.get)
        errs = {"logits": rel(torch.cat(logits, 1), ref.logits), "loss": rel(loss, ref.loss.detach()),
                "grads": rel(torch.cat([g.flatten() for g in grads]), torch.cat([r.flatten() for r in ref_grads])),
                "worst param": per[worst_param]}
        tol = 2e-2 if dtype else 1e-5
        label = f"{name} {mode} {'bf16 flash' if dtype else 'fp32'}"
        if rank == 0:
            print(f"cp check world {world}: {label:24s} " + " ".join(f"{k} {v:.1e}" for k, v in errs.items())
                  + f" ({worst_param})", flush=True)
        judged = [errs["logits"], errs["loss"], errs["grads"]]
        if max(judged) > tol or any(v != v for v in errs.values()):
            failed.append(label)
        if not dtype:
            worst = max(worst, *judged)
        del model
    if rank == 0:
        print(f"cp check world {world}: worst fp32 error {worst:.1e}; failed: {failed or 'none'}", flush=True)
    return not failed


def step_time(model, ids, reps, split=False):
    """Median ms of forward + backward (+ the gradient all-reduce when split) under bf16 autocast."""
    times = []
    params = [p for p in model.parameters() if p.requires_grad]
    for i in range(reps + 2):
        torch.cuda.synchronize()
        if split:
            dist.barrier()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if split:
                with context_parallel_model(model):
                    loss = model(input_ids=ids, labels=ids).loss
            else:
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if split:                                   # one flat all-reduce of every gradient, as DDP's buckets
            have = [p for p in params if p.grad is not None]
            flat = torch.cat([p.grad.flatten() for p in have])
            dist.all_reduce(flat)
            for p, g in zip(have, flat.split([p.numel() for p in have])):
                p.grad.copy_(g.view_as(p))
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
        model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


def speed(rank, world, T=65536, only=None, reps=3):
    configs = {"hybrid gdn+attn/4": ["gdn", "gdn", "gdn", "attention"] * 2, "gdn": ["gdn"] * 8,
               "attention": ["attention"] * 8, "kaczmarz": ["kaczmarz"] * 8, "gka": ["gka"] * 8,
               "kalman": ["kalman"] * 8}
    kw = {"gdn": {"num_heads": 8}, "kaczmarz": {"num_heads": 8}, "gka": {"num_heads": 8},
          "attention": {"num_heads": 8}, "kalman": {"d_state": 16, "num_heads": 8, "expand": 1}}
    rows = []
    for name, mixers in configs.items():
        if only and name.split()[0] not in only:
            continue
        torch.manual_seed(0)
        cfg = KalmixConfig(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, mixers=mixers,
                           mixer_kwargs={m: kw[m] for m in set(mixers)})
        model = KalmixForCausalLM(cfg).cuda()
        ids = torch.randint(0, 32000, (1, T), generator=torch.Generator().manual_seed(0)).cuda()
        one = None
        if rank == 0:
            torch.cuda.reset_peak_memory_stats()
            try:
                one = step_time(model, ids, reps)
                mem1 = torch.cuda.max_memory_allocated() / 2**30
            except torch.OutOfMemoryError:
                one, mem1 = float("nan"), float("nan")
            torch.cuda.empty_cache()
        dist.barrier()
        torch.cuda.reset_peak_memory_stats()
        piece = T // world
        try:
            many = step_time(model, ids[:, rank * piece:(rank + 1) * piece], reps, split=True)
            memn = torch.cuda.max_memory_allocated() / 2**30
        except torch.OutOfMemoryError:
            many, memn = float("nan"), float("nan")
        if rank == 0:
            row = {"model": name, "T": T, "gpus": world, "commit": os.environ.get("KALMIX_COMMIT", "unknown"), "ms_1gpu": one, "ms_cp": many, "speedup": one / many,
                   "mem_1gpu_gib": mem1, "mem_cp_gib": memn, "gpu": torch.cuda.get_device_name()}
            rows.append(row)
            print(f"cp speed {name:18s} T={T} 1 GPU {one:8.1f} ms {mem1:5.1f} GiB | {world} GPUs {many:8.1f} ms "
                  f"{memn:5.1f} GiB | speed-up {one / many:.2f}x", flush=True)
        del model
        torch.cuda.empty_cache()
    if rank == 0 and os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "cp_speed.jsonl"), "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def table(path: str) -> str:
    """The markdown table of ``speed``'s JSON rows."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    lines = ["| model | T | GPUs | 1 GPU (ms) | CP (ms) | speed-up | memory 1 GPU / CP per GPU (GiB) |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["model"], r["gpus"])):
        lines.append(f"| {r['model']} | {r['T']:,} | {r['gpus']} | {r['ms_1gpu']:.0f} | {r['ms_cp']:.0f} | "
                     f"{r['speedup']:.2f}× | {r['mem_1gpu_gib']:.1f} / {r['mem_cp_gib']:.1f} |")
    stamps = sorted({(r["commit"], r["gpu"]) for r in rows})
    return "\n".join(lines + ["", "Measured at " + "; ".join(f"commit {c} on {g}" for c, g in stamps) + "."])


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "check"
    if what == "table":
        print(table(sys.argv[2]))
        return
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    ok = True
    try:
        if what == "check":
            ok = check(rank, world)
        elif what == "speed":
            speed(rank, world, T=int(sys.argv[2]) if len(sys.argv) > 2 else 65536,
                  only=sys.argv[3].split(",") if len(sys.argv) > 3 else None)
        else:
            raise SystemExit(f"cp_nccl.py: unknown command {what!r}; use check or speed")
    finally:
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
