"""`kalmix train`'s configuration: one pydantic model, read from YAML, overridden by dotted flags
(``--optim.lr 1e-3``), written resolved into the run directory.

Strict: an unknown or misspelt key is an error naming it, and values keep their types (``train.steps: true`` or
``3.0`` is an error, not 1 or 3; a float takes an int and YAML's ``1e-3``, which YAML 1.1 reads as a string).
A YAML file that does not parse is reported with its path, line and column; a key given twice is an error.

Resuming (``resume: auto``, the default): a run started again in a ``run_dir`` that holds checkpoints continues from
the newest and compares its config with that checkpoint's:

- the keys of ``FIXED_ON_RESUME`` (the model, tokenizer and data, ``seed``, ``train.seq_len``,
  ``train.global_batch_size``, ``train.parallel``, ``train.dtype``) cannot change in a run in progress: a change is
  refused before anything runs, naming each key with its old → new value;
- every other key may change (``train.steps`` upward, the optimizer's learning rate, schedule, warm-up, decay,
  betas, clipping, ``eval.*``, ``log.*``, ``checkpoint.*``, the micro-batch, device, threads, ...): the new value
  is used from the first resumed step, each change is printed and recorded in ``metrics.jsonl`` as
  ``{"kind": "resume", "changed": {key: [old, new]}}``, and ``config.yaml`` holds the new config;
- ``run_dir`` and ``resume`` describe the invocation and are not compared;
- ``train.steps`` below the newest checkpoint's step is an error naming both; equal to the step of a finished run
  (its model exported) reports the run complete and does nothing.
"""
from __future__ import annotations

import argparse
import json
import re
import typing
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from kalmix.layers import ALL_MIXERS, MIXER_SPECS
from kalmix.models.configuration import MLP_ACTS, NORMS, POSITIONS
from kalmix.train.data import DataConfig, Float, StrictConfig
from kalmix.train.tokenizer import MAX_VOCAB_SIZE

PRESETS_DIR = Path(__file__).parent / "presets"
# the keys (and sections) a resumed run must keep; every other key may change (module docstring)
FIXED_ON_RESUME = ("seed", "model", "tokenizer", "data", "train.seq_len", "train.global_batch_size",
                   "train.parallel", "train.dtype")
_NOT_COMPARED = ("run_dir", "resume")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _known_mixer(name: str, where: str) -> None:
    if name not in ALL_MIXERS:
        raise ValueError(f"unknown mixer {name!r}{where}; the mixers are {', '.join(sorted(ALL_MIXERS))}")


