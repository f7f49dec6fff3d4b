"""`kalmix bench mqar`: train small 2-layer models of each mixer on MQAR and compare their recall."""
from __future__ import annotations

import json
import math
import os
import subprocess
import time
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from tqdm.auto import tqdm

from kalmix.ops.common.checks import check_device
from kalmix.bench.checks import check_impl, check_model, check_out, validation_lines
from kalmix.layers import MIXER_SPECS, MIXERS
from kalmix.models import KalmixConfig, KalmixForCausalLM
from kalmix.tasks import MQARConfig

MIXER_NAMES = tuple(MIXERS)
# the default run: kalmix's four mixers beside softmax attention and Gated DeltaNet (the README's table)
DEFAULT_MIXERS = [name for name, spec in MIXER_SPECS.items() if spec.headline]


class MQARBenchConfig(BaseModel):
    """One run of the benchmark; every field is a CLI flag (kebab-case). Construction checks everything before any
    work: the device, the backend on it, the task size and that every mixer's model builds."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mixers: list[Literal[MIXER_NAMES]] = Field(DEFAULT_MIXERS, min_length=1)
    vocab_size: int = Field(64, ge=1)
    seq_len: int = Field(32, ge=1)
    num_kv_pairs: int = Field(4, ge=1)
    train_examples: int = Field(20_000, ge=1)
    test_examples: int = Field(1_000, ge=1)
    d_model: int = Field(64, ge=1)
    n_layers: int = Field(2, ge=1)
    num_heads: int = Field(2, ge=1)
    d_state: int = Field(16, ge=1)
    steps: int = Field(500, ge=1)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    warmup: float = Field(0.1, ge=0, lt=1)
    seed: int = Field(0, ge=0, lt=2 ** 63)
    device: str = "cpu"
    impl: Literal["naive", "torch", "triton"] | None = None
    threads: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self):
        check_impl(self.impl, check_device(self.device))
        try:
            MQARConfig(vocab_size=self.vocab_size, seq_len=self.seq_len, num_kv_pairs=self.num_kv_pairs,
                       num_examples=1)
        except ValidationError as e:
            raise ValueError(f"the MQAR task: {'; '.join(validation_lines(e))}") from None
        for mixer in self.mixers:
            check_model(lambda: self.lm_config(mixer), f"the {mixer} model of width {self.d_model}, {self.n_layers} "
                        f"layers and vocabulary {self.vocab_size}")
        return self

    def lm_config(self, mixer: str) -> KalmixConfig:
        """``n_layers`` blocks of ``mixer`` without MLPs (Zoology's MQAR models), untied embeddings."""
        return KalmixConfig(vocab_size=self.vocab_size, hidden_size=self.d_model, num_hidden_layers=self.n_layers,
                            mixer=mixer, mixer_kwargs={mixer: self.mixer_kwargs(mixer)}, mlp=False,
                            tie_word_embeddings=False, impl=self.impl)

    def mixer_kwargs(self, mixer: str) -> dict:
        """``num_heads`` and ``d_state`` where the mixer takes them, in its compact variant (the Kalman paper's
        MQAR setting: expand 1, H = 1)."""
        spec = MIXER_SPECS[mixer]
        return {**spec.size_kwargs(heads=self.num_heads, d_state=self.d_state), **spec.compact}


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per example: mean accuracy over its labelled positions ([N] floats)."""
    scored = labels != -100
    hit = (logits.argmax(-1) == labels) & scored
    return hit.sum(1).float() / scored.sum(1).clamp_min(1).float()


def lr_at(step: int, cfg: MQARBenchConfig) -> float:
    warm = max(1, int(cfg.warmup * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * frac))


@torch.no_grad()
def evaluate(model, inputs, labels, batch_size, device) -> float:
    model.eval()
    accs = []
    for i in range(0, len(inputs), batch_size):
        logits = model(inputs[i:i + batch_size].to(device)).logits
        accs.append(accuracy(logits.float(), labels[i:i + batch_size].to(device)).cpu())
    model.train()
    return torch.cat(accs).mean().item()


def train_one(mixer: str, cfg: MQARBenchConfig, data, position: int = 0) -> dict:
    (x_tr, y_tr), (x_te, y_te) = data
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = KalmixForCausalLM(cfg.lm_config(mixer)).to(device)
    decay, no_decay = [], []
    for p in model.parameters():
        (no_decay if p.dim() < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(cfg.seed)
    train_time, tokens = 0.0, 0
    bar = tqdm(range(cfg.steps), desc=f"{mixer:>9}", position=position, leave=True, dynamic_ncols=True)
    for step in bar:
        idx = torch.randint(len(x_tr), (cfg.batch_size,), generator=gen)
        x, y = x_tr[idx].to(device), y_tr[idx].to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        t0 = time.perf_counter()
        logits = model(x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_time += time.perf_counter() - t0
        tokens += x.numel()
        if step % 10 == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    acc = evaluate(model, x_te, y_te, 256, device)
    layer = model.model.layers[0].mixer
    state = layer.state_size(cfg.seq_len) if mixer == "attention" else layer.state_size()
    return {"mixer": mixer, "params": sum(p.numel() for p in model.parameters()), "state_size": state,
            "accuracy": acc, "train_tokens_per_s": tokens / train_time, "train_time_s": train_time,
            "final_loss": loss.item()}


def _git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(__file__), timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(cfg: MQARBenchConfig, out_path: str | None) -> list[dict]:
    """Train every mixer of ``cfg``, print a table, append one JSONL row per mixer to ``out_path``."""
    if out_path is not None:
        check_out(out_path)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    task = dict(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, num_kv_pairs=cfg.num_kv_pairs)
    train = MQARConfig(**task, num_examples=cfg.train_examples).build(seed=cfg.seed)
    test = MQARConfig(**task, num_examples=cfg.test_examples).build(seed=cfg.seed + 1_000_003)
    rows = []
    started = time.time()
    for mixer in cfg.mixers:
        t0 = time.time()
        row = train_one(mixer, cfg, (train, test))
        row["wall_time_s"] = time.time() - t0
        row.update({f"config.{k}": v for k, v in cfg.model_dump().items() if k != "mixers"})
        row.update({"torch": torch.__version__, "git": _git_sha(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
        rows.append(row)
        if out_path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
            with open(out_path, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(format_table(rows, cfg))
    print(f"total wall time {time.time() - started:.0f} s" + (f"; results appended to {out_path}" if out_path else ""))
    return rows


def format_table(rows: list[dict], cfg: MQARBenchConfig) -> str:
    head = (f"MQAR  T={cfg.seq_len}  pairs={cfg.num_kv_pairs}  vocab={cfg.vocab_size}  d_model={cfg.d_model}  "
            f"layers={cfg.n_layers}  steps={cfg.steps}x{cfg.batch_size}  device={cfg.device}")
    cols = f"{'mixer':<10} {'params':>8} {'state':>8} {'accuracy':>9} {'train tok/s':>12} {'wall s':>7}"
    lines = [head, cols, "-" * len(cols)]
    for r in rows:
        lines.append(f"{r['mixer']:<10} {r['params']:>8d} {r['state_size']:>8d} {100 * r['accuracy']:>8.2f}% "
                     f"{r['train_tokens_per_s']:>12.0f} {r['wall_time_s']:>7.1f}")
    lines.append("state: recurrent-state elements per sequence per layer, short-conv buffers not counted "
                 "(attention: its KV cache at T)")
    return "\n".join(lines)

