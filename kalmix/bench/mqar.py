"""`kalmix bench mqar`: train small 2-layer models of each mixer on MQAR and compare their recall. Each model trains
through the recipes' loop (``kalmix.bench.synthetic.fit``, hence ``kalmix train``'s optimisation)."""
from __future__ import annotations

import json
import os
import time
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kalmix.ops.common.checks import check_device
from kalmix.bench.checks import check_impl, check_model, check_out, validation_lines
from kalmix.bench.synthetic import Batches, TrainSpec, evaluate, fit, git_sha
from kalmix.layers import MIXER_SPECS, MIXERS
from kalmix.models import KalmixConfig, KalmixForCausalLM
from kalmix.tasks import MQARConfig

MIXER_NAMES = tuple(MIXERS)
# the default run: kalmix's four mixers beside softmax attention and Gated DeltaNet (the README's table)
DEFAULT_MIXERS = [name for name, spec in MIXER_SPECS.items() if spec.headline]


class MQARBenchConfig(BaseModel):
    """One run of the benchmark; every field is a CLI flag (kebab-case). Construction checks everything before any
    work: the device, the backend on it, the task size, that every mixer's model builds and the output file."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mixers: list[Literal[MIXER_NAMES]] = Field(DEFAULT_MIXERS, min_length=1, description="mixers to train")
    vocab_size: int = Field(64, ge=1, description="MQAR vocabulary (keys from [1, V/2), values from [V/2, V))")
    seq_len: int = Field(32, ge=1, description="sequence length T")
    num_kv_pairs: int = Field(4, ge=1, description="key-value pairs per sequence")
    train_examples: int = Field(20_000, ge=1, description="training sequences (sampled with replacement)")
    test_examples: int = Field(1_000, ge=1, description="held-out sequences, scored after the last step")
    d_model: int = Field(64, ge=1, description="model width")
    n_layers: int = Field(2, ge=1, description="number of mixer blocks")
    num_heads: int = Field(2, ge=1, description="heads of the matrix-state mixers")
    d_state: int = Field(16, ge=1, description="Kalman state slots N")
    steps: int = Field(500, ge=1, description="optimiser steps per mixer")
    batch_size: int = Field(64, ge=1, description="sequences per step")
    lr: float = Field(3e-3, gt=0, description="peak AdamW learning rate (cosine schedule to zero)")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay of the matrices, embeddings included")
    warmup: float = Field(0.1, ge=0, lt=1, description="fraction of steps of linear warm-up")
    seed: int = Field(0, ge=0, lt=2 ** 63, description="seed of data, init and sampling")
    device: str = Field("cpu", description="cpu, cuda or cuda:N")
    impl: Literal["naive", "torch", "triton"] | None = Field(None, description="op backend (none: triton on CUDA, "
                                                                               "torch otherwise)")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (none: torch's choice)")
    out: str | None = Field("runs/mqar.jsonl", description="JSONL file the results are appended to (none: only "
                                                           "the table)")

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
        if self.out is not None:
            check_out(self.out, append=True)
        return self

    def train_spec(self) -> TrainSpec:
        """The recipes' protocol of every run: AdamW (0.9, 0.98) with warm-up then cosine to zero, clipping 1.0,
        fp32, batches drawn with replacement, one evaluation (the test set's) after the last step."""
        return TrainSpec(steps=self.steps, batch_size=self.batch_size, lrs=[self.lr], seeds=[self.seed],
                         weight_decay=self.weight_decay, warmup=self.warmup, eval_every=self.steps)

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


def train_one(mixer: str, cfg: MQARBenchConfig, data) -> dict:
    """Train ``mixer``'s model on data[0] (inputs, labels) and score it on data[1]: -> the result row."""
    (x_tr, y_tr), (x_te, y_te) = data
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = KalmixForCausalLM(cfg.lm_config(mixer)).to(device)
    train = cfg.train_spec()
    result = fit(model, train, cfg.lr, Batches(train, cfg.seed, (x_tr, y_tr)),
                 lambda: evaluate(model, x_te, y_te, device, train.precision)["accuracy"], device, train.precision,
                 desc=f"{mixer:>9}")
    layer = model.model.layers[0].mixer
    state = layer.state_size(cfg.seq_len) if mixer == "attention" else layer.state_size()
    return {"mixer": mixer, "status": result["status"], "params": sum(p.numel() for p in model.parameters()),
            "state_size": state, "accuracy": result["val"], "train_tokens_per_s": result["train_tokens_per_s"],
            "train_time_s": result["train_s"], "final_loss": result["final_loss"]}


def run(cfg: MQARBenchConfig) -> list[dict]:
    """Train every mixer of ``cfg``, print a table, append one JSONL row per mixer to ``cfg.out``."""
    out_path = cfg.out
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
        row.update({f"config.{k}": v for k, v in cfg.model_dump().items() if k not in ("mixers", "out")})
        row.update({"torch": torch.__version__, "git": git_sha(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
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
        acc = f"{100 * r['accuracy']:>8.2f}%" if r["accuracy"] is not None else f"{r['status']:>9}"
        lines.append(f"{r['mixer']:<10} {r['params']:>8d} {r['state_size']:>8d} {acc} "
                     f"{r['train_tokens_per_s']:>12.0f} {r['wall_time_s']:>7.1f}")
    lines.append("state: recurrent-state elements per sequence per layer, short-conv buffers not counted "
                 "(attention: its KV cache at T)")
    return "\n".join(lines)