class ModelSection(StrictConfig):
    """The ``KalmixConfig`` of the model trained (vocab_size comes from the tokenizer)."""

    mixer: str = Field("gka", description=f"mixer of every layer ({', '.join(ALL_MIXERS)})")
    mixers: list[str] | None = Field(None, description="one mixer per layer (instead of mixer + attention_*)")
    attention_every: int | None = Field(None, ge=1, description="softmax attention in every k-th layer")
    attention_layers: list[int] = Field([], description="softmax attention in these layers (negative: from the end)")
    hidden_size: int = Field(256, ge=8, description="model width")
    num_hidden_layers: int = Field(4, ge=1, description="number of blocks")
    intermediate_size: int | None = Field(None, ge=1, description="MLP hidden width (default 8/3 · hidden_size)")
    match_params: str | None = Field(None, description="a mixer: the MLP width (a multiple of 64) that brings the "
                                                       "parameter count nearest that of the same model with this "
                                                       "mixer in every layer at the default width (instead of "
                                                       "intermediate_size)")
    mlp_act: Literal[MLP_ACTS] = Field("swiglu", description="swiglu, or gelu: a 2-layer GELU MLP with biases "
                                                            "(GPT-2's)")
    norm: Literal[NORMS] = Field("rmsnorm", description="the pre-norms and final norm: rmsnorm or layernorm")
    position: Literal[POSITIONS] = Field("none", description="none, or learned: absolute position embeddings "
                                                             "added to the tokens (attention still rotates q, k "
                                                             "unless its mixer_kwargs say rope: false)")
    max_position_embeddings: int | None = Field(None, ge=1, description="rows of the learned position embedding "
                                                                       "(position: learned; >= train.seq_len)")
    residual_init_scale: bool = Field(True, description="init std of the residual-out projections / "
                                                        "sqrt(2 · num_hidden_layers) (GPT-2's)")
    embedding_init_std: float | None = Field(None, gt=0, description="init std of the embeddings alone (default: "
                                                                     "1/sqrt(hidden_size))")
    mixer_kwargs: dict[str, dict[str, Any]] = Field({}, description="per mixer, its layer's keyword arguments")
    tie_word_embeddings: bool = Field(True, description="share the embedding and the LM head")
    vocab_size: int | None = Field(None, ge=1, description="embedding rows (default: the tokenizer's vocabulary "
                                                          "rounded up to a multiple of 64)")
    impl: Literal["naive", "torch", "triton"] | None = Field(None, description="op backend (default: by device)")
    fuse_cross_entropy: bool = Field(True, description="train on the loss computed from the last hidden states a "
                                                       "chunk of tokens at a time, without the [tokens, vocab] "
                                                       "logits (false: from the logits; the same loss)")
    recompute_mixers: bool = Field(False, description="each kalmix mixer runs its short convolution, norms, gates "
                                                      "and op again in the backward rather than keeping their "
                                                      "activations (less memory, one more forward of those parts)")

    @field_validator("mixer")
    @classmethod
    def _mixer(cls, v):
        _known_mixer(v, "")
        return v

    @field_validator("mixers")
    @classmethod
    def _mixers(cls, v):
        for i, name in enumerate(v or ()):
            _known_mixer(name, f" (layer {i})")
        return v

    @field_validator("match_params")
    @classmethod
    def _match_params(cls, v):
        if v is not None:
            _known_mixer(v, " (match_params)")
        return v

    @field_validator("mixer_kwargs")
    @classmethod
    def _mixer_kwargs(cls, v):
        for name in v:
            _known_mixer(name, "")
        return v

    @model_validator(mode="after")
    def _builds(self):
        if self.mixers is not None and (self.attention_every is not None or self.attention_layers):
            raise ValueError("give either `mixers` or `mixer` with `attention_every` / `attention_layers`")
        if self.match_params is not None and self.intermediate_size is not None:
            raise ValueError(f"give either `intermediate_size` ({self.intermediate_size}) or `match_params` "
                             f"({self.match_params!r}), not both")
        self.kalmix_config(self.vocab_size or 64)       # the models package's own checks, before any data
        return self

    def kalmix_config(self, vocab_size: int):
        """The ``KalmixConfig`` of this section with ``vocab_size`` embedding rows."""
        if self.match_params is not None:
            return self._matched(vocab_size)
        from kalmix.models import KalmixConfig
        kw = dict(vocab_size=vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
                  mixer_kwargs=self.mixer_kwargs, intermediate_size=self.intermediate_size,
                  tie_word_embeddings=self.tie_word_embeddings, impl=self.impl, mlp_act=self.mlp_act,
                  norm=self.norm, position=self.position, max_position_embeddings=self.max_position_embeddings,
                  residual_init_scale=self.residual_init_scale, embedding_init_std=self.embedding_init_std,
                  fuse_cross_entropy=self.fuse_cross_entropy, recompute_mixers=self.recompute_mixers)
        if self.mixers is not None:
            kw["mixers"] = self.mixers
        else:
            kw.update(mixer=self.mixer, attention_every=self.attention_every, attention_layers=self.attention_layers)
        return KalmixConfig(**kw)

    def _matched(self, vocab_size: int):
        """``kalmix_config`` with the MLP width of ``match_params``: counted on the meta device, the width that
        moves this model's count nearest the reference's (the same section with ``match_params`` in every
        layer at the default width; the MLP's count is linear in its width)."""
        from kalmix.models import KalmixForCausalLM

        def count(section) -> int:
            with torch.device("meta"):
                return sum(p.numel() for p in KalmixForCausalLM(section.kalmix_config(vocab_size)).parameters())

        plain = self.model_copy(update={"match_params": None})
        reference = plain.model_copy(update={"mixer": self.match_params, "mixers": None, "attention_every": None,
                                             "attention_layers": []})
        width = plain.kalmix_config(vocab_size).intermediate_size
        n0 = count(plain)
        per_step = count(plain.model_copy(update={"intermediate_size": width + 64})) - n0
        target = count(reference)
        steps = round((target - n0) / per_step)
        if width + 64 * steps < 64:
            raise ValueError(f"match_params {self.match_params!r}: this model has {n0:,} parameters at MLP width "
                             f"{width}, {n0 - target:,} more than the reference's {target:,}, and even width 64 "
                             f"cannot make that up; make the mixer smaller (mixer_kwargs) or leave match_params out")
        return plain.model_copy(update={"intermediate_size": width + 64 * steps}).kalmix_config(vocab_size)


