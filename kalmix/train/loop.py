"""The training loop of `kalmix train`: one process, or N under torchrun with DDP or FSDP2."""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from kalmix.bench.models import lm_flops_per_token
from kalmix.models import KalmixConfig, KalmixForCausalLM
from kalmix.train import checkpoint as ckpt
from kalmix.train.config import TrainConfig
from kalmix.train.data import atomic_write

# dense bf16 tensor-core peaks (TFLOP/s) of the GPUs MFU is reported for; others: log.peak_tflops
_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
# the config keys a resumed run must share with its checkpoint
_SAME_ON_RESUME = ("seed", "model", "tokenizer", "data", "train.seq_len", "train.global_batch_size")


class Dist:
    """This process's place in the run: rank, world size, device; torchrun's environment starts a process group
    (NCCL on CUDA, gloo on CPU)."""

    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("train.device = cuda, but no CUDA device is available")
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device(device)
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    def sum(self, *values: float | torch.Tensor) -> list[float]:
        """Sum scalars over the processes (one collective)."""
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(()).cpu() for v in values])
        if self.world > 1:
            t = t.to(self.device) if self.device.type == "cuda" else t
            dist.all_reduce(t)
        return t.cpu().tolist()

    def close(self):
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def param_groups(model: nn.Module, cfg: TrainConfig) -> list[dict]:
    """AdamW groups: matrices with weight decay; norms, biases and embeddings without; the recurrent parameters
    (those a layer marks ``_no_weight_decay``: decays, process noise, step sizes, skip) without weight decay and
    at ``optim.recurrent_lr_mult`` times the learning rate."""
    decay, plain, recurrent = [], [], []
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if getattr(p, "_no_weight_decay", False):
            recurrent.append(p)
        elif p.dim() < 2 or id(p) in embeddings:
            plain.append(p)
        else:
            decay.append(p)
    o = cfg.optim
    groups = [dict(params=decay, weight_decay=o.weight_decay, lr_mult=1.0, name="decay"),
              dict(params=plain, weight_decay=0.0, lr_mult=1.0, name="no_decay"),
              dict(params=recurrent, weight_decay=0.0, lr_mult=o.recurrent_lr_mult, name="recurrent")]
    return [g for g in groups if g["params"]]


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """The learning rate at optimizer step ``step`` (0-based) as a fraction of the peak."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    if o.schedule == "wsd":
        decay_start = total - max(1, round(o.decay_fraction * total))
        if step < decay_start:
            return 1.0
        frac = (step - decay_start + 1) / (total - decay_start)
        return 1.0 - (1.0 - o.min_lr_ratio) * frac
    frac = min(1.0, (step - o.warmup_steps + 1) / max(1, total - o.warmup_steps))
    return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))


def data_cache_dir(cfg: TrainConfig) -> Path:
    """Where the tokenizer and the shards of this data + tokenizer setting live (shared by runs that share it)."""
    if cfg.data_dir:
        return Path(cfg.data_dir)
    key = json.dumps({"data": cfg.data.model_dump(), "tokenizer": cfg.tokenizer.model_dump()}, sort_keys=True)
    return Path("runs/data") / hashlib.sha256(key.encode()).hexdigest()[:12]


def prepare_data(cfg: TrainConfig, env: Dist):
    """Tokenizer and shards (made by the first process, read by all): -> (tokenizer, train dir, val dir)."""
    from kalmix.train import data, tokenizer as tk
    root = data_cache_dir(cfg)
    tok_dir = Path(cfg.tokenizer.path) if cfg.tokenizer.path else root / "tokenizer"
    if env.main:
        if cfg.tokenizer.path is None and not (tok_dir / "tokenizer.json").is_file():
            tk.train_tokenizer(data.iter_documents(cfg.data, split="train"), cfg.tokenizer.vocab_size, tok_dir,
                               progress=cfg.log.progress)
        tok = tk.load_tokenizer(tok_dir)
        data.prepare(cfg.data, tok, root / "shards", progress=cfg.log.progress)
    env.barrier()
    tok = tk.load_tokenizer(tok_dir)
    return tok, root / "shards"


def build_model(cfg: TrainConfig, vocab_size: int) -> KalmixForCausalLM:
    m = cfg.model
    kw = dict(vocab_size=vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
              mixer_kwargs=m.mixer_kwargs, intermediate_size=m.intermediate_size,
              tie_word_embeddings=m.tie_word_embeddings, impl=m.impl)
    if m.mixers is not None:
        if m.attention_every is not None or m.attention_layers:
            raise ValueError("model: give either `mixers` or `mixer` with `attention_every` / `attention_layers`")
        kw["mixers"] = m.mixers
    else:
        kw.update(mixer=m.mixer, attention_every=m.attention_every, attention_layers=m.attention_layers)
    return KalmixForCausalLM(KalmixConfig(**kw))


def model_vocab(cfg: TrainConfig, tokenizer_vocab: int) -> int:
    """model.vocab_size, or the tokenizer's rounded up to a multiple of 64; an error if the tokenizer's ids do not
    fit."""
    if cfg.model.vocab_size is None:
        return -(-tokenizer_vocab // 64) * 64
    if cfg.model.vocab_size < tokenizer_vocab:
        raise ValueError(f"model.vocab_size = {cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
                         f"({tokenizer_vocab} ids): its ids would not fit the embedding")
    return cfg.model.vocab_size


def _differences(a: dict, b: dict, keys) -> list[str]:
    out = []
    for key in keys:
        va, vb = a, b
        for part in key.split("."):
            va, vb = (va or {}).get(part), (vb or {}).get(part)
        if va != vb:
            out.append(f"{key}: checkpoint {va!r}, now {vb!r}")
    return out


class Trainer:
    """Owns one run: builds everything from the config, checks the inputs before any step, then trains."""

    def __init__(self, cfg: TrainConfig):
        from kalmix.train import data
        self.cfg = cfg
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.env = env = Dist(cfg.train.device)
        self.run_dir = Path(cfg.run_dir)
        self.accum = cfg.accumulation(env.world)
        existing = ckpt.checkpoints(self.run_dir)
        if cfg.resume == "never" and existing:
            raise ValueError(f"{self.run_dir} already holds checkpoints ({existing[-1].name}) and resume = never: "
                             f"choose another run_dir, or resume = auto")
        if cfg.resume == "required" and not existing:
            raise ValueError(f"resume = required, but {self.run_dir} holds no checkpoint")
        self.resume_from = existing[-1] if existing else None
        if self.resume_from is not None:            # a foreign or corrupt checkpoint stops here, before any step
            meta = ckpt.read_meta(self.resume_from)
            diff = _differences(meta["config"], json.loads(cfg.model_dump_json()), _SAME_ON_RESUME)
            if diff:
                raise ValueError(f"{self.resume_from} was written by a run of another configuration; a resumed "
                                 f"run must keep " + "; ".join(diff))

        self.tokenizer, shards = prepare_data(cfg, env)
        tok_vocab = len(self.tokenizer)
        vocab = model_vocab(cfg, tok_vocab)
        self.train_set = data.PackedDataset(shards / "train", cfg.train.seq_len)
        self.val_set = data.PackedDataset(shards / "val", cfg.train.seq_len)
        if self.train_set.vocab_size > vocab:
            raise ValueError(f"the prepared shards hold ids up to {self.train_set.vocab_size}, more than the "
                             f"model's vocabulary {vocab}")
        self.loader = data.Loader(self.train_set, cfg.train.micro_batch_size, env.rank, env.world, cfg.seed)

        torch.manual_seed(cfg.seed)                 # the same initialisation on every process
        self.raw = build_model(cfg, vocab).to(env.device)
        self.flops_per_token = lm_flops_per_token(self.raw, cfg.train.seq_len)
        self.n_params = sum(p.numel() for p in self.raw.parameters())
        if cfg.train.activation_checkpointing:
            self.raw.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.train.compile:       # the MLPs: the mixers run their own fused kernels, and a compiled mixer
            for block in self.raw.model.layers:     # would recompile for every packed-document layout
                if block.mlp is not None:
                    block.mlp.compile()
        self.sharded = env.world > 1 and cfg.train.parallel == "fsdp"
        self.model = self._wrap(self.raw)
        fused = env.device.type == "cuda" and not self.sharded
        self.optimizer = torch.optim.AdamW(param_groups(self.raw, cfg), lr=cfg.optim.lr,
                                           betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
                                           fused=fused or None)
        mults = [g["lr_mult"] for g in self.optimizer.param_groups]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, [lambda s, m=m: m * lr_factor(s, cfg) for m in mults])
        self.autocast = (torch.autocast(env.device.type, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}
                                        [cfg.train.dtype]) if cfg.train.dtype != "fp32" else contextlib.nullcontext())
        self.scaler = torch.amp.GradScaler(env.device.type) if cfg.train.dtype == "fp16" else None
        self.peak = self._peak_flops()
        self.step = 0
        self._check_shapes()
        if self.resume_from is not None:
            meta = ckpt.load(self.resume_from, self.model if self.sharded else self.raw, self.optimizer,
                             self.scheduler, self.sharded)
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

    def _peak_flops(self) -> float | None:
        if self.cfg.log.peak_tflops is not None:
            return self.cfg.log.peak_tflops * 1e12
        if self.env.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.env.device)
        for key, tflops in _PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
        return None

    def _check_shapes(self):
        """One forward and backward at the training shape before any step: a sequence length or batch the
        mixers cannot take stops here with the layer's error. The gradients are dropped."""
        from kalmix.train.data import val_batches
        batch = self._to_device(next(iter(val_batches(self.val_set, self.cfg.train.micro_batch_size,
                                                      self.cfg.train.micro_batch_size))))
        try:
            with self.autocast:
                logits = self.model(input_ids=batch["input_ids"], cu_seqlens=batch["cu_seqlens"]).logits
            logits.float().mean().backward()
        except Exception as e:
            raise ValueError(f"the model cannot train on rows of train.seq_len = {self.cfg.train.seq_len} tokens "
                             f"× train.micro_batch_size = {self.cfg.train.micro_batch_size}: "
                             f"{type(e).__name__}: {e}") from e
        finally:
            self.optimizer.zero_grad(set_to_none=True)

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.env.device, non_blocking=True) for k, v in batch.items()}

    def val_batches(self):
        from kalmix.train.data import val_batches
        env, mbs = self.env, self.cfg.train.micro_batch_size
        rows = min(self.cfg.eval.rows, len(self.val_set))
        rows -= rows % (mbs * env.world)            # every process runs the same number of forwards (FSDP)
        if rows == 0:
            raise ValueError(f"the validation split holds {len(self.val_set)} rows of {self.cfg.train.seq_len} "
                             f"tokens: fewer than one batch of {mbs} × {env.world} processes")
        batches = val_batches(self.val_set, mbs, rows)
        for i, batch in enumerate(batches):
            if i % env.world == env.rank:
                yield self._to_device(batch)

    def _loss_sums(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(summed cross-entropy, per-target losses [B, T − 1], target mask [B, T − 1])."""
        with self.autocast:
            logits = self.model(input_ids=batch["input_ids"], cu_seqlens=batch["cu_seqlens"]).logits
        targets = batch["labels"][:, 1:]
        losses = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                 reduction="none").view_as(targets)
        mask = targets != -100
        return losses.sum(), losses, mask

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss, perplexity and loss by the predicted token's position in its document."""
        self.model.eval()
        nb, T = self.cfg.eval.position_buckets, self.cfg.train.seq_len
        sums = torch.zeros(nb, dtype=torch.float64)
        counts = torch.zeros(nb, dtype=torch.float64)
        for batch in self.val_batches():
            _, losses, mask = self._loss_sums(batch)
            pos = batch["doc_pos"][:, 1:].long()
            bucket = (pos * nb // T).clamp_max(nb - 1)[mask].cpu()
            sums += torch.bincount(bucket, weights=losses[mask].double().cpu(), minlength=nb)
            counts += torch.bincount(bucket, minlength=nb).double()
        totals = self.env.sum(*sums, *counts)
        sums, counts = torch.tensor(totals[:nb]), torch.tensor(totals[nb:])
        self.model.train()
        loss = float(sums.sum() / counts.sum())
        edges = [round(i * T / nb) for i in range(nb + 1)]
        by_pos = [{"from": edges[i], "to": edges[i + 1], "loss": float(sums[i] / counts[i]) if counts[i] else None,
                   "tokens": int(counts[i])} for i in range(nb)]
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "loss_by_position": by_pos}

    def _micro_batches(self) -> tuple[list[dict], int]:
        """This step's micro-batches on the device and their scored targets, counted on the host (the loader's
        tensors are CPU tensors: no device synchronisation)."""
        batches = [next(self.loader) for _ in range(self.accum)]
        count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        return [self._to_device(b) for b in batches], count

    def train_step(self) -> dict:
        """One optimizer step over ``accum`` micro-batches per process; the loss is the mean over every scored
        token of the global batch (each process's gradient is scaled so that DDP's and FSDP's averaging gives
        exactly that mean)."""
        env = self.env
        batches, local_count = self._micro_batches()
        (total_count,) = env.sum(local_count)
        total_count = max(total_count, 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            with self._sync(last):
                s, _, _ = self._loss_sums(batch)
                loss = s * (env.world / total_count)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += s.detach().double()
        (loss_total,) = env.sum(loss_sum)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip is not None else math.inf
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        grad_norm = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
        if not self.scaler and not math.isfinite(grad_norm):    # fp16's scaler skips such steps itself
            raise FloatingPointError(f"non-finite gradient norm at step {self.step + 1} (loss "
                                     f"{loss_total / total_count:.4g}); the weights were not updated, and the "
                                     f"newest checkpoint is the one to resume from")
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss": loss_total / total_count, "lr": lr, "tokens": total_count, "grad_norm": grad_norm}

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

    def save(self):
        ckpt.save(self.run_dir, self.step, self.model if self.sharded else self.raw, self.optimizer,
                  self.scheduler, self.loader.state_dict(), json.loads(self.cfg.model_dump_json()), self.sharded,
                  self.cfg.checkpoint.keep)

    def export(self) -> Path:
        """The final model as a Hugging Face folder (safetensors, config, tokenizer) in ``RUN/model``."""
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
            tmp = self.run_dir / ".model.tmp"
            model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            if out.exists():
                import shutil
                shutil.rmtree(out)
            os.replace(tmp, out)
        self.env.barrier()
        return out

    def run(self) -> dict:
        cfg, env = self.cfg, self.env
        if env.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self.run_dir / "config.yaml", lambda f: f.write(cfg.dump().encode()))
            if self.resume_from is None:
                (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        env.barrier()
        if self.resume_from is not None and env.main:
            tqdm.write(f"resuming from {self.resume_from} (step {self.step})")
        self._log({"kind": "start", "step": self.step, "params": self.n_params, "world_size": env.world,
                   "flops_per_token": self.flops_per_token, "device": str(env.device),
                   "tokens_per_step": cfg.train.seq_len * cfg.train.global_batch_size,
                   "mixers": self.raw.config.mixers})
        bar = tqdm(total=cfg.train.steps, initial=self.step, disable=not (env.main and cfg.log.progress),
                   desc="train", dynamic_ncols=True)
        last = {}
        t0, tokens0, step0 = time.perf_counter(), 0.0, self.step
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        while self.step < cfg.train.steps:
            last = self.train_step()
            tokens0 += last["tokens"]
            bar.update(1)
            if self.step % cfg.log.every == 0 or self.step == cfg.train.steps:
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
            if self.step % cfg.checkpoint.every == 0 or self.step == cfg.train.steps:
                self.save()
                t0, step0 = time.perf_counter(), self.step
        bar.close()
        out = self.export()
        if env.main:
            tqdm.write(f"model written to {out}")
        return last


def train(cfg: TrainConfig) -> dict:
    """Run ``cfg`` (resuming from the run directory's newest checkpoint if ``resume`` allows) and return the
    last step's metrics."""
    trainer = Trainer(cfg)
    try:
        return trainer.run()
    finally:
        trainer.env.close()
