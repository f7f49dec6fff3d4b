"""`kalmix train`'s configuration: one pydantic model (unknown keys are errors), read from YAML, overridden by
dotted flags (``--optim.lr 1e-3``), written resolved into the run directory."""
from __future__ import annotations

import argparse
import json
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kalmix.train.data import DataConfig

PRESETS_DIR = Path(__file__).parent / "presets"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Section):
    """The ``KalmixConfig`` of the model trained (vocab_size comes from the tokenizer)."""

    mixer: str = Field("gka", description="mixer of every layer (attention, gdn, kaczmarz, gka, vla, kalman, "
                                          "deltanet)")
    mixers: list[str] | None = Field(None, description="one mixer per layer (instead of mixer + attention_*)")
    attention_every: int | None = Field(None, ge=1, description="softmax attention in every k-th layer")
    attention_layers: list[int] = Field([], description="softmax attention in these layers (negative: from the end)")
    hidden_size: int = Field(256, ge=8, description="model width")
    num_hidden_layers: int = Field(4, ge=1, description="number of blocks")
    intermediate_size: int | None = Field(None, ge=1, description="SwiGLU width (default 8/3 · hidden_size)")
    mixer_kwargs: dict[str, dict[str, Any]] = Field({}, description="per mixer, its layer's keyword arguments")
    tie_word_embeddings: bool = Field(True, description="share the embedding and the LM head")
    vocab_size: int | None = Field(None, ge=1, description="embedding rows (default: the tokenizer's vocabulary "
                                                          "rounded up to a multiple of 64)")
    impl: Literal["naive", "torch", "triton"] | None = Field(None, description="op backend (default: by device)")


class TokenizerSection(_Section):
    path: str | None = Field(None, description="a local Hugging Face tokenizer directory; None: train a byte-level "
                                              "BPE on the training documents into the data cache")
    vocab_size: int = Field(8192, ge=259, description="vocabulary of the BPE trained when path is None")


class OptimSection(_Section):
    lr: float = Field(3e-3, gt=0, description="peak learning rate (AdamW)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final learning rate as a fraction of the peak")
    schedule: Literal["cosine", "wsd", "constant"] = Field("cosine", description="after warm-up: cosine decay, "
                                                           "warmup-stable-decay, or constant")
    warmup_steps: int = Field(100, ge=0, description="linear warm-up steps")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: the final fraction of steps that decays")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay of the matrices")
    recurrent_lr_mult: float = Field(1.0, gt=0, description="learning-rate multiplier of the recurrent parameters "
                                                            "(decays, noise, step sizes; no weight decay)")
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0, description="clip the global gradient norm (None: no clipping)")


class TrainSection(_Section):
    steps: int = Field(1000, ge=1, description="optimizer steps")
    seq_len: int = Field(512, ge=2, description="tokens per packed row")
    global_batch_size: int = Field(32, ge=1, description="rows per optimizer step, over all processes")
    micro_batch_size: int = Field(8, ge=1, description="rows per forward pass on one process")
    device: str = Field("auto", description="auto (cuda if available), cpu or cuda")
    dtype: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="autocast dtype (fp32: no autocast); "
                                                   "weights and optimizer state stay fp32")
    parallel: Literal["ddp", "fsdp"] = Field("ddp", description="data parallelism under torchrun: DDP or FSDP2 "
                                                               "(fully_shard)")
    compile: bool = Field(False, description="torch.compile each block's MLP (the mixers run "
                                                          "their own fused kernels)")
    activation_checkpointing: bool = Field(False, description="recompute each block in the backward")
    threads: int | None = Field(None, ge=1, description="torch CPU threads per process")


class EvalSection(_Section):
    every: int = Field(200, ge=1, description="validate every this many steps (and at the end)")
    rows: int = Field(64, ge=1, description="validation rows (the split's first)")
    position_buckets: int = Field(8, ge=1, description="loss by position in the document: this many "
                                                       "equal-width buckets of [0, seq_len)")


class CheckpointSection(_Section):
    every: int = Field(500, ge=1, description="write a checkpoint every this many steps (and at the end)")
    keep: int = Field(2, ge=1, description="checkpoints kept (the newest)")


