"""The training loop of `kalmix train`: one process, or N under torchrun with DDP or FSDP2, optionally with context
parallelism (``train.context_parallel`` = C: groups of C consecutive processes each hold one row split in C equal
pieces, ``kalmix.distributed.context_parallel_model``; the world's gradients are averaged as under plain DDP / FSDP2,
which with every piece's loss scaled alike gives the global batch's token mean).

A run owns its ``run_dir`` for its life (``checkpoint.DirLock``; under torchrun rank 0 holds it); SIGINT and
SIGTERM stop it after the current optimizer step with a checkpoint (``TrainingInterrupted``); what a resumed run
may change is in ``kalmix.train.config``'s docstring.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from kalmix.bench.models import lm_flops_per_token
from kalmix.bench.speed import versions
from kalmix.distributed import context_parallel_model
from kalmix.layers.common import upcast
from kalmix.models import KalmixForCausalLM
from kalmix.ops.common.varlen import offsets_from_host
from kalmix.train import checkpoint as ckpt
from kalmix.train.config import TrainConfig, describe_changes, resume_changes
from kalmix.train.data import (DataConfig, atomic_write, files_fingerprint, is_saved_dataset,
                               source_fingerprint)
from kalmix.train.optim import Optimization, evaluating

# dense bf16 tensor-core peaks (TFLOP/s) of the GPUs MFU is reported for; others: log.peak_tflops
_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """FLOP/s that MFU is read against: ``override_tflops``, else the bf16 dense peak of a known GPU (None on CPU or
    an unknown GPU)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((t * 1e12 for key, t in _PEAK_TFLOPS.items() if key in name), None)


# CPU runs of models below this many parameters take one thread (see cpu_threads)
SMALL_MODEL_PARAMS = 20_000_000


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run. ``step``: the step whose checkpoint was written (None: no checkpoint was
    written now, e.g. the signal came before the first step or a second one came while stopping); ``exit_code``:
    128 + the signal's number (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int, step: int | None = None, checkpoint: Path | None = None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        if checkpoint is None:
            msg = (f"interrupted ({name}); no checkpoint was written now; rerun the same command to continue from "
                   f"the newest checkpoint, if any")
        else:
            msg = (f"interrupted ({name}) at step {step}; checkpoint written to {checkpoint}; rerun the same "
                   f"command to resume")
        super().__init__(msg)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _Signals:
    """SIGINT / SIGTERM handlers for a run (main thread only; the previous handlers come back on exit). Until
    ``defer()`` a signal raises TrainingInterrupted at once (the ``finally`` blocks remove what was half-written);
    after it, the first signal is noted in ``signum`` for the loop to stop after its step, and a second one raises
    at once."""

    def __init__(self):
        self.signum: int | None = None
        self._deferred = False
        self._previous: dict = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def defer(self) -> None:
        self._deferred = True

    def _handle(self, signum, frame) -> None:
        if self._deferred and self.signum is None:
            self.signum = signum
            return
        raise TrainingInterrupted(signum)