class TokenizerSection(StrictConfig):
    path: str | None = Field(None, description="a local Hugging Face tokenizer directory; None: train a byte-level "
                                              "BPE on the training documents into the data cache")
    vocab_size: int = Field(8192, ge=259, le=MAX_VOCAB_SIZE, description="vocabulary of the BPE trained when path is "
                                                                         "None")


class OptimSection(StrictConfig):
    lr: Float = Field(3e-3, gt=0, description="peak learning rate (AdamW)")
    min_lr_ratio: Float = Field(0.1, ge=0, le=1, description="final learning rate as a fraction of the peak")
    schedule: Literal["cosine", "wsd", "constant"] = Field("cosine", description="after warm-up: cosine decay, "
                                                           "warmup-stable-decay, or constant")
    warmup_steps: int = Field(100, ge=0, description="linear warm-up steps")
    decay_fraction: Float = Field(0.2, gt=0, le=1, description="wsd: the final fraction of steps that decays")
    weight_decay: Float = Field(0.1, ge=0, description="AdamW weight decay of the matrices")
    decay_embeddings: bool = Field(False, description="weight decay on the token embeddings too (false: they are "
                                                      "exempt, as norms and biases are)")
    recurrent_lr_mult: Float = Field(1.0, gt=0, description="learning-rate multiplier of the recurrent parameters "
                                                            "(decays, noise, step sizes; no weight decay)")
    beta1: Float = Field(0.9, ge=0, lt=1)
    beta2: Float = Field(0.95, ge=0, lt=1)
    eps: Float = Field(1e-8, gt=0)
    grad_clip: Float | None = Field(1.0, gt=0, description="clip the global gradient norm (None: no clipping)")


class TrainSection(StrictConfig):
    steps: int = Field(1000, ge=1, description="optimizer steps")
    seq_len: int = Field(512, ge=2, description="tokens per packed row")
    global_batch_size: int = Field(32, ge=1, description="rows per optimizer step, over all processes")
    micro_batch_size: int = Field(8, ge=1, description="rows per forward pass on one process")
    device: str = Field("auto", description="auto (cuda if available), cpu, cuda (each process its local GPU) or "
                                            "cuda:N")
    dtype: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="autocast dtype (fp32: no autocast); "
                                                   "weights and optimizer state stay fp32")
    parallel: Literal["ddp", "fsdp"] = Field("ddp", description="data parallelism under torchrun: DDP or FSDP2 "
                                                               "(fully_shard)")
    compile: bool = Field(False, description="torch.compile each block's MLP (the mixers run "
                                                          "their own fused kernels)")
    activation_checkpointing: bool = Field(False, description="recompute each block in the backward")
    context_parallel: int = Field(1, ge=1, description="under torchrun, groups of this many consecutive processes "
                                                       "each hold one row split in as many pieces (context "
                                                       "parallelism); data parallelism runs over the groups")
    threads: int | None = Field(None, ge=1, description="torch CPU threads per process (default on CPU: 1 for "
                                                        "models under 50M parameters, else the process's share of "
                                                        "its CPUs; OMP_NUM_THREADS, when set, is kept)")

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        if not _DEVICE.fullmatch(v):
            raise ValueError(f"{v!r} is not a device kalmix trains on; allowed: auto, cpu, cuda, cuda:N")
        return v


class EvalSection(StrictConfig):
    every: int = Field(200, ge=1, description="validate every this many steps (and at the end)")
    rows: int = Field(64, ge=1, description="validation rows (the split's first)")
    position_buckets: int = Field(8, ge=1, description="loss by position in the document: this many "
                                                       "equal-width buckets of [0, seq_len)")


class CheckpointSection(StrictConfig):
    every: int = Field(500, ge=1, description="write a checkpoint every this many steps (and at the end)")
    keep: int = Field(2, ge=1, description="checkpoints kept (the newest)")


class LogSection(StrictConfig):
    every: int = Field(10, ge=1, description="a log line every this many steps")
    progress: bool = Field(True, description="progress bars on the first process (false: none, also none of "
                                             "transformers, tokenizers, datasets or the HF hub)")
    peak_tflops: Float | None = Field(None, gt=0, description="peak TFLOP/s per device for MFU (default: the "
                                                              "bf16 dense peak of a known GPU; none on CPU)")
    profile: int = Field(0, ge=0, description="record up to this many training steps with torch.profiler on "
                                              "every process, from the first log line on (stopping before the "
                                              "next log line, evaluation or checkpoint): RUN/profile/rank<R>.txt "
                                              "(ms per step by category, host time, the GPU's idle share, host "
                                              "syncs, the top kernels) and a Chrome trace beside it (0: none)")