class LogSection(_Section):
    every: int = Field(10, ge=1, description="a log line every this many steps")
    progress: bool = Field(True, description="a progress bar on the first process")
    peak_tflops: float | None = Field(None, gt=0, description="peak TFLOP/s per device for MFU (default: the "
                                                              "bf16 dense peak of a known GPU; none on CPU)")


class TrainConfig(_Section):
    """Everything a run depends on. ``kalmix train CONFIG.yaml --section.key value ...``."""

    run_dir: str = Field("runs/train", description="the run's folder: config, metrics.jsonl, checkpoints, model")
    seed: int = Field(0, description="seed of the initialisation and the data order")
    data_dir: str | None = Field(None, description="folder of the tokenizer and token shards (default: "
                                                   "runs/data/<hash of the data and tokenizer settings>)")
    resume: Literal["auto", "never", "required"] = Field("auto", description="auto: continue from the run "
                                                         "directory's newest checkpoint if there is one")
    model: ModelSection = ModelSection()
    tokenizer: TokenizerSection = TokenizerSection()
    data: DataConfig = DataConfig()
    optim: OptimSection = OptimSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    log: LogSection = LogSection()

    @model_validator(mode="after")
    def _batches(self):
        if self.train.global_batch_size % self.train.micro_batch_size:
            raise ValueError(f"train.global_batch_size = {self.train.global_batch_size} must be a multiple of "
                             f"train.micro_batch_size = {self.train.micro_batch_size}")
        return self

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each process; a clear error when the batch does not divide."""
        per_step = self.train.micro_batch_size * world_size
        if self.train.global_batch_size % per_step:
            raise ValueError(f"train.global_batch_size = {self.train.global_batch_size} rows does not divide over "
                             f"{world_size} processes × train.micro_batch_size = {self.train.micro_batch_size}")
        return self.train.global_batch_size // per_step

    def dump(self) -> str:
        return yaml.safe_dump(json.loads(self.model_dump_json()), sort_keys=False)


def _leaves(model: type[BaseModel], prefix: str = ""):
    """(dotted key, field) of every leaf field."""
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _leaves(ann, f"{prefix}{name}.")
        else:
            yield prefix + name, field


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--section.key`` flag per config field (values parsed as YAML scalars: 1e-3, true, null, [1, 2])."""
    for key, field in _leaves(TrainConfig):
        help_ = field.description or ""
        nargs = "+" if typing.get_origin(field.annotation) is list else None
        parser.add_argument(f"--{key}", dest=f"cfg:{key}", nargs=nargs, default=argparse.SUPPRESS,
                            metavar=key.split(".")[-1].upper(), help=help_)


def _set(tree: dict, key: str, value) -> None:
    *path, leaf = key.split(".")
    for p in path:
        tree = tree.setdefault(p, {})
        if not isinstance(tree, dict):
            raise ValueError(f"config key {key!r}: {p!r} is not a section")
    tree[leaf] = value


def _scalar(text):
    if isinstance(text, list):
        return [_scalar(t) for t in text]
    return yaml.safe_load(text) if isinstance(text, str) else text


def load_config(path: str | None, overrides: dict[str, Any] | None = None, preset: str | None = None) -> TrainConfig:
    """The config of a YAML file (or a named preset of ``kalmix/train/presets``), with dotted-key overrides.
    An unknown or misspelt key anywhere is an error naming it."""
    tree: dict = {}
    if preset is not None:
        p = PRESETS_DIR / f"{preset}.yaml"
        if not p.is_file():
            raise ValueError(f"unknown preset {preset!r}; presets: {presets()}")
        path = str(p)
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"config file {path!r} does not exist")
        tree = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(tree, dict):
            raise ValueError(f"config file {path!r} must hold a mapping of sections, got {type(tree).__name__}")
    for key, value in (overrides or {}).items():
        _set(tree, key, _scalar(value))
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as e:
        lines = [f"  {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise ValueError("invalid training config:\n" + "\n".join(lines)) from None


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