class Dist:
    """This process's place in the run: rank, world size, device; torchrun's environment starts a process group
    (NCCL on CUDA, gloo on CPU). A device that is not there is a ValueError naming it."""

    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device is visible"
                raise ValueError(f"train.device = {device}, but CUDA is not available ({build}); use cpu or auto")
            if device != "cuda" and self.world > 1:
                raise ValueError(f"train.device = {device} under torchrun would put every process on one GPU; use "
                                 f"cuda (each process its local GPU)")
            index = local if device == "cuda" else int(device.split(":")[1])
            if index >= torch.cuda.device_count():
                raise ValueError(f"train.device = {device}: process {self.rank} needs CUDA device {index}, and "
                                 f"{torch.cuda.device_count()} are visible")
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        else:
            self.device = torch.device(device)
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        # host values (token counts, stop signals, evaluation sums) are summed over gloo on the CPU: no device copy,
        # so the host never waits for the GPU's queue to drain
        self.host_group = dist.new_group(backend="gloo") if self.world > 1 else None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    def sum(self, *values: float | torch.Tensor) -> list[float]:
        """Sum host scalars (numbers or CPU tensors) over the processes: one gloo collective on the CPU."""
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(()) for v in values])
        if t.device.type != "cpu":
            raise ValueError(f"Dist.sum takes host values; got a tensor on {t.device} (all-reduce it on the device)")
        if self.world > 1:
            dist.all_reduce(t, group=self.host_group)
        return t.tolist()

    def broadcast(self, obj):
        """Rank 0's ``obj`` (picklable) on every process."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self):
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def cpu_threads(cfg: TrainConfig, env: Dist, n_params: int) -> int:
    """Set and return torch's CPU threads for this process: ``train.threads`` when given; else, when
    OMP_NUM_THREADS is set, what torch took from it; else on CPU 1 for models under SMALL_MODEL_PARAMS parameters
    (their ops are too small to share out, and on a busy machine threads spin waiting for each other: cpu-tiny,
    0.7M parameters, trained at about 4,000 tokens/s with one thread and 120 with torch's default two on a shared
    2-core machine) and otherwise the CPUs this process may run on (``os.sched_getaffinity``) shared among the
    processes of this machine; on CUDA torch's default."""
    if cfg.train.threads is not None:
        torch.set_num_threads(cfg.train.threads)
    elif "OMP_NUM_THREADS" not in os.environ and env.device.type == "cpu":
        share = max(1, len(os.sched_getaffinity(0)) // env.local_world)
        torch.set_num_threads(1 if n_params < SMALL_MODEL_PARAMS else share)
    return torch.get_num_threads()


@contextlib.contextmanager
def third_party_progress(enabled: bool, datasets: bool = False):
    """With ``enabled`` False, no progress bars of transformers and the HF hub (and of ``datasets`` when it reads
    the source) while the block runs; the previous settings come back after it."""
    if enabled:
        yield
        return
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging
    restore = []
    if hf_logging.is_progress_bar_enabled():
        hf_logging.disable_progress_bar()
        restore.append(hf_logging.enable_progress_bar)
    if not are_progress_bars_disabled():
        disable_progress_bars()
        restore.append(enable_progress_bars)
    if datasets:
        import datasets as ds
        if ds.is_progress_bar_enabled():
            ds.disable_progress_bars()
            restore.append(ds.enable_progress_bars)
    try:
        yield
    finally:
        for undo in restore:
            undo()


def _reads_datasets(d: DataConfig) -> bool:
    """Whether the source is a datasets.save_to_disk folder (read with the datasets package)."""
    return d.format == "datasets" or (d.format == "auto" and is_saved_dataset(Path(d.source).expanduser()))


def data_cache_dir(cfg: TrainConfig) -> Path:
    """``data_dir``, or by default ``runs/data/<key>``: the key hashes the data and tokenizer settings and the
    content they read, as the paths, sizes and modification times of the source files and of the tokenizer.path
    folder (``data.files_fingerprint``; no file is read). A source that gains or changes a file therefore gets a
    new cache (the old one stays until deleted), and runs of the same data share one."""
    if cfg.data_dir:
        return Path(cfg.data_dir)
    content = {"source": source_fingerprint(cfg.data)}
    if cfg.tokenizer.path is not None:
        folder = Path(cfg.tokenizer.path)
        content["tokenizer"] = files_fingerprint(sorted(p for p in folder.rglob("*") if p.is_file()))
    key = json.dumps({"data": cfg.data.model_dump(), "tokenizer": cfg.tokenizer.model_dump(), **content},
                     sort_keys=True)
    return Path("runs/data") / hashlib.sha256(key.encode()).hexdigest()[:12]


def prepare_data(cfg: TrainConfig, env: Dist, root: Path, resumed: bool = False):
    """Tokenizer and shards in ``root`` (made by the first process under root's lock, which another run preparing
    the same folder waits for; read by all, and without the lock once complete, so a prepared folder may be
    read-only): -> (tokenizer, shards dir). A resumed run reads the shards already in ``root`` as they are (the
    checkpoint's loader state checks that they are the data the run started on), so a source edited since does not
    stop it; the tokenizer must still be the one they were made with."""
    from kalmix.train import data, tokenizer as tk
    tok_dir = Path(cfg.tokenizer.path) if cfg.tokenizer.path else root / "tokenizer"
    shards = root / "shards"
    if env.main:
        complete = (shards / "meta.json").is_file() and (tok_dir / "tokenizer.json").is_file()
        with contextlib.nullcontext() if complete else ckpt.DirLock(root, wait=True, what="data_dir"):
            if resumed and (shards / "meta.json").is_file():
                made_with = json.loads((shards / "meta.json").read_text())["fingerprint"]["tokenizer"]
                if tk.tokenizer_fingerprint(tk.load_tokenizer(tok_dir)) != made_with:
                    raise ValueError(f"the tokenizer in {tok_dir} is not the one the run's shards in {shards} "
                                     f"were made with; restore it")
            else:
                if cfg.tokenizer.path is None and not (tok_dir / "tokenizer.json").is_file():
                    tk.train_tokenizer(data.iter_documents(cfg.data, split="train"), cfg.tokenizer.vocab_size,
                                       tok_dir, progress=cfg.log.progress)
                try:
                    data.prepare(cfg.data, tk.load_tokenizer(tok_dir), shards, progress=cfg.log.progress)
                except data.StaleDataset as e:
                    if not cfg.data_dir:
                        raise
                    raise data.StaleDataset(f"{e} (it is data_dir = {cfg.data_dir}: set another data_dir, or "
                                            f"leave it unset to keep one cache per content of the data)") from None
    env.barrier()
    return tk.load_tokenizer(tok_dir), shards


def build_model(cfg: TrainConfig, vocab_size: int) -> KalmixForCausalLM:
    return KalmixForCausalLM(cfg.model.kalmix_config(vocab_size))


def activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each block of ``model`` (any transformers model that supports it) in the backward instead of
    keeping its activations: ``train.activation_checkpointing`` (non-reentrant checkpoints)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def model_vocab(cfg: TrainConfig, tokenizer_vocab: int) -> int:
    """model.vocab_size, or the tokenizer's rounded up to a multiple of 64; an error if the tokenizer's ids do not
    fit."""
    if cfg.model.vocab_size is None:
        return -(-tokenizer_vocab // 64) * 64
    if cfg.model.vocab_size < tokenizer_vocab:
        raise ValueError(f"model.vocab_size = {cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
                         f"({tokenizer_vocab} ids): its ids would not fit the embedding")
    return cfg.model.vocab_size


@dataclass
class Resume:
    """Where a run continues: the newest checkpoint, its metadata, the config changes that apply (key, old, new),
    and whether the run was complete at that step with nothing more to do."""

    checkpoint: Path
    meta: dict
    changes: list
    complete: bool

    @property
    def step(self) -> int:
        return self.meta["step"]


def resume_point(cfg: TrainConfig) -> Resume | None:
    """The checkpoint of ``cfg.run_dir`` the run continues from (None: a new run), checked against ``cfg`` by the
    rules of ``kalmix.train.config`` before anything is built: a ValueError names the keys that cannot change
    (old → new) or a ``train.steps`` below the checkpoint's; a CheckpointError a foreign or corrupt checkpoint."""
    run_dir = Path(cfg.run_dir)
    existing = ckpt.checkpoints(run_dir)
    if cfg.resume == "never" and existing:
        raise ValueError(f"{run_dir} already holds checkpoints ({existing[-1].name}) and resume = never: "
                         f"choose another run_dir, or resume = auto")
    if cfg.resume == "required" and not existing:
        raise ValueError(f"resume = required, but {run_dir} holds no checkpoint")
    if not existing:
        return None
    path = existing[-1]
    meta = ckpt.read_meta(path)
    refused, applied = resume_changes(meta["config"], cfg)
    if refused:
        raise ValueError(f"cannot resume from {path}: a run in progress cannot change "
                         f"{describe_changes(refused)}; restore them, or choose another run_dir for a new run")
    if cfg.train.steps < meta["step"]:
        raise ValueError(f"train.steps = {cfg.train.steps} is fewer than the {meta['step']} steps done ({path}); "
                         f"set train.steps >= {meta['step']} to continue this run, or choose another run_dir")
    complete = (meta.get("complete", False) and cfg.train.steps == meta["step"]
                and (run_dir / "model" / "config.json").is_file())
    return Resume(path, meta, applied, complete)


def run_data_dir(cfg: TrainConfig, resume: Resume | None) -> Path:
    """The data folder of the run: ``data_dir`` when set; a resumed run keeps the folder its checkpoint read
    while that still holds its shards (so a source edited since does not matter); else ``data_cache_dir``."""
    if not cfg.data_dir and resume is not None and resume.meta.get("data_dir"):
        saved = Path(resume.meta["data_dir"])
        if (saved / "shards" / "meta.json").is_file():
            return saved
    return data_cache_dir(cfg)


def _remove_stale_writes(run_dir: Path) -> None:
    """The temporary folders of checkpoint writes and model exports a killed process left (with the lock held)."""
    for stale in [*(run_dir / "checkpoints").glob(".tmp_step_*"), *run_dir.glob(".model.*.tmp"),
                  *run_dir.glob(".model.*.old")]:
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def own_run_dir(run_dir: str | Path, env: Dist):
    """Hold ``run_dir``'s lock for the block (rank 0 takes it, the others wait for its answer); a RunDirInUse on
    every process when a live process holds it."""
    lock, error = None, None
    if env.main:
        try:
            lock = ckpt.DirLock(run_dir).acquire()
            _remove_stale_writes(Path(run_dir))
        except Exception as e:  # noqa: BLE001 - every process raises rank 0's error
            error = e
    error = env.broadcast(error)
    if error is not None:
        raise error
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


class Trainer:
    """Owns one run: builds everything from the config, checks the inputs before any step, then trains."""

    def __init__(self, cfg: TrainConfig, env: Dist, resume: Resume | None = None):
        from kalmix.train import data
        self.cfg, self.env, self.resume = cfg, env, resume
        self.run_dir = Path(cfg.run_dir)
        self.accum = cfg.accumulation(env.world)
        # context parallelism: this process's data-parallel group and its piece of every row
        cp = cfg.train.context_parallel
        self.dp_world, self.dp_rank = env.world // cp, env.rank // cp
        size = cfg.train.seq_len // cp
        self.piece = slice(env.rank % cp * size, (env.rank % cp + 1) * size)
        self.cp_group = None
        if cp > 1:      # every process creates every group, in the same order
            groups = [dist.new_group(list(range(g * cp, (g + 1) * cp))) for g in range(self.dp_world)]
            self.cp_group = groups[self.dp_rank]
        try:                                    # the layers' own checks, before any data is prepared
            with torch.device("meta"):
                probe = build_model(cfg, cfg.model.vocab_size or 64)
        except Exception as e:  # noqa: BLE001 - any layer's refusal, reported as the config's
            raise ValueError(f"the model of this config cannot be built: {type(e).__name__}: {e}") from e
        self.threads = cpu_threads(cfg, env, sum(p.numel() for p in probe.parameters()))

        self.data_dir = run_data_dir(cfg, resume)
        self.tokenizer, shards = prepare_data(cfg, env, self.data_dir, resumed=resume is not None)
        tok_vocab = len(self.tokenizer)
        vocab = model_vocab(cfg, tok_vocab)
        self.train_set = data.PackedDataset(shards / "train", cfg.train.seq_len)
        self.val_set = data.PackedDataset(shards / "val", cfg.train.seq_len)
        if self.train_set.vocab_size > vocab:
            raise ValueError(f"the prepared shards hold ids up to {self.train_set.vocab_size}, more than the "
                             f"model's vocabulary {vocab}")
        self.loader = data.Loader(self.train_set, cfg.train.micro_batch_size, self.dp_rank, self.dp_world, cfg.seed)

        torch.manual_seed(cfg.seed)                 # the same initialisation on every process
        self.raw = build_model(cfg, vocab).to(env.device)
        self.flops_per_token = lm_flops_per_token(self.raw, cfg.train.seq_len)
        self.n_params = sum(p.numel() for p in self.raw.parameters())
        if cfg.train.activation_checkpointing:
            activation_checkpointing(self.raw)
        if cfg.train.compile:       # the MLPs: the mixers run their own fused kernels, and a compiled mixer
            for block in self.raw.model.layers:     # would recompile for every packed-document layout
                if block.mlp is not None:
                    block.mlp.compile()
        self.sharded = env.world > 1 and cfg.train.parallel == "fsdp"
        self.model = self._wrap(self.raw)
        self.opt = Optimization(self.raw, cfg.optim, cfg.train.steps, env.device, cfg.train.dtype, self.sharded)
        self.optimizer = self.opt.optimizer
        self.peak = peak_flops(env.device, cfg.log.peak_tflops)
        self.step = 0
        self._eval_plan()
        self._check_shapes()
        if resume is not None:
            # the checkpoint's optimizer state, with this config's hyperparameters (lr, betas, eps, weight decay)
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            meta = ckpt.load(resume.checkpoint, self.model if self.sharded else self.raw, self.optimizer,
                             self.sharded)
            for group, h in zip(self.optimizer.param_groups, hyper):
                group.update(h)
            self.step = meta["step"]
            self.loader.load_state_dict(meta["loader"])

    def _wrap(self, model):
        env = self.env
        if env.world == 1:
            return model
        if self.cfg.train.parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            return DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
        from torch.distributed.fsdp import fully_shard
        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
        return model

    def _check_shapes(self):
        """One forward and backward at the training shape before any step: a sequence length or batch the
        mixers cannot take stops here with the layer's error. The gradients are dropped."""
        from kalmix.train.data import val_batches
        batch = self._to_device(next(iter(val_batches(self.val_set, self.cfg.train.micro_batch_size,
                                                      self.cfg.train.micro_batch_size))))
        try:
            self._loss_sum(batch).backward()
        except Exception as e:
            raise ValueError(f"the model cannot train on rows of train.seq_len = {self.cfg.train.seq_len} tokens "
                             f"× train.micro_batch_size = {self.cfg.train.micro_batch_size}: "
                             f"{type(e).__name__}: {e}") from e
        finally:
            self.optimizer.zero_grad(set_to_none=True)

    def _to_device(self, batch: dict) -> dict:
        """A loader batch (CPU tensors, ``cu_seqlens`` over its [B, T] rows) on the device without the host waiting
        for it: on CUDA the tensors go from pinned memory, and ``cu_seqlens`` becomes ``Offsets`` checked from the
        host's copy, so the model reads nothing back."""
        dev = self.env.device
        out = {k: (v.pin_memory() if dev.type == "cuda" else v).to(dev, non_blocking=True)
               for k, v in batch.items() if k != "cu_seqlens"}
        B, T = batch["input_ids"].shape
        out["cu_seqlens"] = offsets_from_host("kalmix train", batch["cu_seqlens"].tolist(), B * T, dev, row=T)
        return out

    def _eval_plan(self) -> tuple[int, int]:
        """(rows, rows per forward) of an evaluation: ``eval.rows`` of the split (at most all of it) in forwards of
        at most ``train.micro_batch_size`` rows, every process running the same number of forwards (FSDP);
        checked before the first step."""
        rows = min(self.cfg.eval.rows, len(self.val_set))
        per = min(self.cfg.train.micro_batch_size, rows // self.dp_world)
        if per == 0:
            raise ValueError(f"the validation split holds {len(self.val_set)} rows of {self.cfg.train.seq_len} "
                             f"tokens and eval.rows = {self.cfg.eval.rows}: fewer than one row for each of "
                             f"{self.dp_world} data-parallel processes; raise eval.rows or data.val_fraction")
        return rows - rows % (per * self.dp_world), per

    def val_batches(self):
        """This process's validation batches: the data-parallel groups take turns, a context-parallel group's
        processes the same batches."""
        from kalmix.train.data import val_batches
        rows, per = self._eval_plan()
        for i, batch in enumerate(val_batches(self.val_set, per, rows)):
            if i % self.dp_world == self.dp_rank:
                yield self._to_device(batch)

    def _ahead(self, x: torch.Tensor, fill: int) -> torch.Tensor:
        """x [B, T] one token ahead (x[:, t + 1] at t, ``fill`` after the row's end), this process's piece
        [B, T / context_parallel]: what each position of the piece predicts."""
        return F.pad(x[:, 1:], (0, 1), value=fill)[:, self.piece]

    def _context(self):
        """The forward of this process's piece of every row (context parallelism), else nothing."""
        if self.cp_group is None:
            return contextlib.nullcontext()
        return context_parallel_model(self.model, self.cp_group)

    def _loss_sum(self, batch: dict) -> torch.Tensor:
        """The summed cross-entropy of this process's piece of the rows (T_r = seq_len / context_parallel; position
        t scores labels[t + 1], the next piece's first label at a piece's end and nothing at a row's end), for
        training: the model computes it from the targets inside its forward (where FSDP has the LM head's weight
        gathered), without the [B, T_r, V] logits when its config has ``fuse_cross_entropy`` (the default)."""
        with self.opt.autocast(), self._context():
            return self.model(input_ids=batch["input_ids"][:, self.piece], cu_seqlens=batch["cu_seqlens"],
                              targets=self._ahead(batch["labels"], -100)).loss

    def _token_losses(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-target losses [B, T_r], target mask [B, T_r]) of this process's piece of the rows, the targets as
        ``_loss_sum``'s, for evaluation: from the model's logits [B, T_r, V] (no gradients are kept in
        evaluation, so they cost their forward's memory only)."""
        with self.opt.autocast(), self._context():
            logits = self.model(input_ids=batch["input_ids"][:, self.piece], cu_seqlens=batch["cu_seqlens"]).logits
        targets = self._ahead(batch["labels"], -100)
        losses = F.cross_entropy(upcast(logits).flatten(0, 1), targets.flatten(), ignore_index=-100,
                                 reduction="none").view_as(targets)
        return losses, targets != -100

    def evaluate(self) -> dict:
        """Validation loss, perplexity and loss by the predicted token's position in its document."""
        nb, T = self.cfg.eval.position_buckets, self.cfg.train.seq_len
        sums = torch.zeros(nb, dtype=torch.float64)
        counts = torch.zeros(nb, dtype=torch.float64)
        with evaluating(self.model):
            for batch in self.val_batches():
                losses, mask = self._token_losses(batch)
                pos = self._ahead(batch["doc_pos"], 0).long()
                bucket = (pos * nb // T).clamp_max(nb - 1)[mask].cpu()
                sums += torch.bincount(bucket, weights=losses[mask].double().cpu(), minlength=nb)
                counts += torch.bincount(bucket, minlength=nb).double()
        totals = self.env.sum(*sums, *counts)
        sums, counts = torch.tensor(totals[:nb]), torch.tensor(totals[nb:])
        loss = float(sums.sum() / counts.sum())
        edges = [round(i * T / nb) for i in range(nb + 1)]
        by_pos = [{"from": edges[i], "to": edges[i + 1], "loss": float(sums[i] / counts[i]) if counts[i] else None,
                   "tokens": int(counts[i])} for i in range(nb)]
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "loss_by_position": by_pos}

    def _micro_batches(self) -> tuple[list[dict], int]:
        """This step's micro-batches on the device and the targets this process scores in them (its piece's),
        counted on the host (the loader's tensors are CPU tensors: no device synchronisation)."""
        batches = [next(self.loader) for _ in range(self.accum)]
        count = sum(int((self._ahead(b["labels"], -100) != -100).sum()) for b in batches)
        return [self._to_device(b) for b in batches], count

    def train_step(self) -> dict:
        """One optimizer step over ``accum`` micro-batches per process; the loss is the mean over every scored
        token of the global batch (each process's gradient is scaled so that DDP's and FSDP's averaging gives
        exactly that mean; under context parallelism the processes score disjoint pieces of the rows, so the
        same scale holds)."""
        env = self.env
        batches, local_count = self._micro_batches()
        (total_count,) = env.sum(local_count)
        total_count = max(total_count, 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            with self._sync(last):
                s = self._loss_sum(batch)
                loss = s * (env.world / total_count)
                self.opt.backward(loss)
            loss_sum += s.detach().double()
        if env.world > 1:
            dist.all_reduce(loss_sum)                   # on the device, read only when logged
        gn = self.opt.clip(self.model.parameters())
        grad_norm = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)   # the step's one host read
        if not self.opt.scaler and not math.isfinite(grad_norm):    # fp16's scaler skips such steps itself
            raise FloatingPointError(f"non-finite gradient norm at step {self.step + 1} (loss "
                                     f"{float(loss_sum) / total_count:.4g}); the weights were not updated, and the "
                                     f"newest checkpoint is the one to resume from")
        lr = self.opt.update(self.step)
        self.step += 1
        return {"loss": loss_sum / total_count, "lr": lr, "tokens": total_count, "grad_norm": grad_norm}

    def _sync(self, last: bool):
        """Gradient synchronisation only on the last micro-batch of a step."""
        if self.env.world == 1 or last:
            if self.sharded:
                self.model.set_requires_gradient_sync(True)
            return contextlib.nullcontext()
        if self.sharded:
            self.model.set_requires_gradient_sync(False)
            return contextlib.nullcontext()
        return self.model.no_sync()

    def _log(self, row: dict):
        if self.env.main:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    def save(self, complete: bool = False) -> Path:
        return ckpt.save(self.run_dir, self.step, self.model if self.sharded else self.raw, self.optimizer,
                         self.loader.state_dict(), self.cfg.to_dict(), self.sharded, self.cfg.checkpoint.keep,
                         data_dir=str(self.data_dir.resolve()), complete=complete)

    def export(self) -> Path:
        """The final model as a Hugging Face folder (safetensors, config, tokenizer) in ``RUN/model``, written
        beside it and renamed into place."""
        out = self.run_dir / "model"
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                              cpu_offload=True))
        else:
            state = None
        if self.env.main:
            model = self.raw
            if state is not None:
                model = build_model(self.cfg, self.raw.config.vocab_size)
                model.load_state_dict(state)
            tag = uuid.uuid4().hex[:8]
            tmp, old = self.run_dir / f".model.{tag}.tmp", self.run_dir / f".model.{tag}.old"
            try:
                model.save_pretrained(tmp)
                self.tokenizer.save_pretrained(tmp)
                if out.exists():
                    os.replace(out, old)
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(old, ignore_errors=True)
        self.env.barrier()
        return out

    def _start_profile(self):
        """A ``Recording`` of the next ``log.profile`` steps, fewer where a log line, an evaluation, a checkpoint
        or the run's end comes first (their work would be recorded with the steps)."""
        from kalmix.bench.profile import Recording
        cfg = self.cfg
        nxt = [_next_multiple(self.step, every) for every in (cfg.log.every, cfg.eval.every, cfg.checkpoint.every)]
        steps = min(cfg.log.profile, min(nxt + [cfg.train.steps]) - self.step)
        return Recording(self.raw, self.env.device, steps)

    def _finish_profile(self, recording) -> None:
        """Write the recording's table (RUN/profile/rank<R>.txt) and Chrome trace; log where they are."""
        from kalmix.bench.profile import format_breakdown
        env = self.env
        folder = self.run_dir / "profile"
        folder.mkdir(exist_ok=True)
        first = self.step - recording.steps + 1
        b = recording.finish(str(folder / f"rank{env.rank}.trace.json.gz"))
        title = f"rank {env.rank} of {env.world}, steps {first}-{self.step}"
        atomic_write(folder / f"rank{env.rank}.txt", lambda f: f.write(format_breakdown(b, env.device.type,
                                                                                         title).encode()))
        self._log({"kind": "profile", "steps": [first, self.step], "folder": str(folder),
                   "step_ms": b.step_ms, "busy_ms": b.busy_ms, "host_ms": b.host_ms,
                   **{k: None if v != v else v for k, v in (("idle_fraction", b.idle_fraction),
                                                            ("launches", b.launches))}})
        if env.main:
            tqdm.write(f"profile of steps {first}-{self.step} in {folder}: {b.step_ms:.1f} ms per step (host "
                       f"{b.host_ms:.1f} ms, kernels {b.busy_ms:.1f} ms)")

    def _stop_signal(self, signals: _Signals) -> int | None:
        """The signal every process agrees to stop on (SIGTERM over SIGINT), or None: one collective."""
        ints, terms = self.env.sum(signals.signum == signal.SIGINT, signals.signum == signal.SIGTERM)
        return signal.SIGTERM if terms else signal.SIGINT if ints else None

    def _announce(self) -> None:
        cfg, env = self.cfg, self.env
        if self.resume is not None:
            changed = {k: [a, b] for k, a, b in self.resume.changes}
            self._log({"kind": "resume", "step": self.step, "checkpoint": str(self.resume.checkpoint),
                       "changed": changed})
            if env.main:
                tqdm.write(f"resuming from {self.resume.checkpoint} (step {self.step})")
                for key, old, new in self.resume.changes:
                    tqdm.write(f"changed on resume: {describe_changes([(key, old, new)])}")
        self._log({"kind": "start", "step": self.step, "params": self.n_params, "world_size": env.world,
                   "context_parallel": cfg.train.context_parallel,
                   "flops_per_token": self.flops_per_token, "device": str(env.device), "threads": self.threads,
                   "tokens_per_step": cfg.train.seq_len * cfg.train.global_batch_size,
                   "mixers": self.raw.config.mixers, "versions": versions(env.device)})
        if env.main:
            cp = cfg.train.context_parallel
            groups = f" (rows split over groups of {cp}, {self.dp_world} data-parallel)" if cp > 1 else ""
            tqdm.write(f"{self.n_params / 1e6:.2f}M parameters on {env.device} × {env.world} process"
                       f"{'es' if env.world > 1 else ''}{groups}, {self.threads} CPU thread"
                       f"{'s' if self.threads > 1 else ''} each; data in {self.data_dir}")
            warmup, steps = cfg.optim.warmup_steps, cfg.train.steps
            if warmup > steps:                      # allowed (a short run to time or try something), but said
                tqdm.write(f"note: optim.warmup_steps = {warmup} exceeds train.steps = {steps}: the learning rate "
                           f"is still warming up at the last step, at {steps}/{warmup} of optim.lr")

    def run(self, signals: _Signals | None = None) -> dict:
        """Train from ``self.step`` to ``train.steps``, export the model, write the final checkpoint; returns the
        last step's metrics. With ``signals``, a SIGINT / SIGTERM ends the loop after the current step with a
        checkpoint and raises TrainingInterrupted."""
        cfg, env = self.cfg, self.env
        if env.main:
            atomic_write(self.run_dir / "config.yaml", lambda f: f.write(cfg.dump().encode()))
            if self.resume is None:
                (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        env.barrier()
        self._announce()
        bar = tqdm(total=cfg.train.steps, initial=self.step, disable=not (env.main and cfg.log.progress),
                   desc="train", dynamic_ncols=True)
        last = {}
        saved = self.step if self.resume is not None else None
        if signals is not None:
            signals.defer()
        t0, tokens0, step0 = time.perf_counter(), 0.0, self.step
        profile_at = _next_multiple(self.step, cfg.log.every) if cfg.log.profile else None
        recording = None
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        while self.step < cfg.train.steps:
            if self.step == profile_at:
                recording = self._start_profile()
            with recording.step() if recording is not None else contextlib.nullcontext():
                signum = self._stop_signal(signals) if signals is not None else None
                if signum is not None:
                    bar.close()
                    path = self.save() if saved != self.step else ckpt.checkpoints(self.run_dir)[-1]
                    self._log({"kind": "interrupt", "step": self.step, "signal": signal.Signals(signum).name})
                    raise TrainingInterrupted(signum, self.step, path)
                last = self.train_step()
                loss = last.pop("loss")
            if recording is not None and recording.done == recording.steps:
                self._finish_profile(recording)
                recording = None
                t0, step0 = time.perf_counter(), self.step       # the log window leaves the recorded steps out
            tokens0 += last["tokens"]
            bar.update(1)
            if self.step % cfg.log.every == 0 or self.step == cfg.train.steps:
                last["loss"] = float(loss)                  # the logged step's loss (a device read)
                if env.device.type == "cuda":
                    torch.cuda.synchronize(env.device)
                dt = time.perf_counter() - t0
                tok_s = cfg.train.seq_len * cfg.train.global_batch_size * (self.step - step0) / dt
                row = {"kind": "train", "step": self.step, **last, "tok_s": tok_s,
                       "mfu": (tok_s * self.flops_per_token / (self.peak * env.world)) if self.peak else None,
                       "mem_gib": (torch.cuda.max_memory_allocated(env.device) / 2**30
                                   if env.device.type == "cuda" else None)}
                self._log(row)
                mfu = f" | MFU {100 * row['mfu']:.1f}%" if row["mfu"] is not None else ""
                mem = f" | mem {row['mem_gib']:.1f} GiB" if row["mem_gib"] is not None else ""
                bar.set_postfix(loss=f"{last['loss']:.4f}")
                if env.main:
                    tqdm.write(f"step {self.step}/{cfg.train.steps} | loss {last['loss']:.4f} | lr {last['lr']:.2e}"
                               f" | tok/s {tok_s:,.0f}{mfu}{mem}")
                t0, step0 = time.perf_counter(), self.step
            if self.step % cfg.eval.every == 0 or self.step == cfg.train.steps:
                ev = self.evaluate()
                self._log({"kind": "eval", "step": self.step, **ev})
                if env.main:
                    tqdm.write(f"step {self.step} | val loss {ev['val_loss']:.4f} | val ppl {ev['val_ppl']:.2f}")
                last.update(ev)
                t0, step0 = time.perf_counter(), self.step
            if self.step % cfg.checkpoint.every == 0 and self.step < cfg.train.steps:
                self.save()
                saved = self.step
                t0, step0 = time.perf_counter(), self.step
        bar.close()
        out = self.export()
        self.save(complete=True)        # after the export: a complete checkpoint means the model is in RUN/model
        if env.main:
            tqdm.write(f"model written to {out}")
        return last


def _next_multiple(step: int, every: int) -> int:
    """The first step after ``step`` at which something done every ``every`` steps happens."""
    return (step // every + 1) * every


def train(cfg: TrainConfig) -> dict:
    """Run ``cfg``, resuming from the run directory's newest checkpoint if ``resume`` allows; returns the last
    step's metrics ({} when the run was already complete: it says so and does nothing).

    Holds ``run_dir``'s lock for the run (RunDirInUse when a live process holds it). SIGINT / SIGTERM: the current
    step finishes, a checkpoint is written, and TrainingInterrupted (a KeyboardInterrupt) is raised; under
    torchrun every process stops after the same step (signals are handled when ``train`` runs in the main thread).
    With ``log.progress`` false no progress bar is shown, third-party ones included."""
    threads = torch.get_num_threads()
    with _Signals() as signals:
        env = Dist(cfg.train.device)
        try:
            with own_run_dir(cfg.run_dir, env), \
                    third_party_progress(cfg.log.progress, datasets=_reads_datasets(cfg.data)):
                resume = resume_point(cfg)
                if resume is not None and resume.complete:
                    if env.main:
                        tqdm.write(f"{cfg.run_dir} is already complete: {resume.step} of train.steps = "
                                   f"{cfg.train.steps} steps done, the model in {Path(cfg.run_dir) / 'model'}; "
                                   f"raise train.steps to train further")
                    return {}
                return Trainer(cfg, env, resume).run(signals)
        finally:
            env.close()
            torch.set_num_threads(threads)