class TrainConfig(StrictConfig):
    """Everything a run depends on. ``kalmix train CONFIG.yaml --section.key value ...``; what a resumed run may
    change is in this module's docstring."""

    run_dir: str = Field("runs/train", min_length=1, description="the run's folder: config, metrics.jsonl, checkpoints, model")
    seed: int = Field(0, ge=0, description="seed of the initialisation and the data order")
    data_dir: str | None = Field(None, description="folder of the tokenizer and token shards (default: "
                                                   "runs/data/<hash of the data and tokenizer settings and of the "
                                                   "source files' paths, sizes and modification times>)")
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
        t = self.train
        if t.global_batch_size % t.micro_batch_size:
            raise ValueError(f"train.global_batch_size = {t.global_batch_size} must be a multiple of "
                             f"train.micro_batch_size = {t.micro_batch_size}")
        m = self.model
        if m.position == "learned" and m.max_position_embeddings is not None and m.max_position_embeddings < t.seq_len:
            raise ValueError(f"model.max_position_embeddings = {m.max_position_embeddings} rows of learned positions "
                             f"cannot cover rows of train.seq_len = {t.seq_len} tokens; give at least {t.seq_len}")
        if t.context_parallel > 1:
            cp = f"train.context_parallel = {t.context_parallel}"
            if t.seq_len % t.context_parallel:
                raise ValueError(f"train.seq_len = {t.seq_len} must divide by {cp} (equal pieces of every row)")
            if t.activation_checkpointing:
                raise ValueError(f"train.activation_checkpointing does not compose with {cp}: its recomputation "
                                 f"would repeat the ranks' messages; turn one off")
            mixers = self.model.kalmix_config(self.model.vocab_size or 64).mixers
            split = [m for m in dict.fromkeys(mixers) if not MIXER_SPECS[m].context_parallel]
            if split:
                able = [name for name, spec in MIXER_SPECS.items() if spec.context_parallel]
                raise ValueError(f"{cp}: the {', '.join(split)} mixer cannot run on a row split across processes; "
                                 f"these can: {', '.join(able)}")
        return self

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each process of ``world_size`` (the data-parallel groups are
        world_size // train.context_parallel); a clear error when the processes or the batch do not divide."""
        cp = self.train.context_parallel
        if world_size % cp:
            raise ValueError(f"{world_size} process(es) do not split into groups of train.context_parallel = {cp}; "
                             f"start a multiple of {cp} under torchrun")
        groups = world_size // cp
        per_step = self.train.micro_batch_size * groups
        if self.train.global_batch_size % per_step:
            over = (f"{world_size} processes" if cp == 1 else
                    f"{groups} data-parallel groups ({world_size} processes / train.context_parallel = {cp})")
            raise ValueError(f"train.global_batch_size = {self.train.global_batch_size} rows does not divide over "
                             f"{over} × train.micro_batch_size = {self.train.micro_batch_size}")
        return self.train.global_batch_size // per_step

    def to_dict(self) -> dict:
        """The config as plain JSON types (what checkpoints and config.yaml hold)."""
        return json.loads(self.model_dump_json())

    def dump(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def resume_changes(saved: dict, cfg: TrainConfig) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """(refused, applied): the (dotted key, old, new) leaves where ``cfg`` differs from the ``saved`` config of a
    checkpoint, split by ``FIXED_ON_RESUME``. Keys the saved config does not have (an older kalmix) are not
    compared."""
    refused, applied = [], []
    for key, old, new in _diff(saved, cfg.to_dict()):
        if key.split(".")[0] in _NOT_COMPARED:
            continue
        fixed = any(key == k or key.startswith(k + ".") for k in FIXED_ON_RESUME)
        (refused if fixed else applied).append((key, old, new))
    return refused, applied


def _diff(old: dict, new: dict, prefix: str = ""):
    for k, v in new.items():
        if k not in old:
            continue
        if isinstance(v, dict) and isinstance(old[k], dict):
            yield from _diff(old[k], v, f"{prefix}{k}.")
        elif old[k] != v:
            yield prefix + k, old[k], v
    for k in old.keys() - new.keys():       # a mixer_kwargs entry removed, say
        yield prefix + k, old[k], None


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    """``key old → new, ...`` (values as JSON)."""
    return ", ".join(f"{k} {json.dumps(a)} → {json.dumps(b)}" for k, a, b in changes)


# ------------------------------------------------------------------------------------------ loading


def _leaves(model: type[BaseModel], prefix: str = ""):
    """(dotted key, field) of every leaf field."""
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _leaves(ann, f"{prefix}{name}.")
        else:
            yield prefix + name, field


def _section(loc: tuple) -> type[BaseModel] | None:
    model = TrainConfig
    for name in loc:
        field = model.model_fields.get(name) if isinstance(name, str) else None
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--section.key`` flag per config field (values parsed as YAML scalars: 1e-3, true, null, [1, 2]; a
    string field takes the text as it is, so ``--run_dir 2024`` is the folder '2024')."""
    for key, field in _leaves(TrainConfig):
        help_ = field.description or ""
        nargs = "+" if typing.get_origin(field.annotation) is list else None
        parser.add_argument(f"--{key}", dest=f"cfg:{key}", nargs=nargs, default=argparse.SUPPRESS,
                            metavar=key.split(".")[-1].upper(), help=help_)


class _Loader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""


def _mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice (first on line "
                                                    f"{seen[key]})", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _parse_yaml(text: str, where: str):
    """``text`` as YAML; a ValueError naming ``where`` and the line and column of a syntax error."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        context = f" ({e.context})" if e.context else ""
        raise ValueError(f"{where}, line {mark.line + 1}, column {mark.column + 1}: {e.problem}{context}") \
            from None
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not valid YAML: {e}") from None


def _is_text_field(field) -> bool:
    return field.annotation in (str, str | None)


def _flag_value(key: str, value, fields: dict):
    """An override's value: a flag's text parsed as YAML (a list flag: each item), kept as text for a string
    field; values that are not strings (from Python) are taken as they are."""
    if isinstance(value, list):
        return [_flag_value(key, v, {}) for v in value]
    if not isinstance(value, str):
        return value
    parsed = _parse_yaml(value, f"--{key} {value!r}")
    field = fields.get(key)
    if field is not None and _is_text_field(field) and not isinstance(parsed, str) and (
            parsed is not None or (field.annotation is str and not value.strip())):
        return value                                # '' stays '' where None is no value the field takes
    return parsed


def _set(tree: dict, key: str, value) -> None:
    *path, leaf = key.split(".")
    for p in path:
        tree = tree.setdefault(p, {})
        if not isinstance(tree, dict):
            raise ValueError(f"config key {key!r}: {p!r} is not a section")
    tree[leaf] = value


def _explain(err: dict) -> str:
    loc = ".".join(map(str, err["loc"]))
    if err["type"] == "extra_forbidden":
        section = _section(err["loc"][:-1])
        known = f" (known: {', '.join(section.model_fields)})" if section is not None else ""
        return f"{loc}: unknown key{known}"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] not in ("value_error", "missing"):
        msg += f" (got {err['input']!r})"
    return f"{loc}: {msg}" if loc else msg


def load_config(path: str | None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The config of a YAML file, or of a named preset of ``kalmix/train/presets`` when no file ``path`` exists,
    with dotted-key overrides (flag text parsed as YAML). Any error is a ValueError (FileNotFoundError for a
    missing file) naming the file, key or value."""
    tree: dict = {}
    if path is not None:
        file = Path(path)
        if not file.exists() and path in presets():
            file = PRESETS_DIR / f"{path}.yaml"
        if not file.is_file():
            what = "is a directory" if file.is_dir() else "does not exist"
            raise FileNotFoundError(f"config file {path!r} {what}; give a YAML file or a preset "
                                    f"({', '.join(presets())})")
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"config file {path}: not UTF-8 text (byte {e.start})") from None
        tree = _parse_yaml(text, f"config file {path}")
        if tree is None:
            raise ValueError(f"config file {path} is empty (or only comments); give its sections, or leave CONFIG "
                             f"out to train on the defaults")
        if not isinstance(tree, dict):
            raise ValueError(f"config file {path} must hold a mapping of sections, got {type(tree).__name__}")
    fields = dict(_leaves(TrainConfig))
    for key, value in (overrides or {}).items():
        _set(tree, key, _flag_value(key, value, fields))
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as e:
        where = f" ({path})" if path is not None else ""
        lines = [f"  {_explain(err)}" for err in e.errors()]
        raise ValueError(f"invalid training config{where}:\n" + "\n".join(lines)) from None


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
