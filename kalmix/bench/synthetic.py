"""`kalmix bench run RECIPE`: a paper's synthetic experiment as a pydantic recipe (``kalmix/bench/recipes/*.yaml``).

A recipe names a task of ``kalmix.tasks``, a model shape, the mixers to compare (each a ``KalmixConfig`` mixer with
its keyword arguments), a training protocol (steps, learning-rate sweep, seeds, early stopping) and a grid over any
of its fields (dotted paths such as ``task.params.num_kv_pairs`` or ``model.n_layers``), values that differ at some
grid points (``where``), and the paper's own budget (``budget``, which ours is measured against). Every (grid point,
mixer, seed, learning rate) is one run: train on the task's train split, evaluate the validation split every
``eval_every`` steps (early stopping, best weights kept), then score the test split at the training length and at
each of ``task.eval_lengths``. One JSON row per run is appended to the results file as soon as it finishes; a rerun
skips the runs already recorded there, and a run cut short (SIGTERM) continues from its checkpoint, so a recipe
larger than one sitting resumes where it stopped. ``kalmix bench report`` (``kalmix.bench.report``) turns the rows
into tables and plots.

Data: every mixer, seed and learning rate sees the same train / validation / test sets (drawn from
``data_seed``); the run's seed sets the initialisation and the order of the batches. Labels follow
``kalmix.tasks``' convention (logits[:, t] scored against labels[:, t]).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, computed_field, field_validator, model_validator
from tqdm.auto import tqdm

from kalmix.ops.common.checks import check_device
from kalmix.bench.checks import check_impl, check_model, check_out, read_jsonl_rows
from kalmix.layers import ALL_MIXERS, BASELINES, MIXER_SPECS
from kalmix.models import KalmixConfig, KalmixForCausalLM
from kalmix.models.modeling import mc_marginal
from kalmix.tasks import (CapacityMQARConfig, CompressionConfig, FuzzyRecallConfig, HardMQARConfig,
                          InContextRecallConfig, MemorizationConfig, MQARConfig, NeedleConfig, NoisyRecallConfig,
                          PalindromeConfig, SelectiveCopyingConfig, StackConfig, WordProblemConfig,
                          macro_micro_accuracy)
from kalmix.tasks.mad import sinusoidal_positions
from kalmix.train import checkpoint as ckpt
from kalmix.train.config import OptimSection
from kalmix.train.optim import Optimization, autocast, evaluating

# task kind -> (config class, the field that sets its length, whether it is a MAD task with train/test splits)
TASKS: dict[str, tuple[type[BaseModel], str, bool]] = {
    "mqar": (MQARConfig, "seq_len", False),
    "hard_mqar": (HardMQARConfig, "seq_len", False),
    "capacity_mqar": (CapacityMQARConfig, "seq_len", False),
    "word_problem": (WordProblemConfig, "seq_len", False),
    "needle": (NeedleConfig, "seq_len", False),
    "palindrome": (PalindromeConfig, "length", False),
    "stack": (StackConfig, "seq_len", False),
    "in_context_recall": (InContextRecallConfig, "seq_len", True),
    "noisy_recall": (NoisyRecallConfig, "seq_len", True),
    "fuzzy_recall": (FuzzyRecallConfig, "seq_len", True),
    "selective_copying": (SelectiveCopyingConfig, "seq_len", True),
    "compression": (CompressionConfig, "seq_len", True),
    "memorization": (MemorizationConfig, "seq_len", True),
}
METRICS = ("accuracy", "token_accuracy", "sequence_accuracy", "macro_accuracy")
Metric = Literal[METRICS]


class TaskSpec(BaseModel):
    """The task: ``kind`` (a key of ``TASKS``) and its config's fields other than the example counts."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal[tuple(TASKS)]
    params: dict[str, Any] = {}
    train_examples: int | None = Field(gt=0, description="a fixed training set of this many sequences; None: a "
                                       "fresh batch every step (no sequence seen twice)")
    val_examples: int = Field(256, gt=0)
    test_examples: int = Field(gt=0)
    eval_lengths: list[PositiveInt] = Field([], description="also test at these values of the task's length field")

    def check(self) -> None:
        """The task config's own validation, at the training length and each evaluation length."""
        self.config("train")
        for length in self.eval_lengths:
            self.config("test", length)

    def config(self, split: str, length: int | None = None, n: int | None = None) -> BaseModel:
        cls, length_field, mad = TASKS[self.kind]
        params = dict(self.params)
        if length is not None:
            params[length_field] = length
        n = n or {"train": self.train_examples or 1, "val": self.val_examples, "test": self.test_examples}[split]
        sizes = dict(num_train=n, num_test=n) if mad else dict(num_examples=n)
        return cls(**params, **sizes)

    def length(self) -> int:
        cfg = self.config("train")
        return getattr(cfg, TASKS[self.kind][1]) if self.kind != "capacity_mqar" else cfg.full_seq_len

    def vocab_size(self) -> int:
        cfg = self.config("train")
        return cfg.num_classes if self.kind == "word_problem" else cfg.vocab_size

    def build(self, split: str, data_seed: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs, labels [N, T] of ``split`` (train / val / test): the same for every run of a recipe."""
        cfg = self.config(split, length)
        salt = {"train": 0, "val": 1, "test": 2}[split]
        if TASKS[self.kind][2]:                               # MAD: its own train/test generators
            return cfg.build(2 * data_seed + (salt == 1), "train" if split == "train" else "test")
        return cfg.build(3 * data_seed + salt + (length or 0) * 1_000_003)

    def fresh_batch(self, n: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A training batch [n, T] of its own (``train_examples`` None), a function of (seed, step); never the
        validation or test draws (their seeds are ``build``'s, below 2**40)."""
        cfg = self.config("train", n=n)
        s = 2 ** 40 + seed * 2 ** 24 + step
        return cfg.build(s, "train") if TASKS[self.kind][2] else cfg.build(s)


class ModelSpec(BaseModel):
    """The model around the mixers: ``n_layers`` pre-norm blocks of width ``d_model``, SwiGLU MLPs or none."""

    model_config = ConfigDict(extra="forbid")

    d_model: int = Field(128, gt=0)
    n_layers: int = Field(2, gt=0)
    mlp: bool = False
    intermediate_size: int | None = Field(None, gt=0, description="the SwiGLU MLPs' hidden width (None: "
                                          "KalmixConfig's 8/3 · d_model rounded up to a multiple of 64)")
    tie_embeddings: bool = Field(False, description="share the token embedding with the LM head")
    init_std: float | None = Field(None, gt=0, description="std of every linear and embedding weight "
                                   "(KalmixConfig.initializer_range; None: kalmix's fan-in scale)")


class MixerSpec(BaseModel):
    """One compared model: a ``KalmixConfig`` mixer, its layer's keyword arguments and other config fields
    (e.g. ``mc_samples`` for KLA+, or a backbone: ``norm``, ``mlp_act``, ``position``, ``residual_init_scale``, ``embedding_init_std``;
    ``position: learned`` gets ``max_position_embeddings`` = the task's longest test length unless given)."""

    model_config = ConfigDict(extra="forbid")

    mixer: str
    kwargs: dict[str, Any] = {}
    config: dict[str, Any] = {}
    precision: Literal["fp32", "bf16"] | None = Field(
        None, description="this mixer's autocast precision instead of train.precision (fla's DeltaNet: bf16 only)")

    @field_validator("mixer")
    @classmethod
    def _known(cls, v):
        if v not in ALL_MIXERS:
            raise ValueError(f"unknown mixer {v!r}; expected one of {sorted(ALL_MIXERS)}")
        return v


class TrainSpec(BaseModel):
    """AdamW on the task's cross-entropy; warm-up then cosine to zero (or constant); the best of ``lrs`` by
    validation. A run trains through ``kalmix train``'s optimisation with ``optim(lr)`` (see ``fit``)."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(gt=0)
    batch_size: int = Field(64, gt=0)
    lrs: list[PositiveFloat] = Field(min_length=1)
    seeds: list[int] = Field([0], min_length=1)
    weight_decay: float = Field(0.1, ge=0)
    decay_embeddings: bool = Field(True, description="weight decay on the token embeddings too, as the papers' "
                                   "released code decays every matrix (false: exempt, as ``kalmix train``'s default)")
    betas: tuple[float, float] = Field((0.9, 0.98), description="AdamW's (beta1, beta2)")
    warmup: float = Field(0.1, ge=0, lt=1, description="fraction of steps of linear warm-up")
    schedule: Literal["cosine", "constant"] = "cosine"
    grad_clip: float | None = Field(1.0, gt=0)
    eval_every: int = Field(200, gt=0)
    patience: int | None = Field(None, gt=0, description="stop after this many evaluations without improvement")
    stop_at: float | None = Field(None, gt=0, le=1, description="stop once the validation metric reaches this")
    sampling: Literal["replacement", "epochs"] = Field(
        "replacement", description="how batches are drawn from a fixed training set: uniformly with replacement, "
        "or epochs of a fresh permutation each (a DataLoader's shuffle; an epoch's last partial batch dropped)")
    precision: Literal["fp32", "bf16"] = "fp32"

    @field_validator("lrs", "seeds")
    @classmethod
    def _each_once(cls, v, info):
        twice = sorted({x for x in v if v.count(x) > 1})
        if twice:
            raise ValueError(f"{info.field_name} {v} gives {', '.join(map(str, twice))} more than once; give each "
                             f"value once (its runs would be counted twice)")
        return v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v):
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"betas must both be in [0, 1), got {v}")
        return v

    def optim(self, lr: float) -> OptimSection:
        """``kalmix train``'s optimizer section of a run at peak learning rate ``lr``: warm-up over the first
        ``warmup`` fraction of the steps, then ``schedule`` (cosine down to zero at the last step)."""
        return OptimSection(lr=lr, min_lr_ratio=0.0, schedule=self.schedule, warmup_steps=int(self.warmup * self.steps),
                            weight_decay=self.weight_decay, decay_embeddings=self.decay_embeddings,
                            beta1=self.betas[0], beta2=self.betas[1], grad_clip=self.grad_clip)


class ReportSpec(BaseModel):
    """How ``kalmix bench report`` shows the recipe: ``curve`` (metric against ``x``, one line per mixer, a panel
    per value of ``panel``), ``table`` (a column per value of ``x``) or ``min_depth`` (per value of ``x``, the
    fewest ``depth`` at which some seed reaches ``threshold``). ``x`` is a grid path or ``eval_length``."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["curve", "table", "min_depth"] = "curve"
    x: str
    panel: str | None = None
    depth: str = "model.n_layers"
    threshold: float = Field(0.9, gt=0, le=1)
    log_x: bool = False
    also: list[Metric] = Field([], description="test metrics shown beside the recipe's own, in the same layout")
    solve_at: float | None = Field(None, gt=0, le=1, description="a run solves the task once its validation "
                                   "metric reaches this: the report gives per mixer and grid point the fraction of "
                                   "seeds that do within the budget and the median step at which they do")


class Reference(BaseModel):
    """A paper's number: ``value`` of ``mixer`` (a recipe mixer label) at the grid point ``at``."""

    model_config = ConfigDict(extra="forbid")

    mixer: str
    at: dict[str, Any] = {}
    value: float


class Budget(BaseModel):
    """The paper's training budget at one grid point, as its text or released code states it: a run is ``steps`` of
    ``batch_size`` sequences, or ``epochs`` over ``train_examples`` sequences (None where the paper does not give
    its data-set size); the sweep is that times ``lrs`` learning rates and ``seeds`` seeds. Both are maxima where
    the paper stops early."""

    model_config = ConfigDict(extra="forbid")

    steps: int | None = Field(None, gt=0)
    batch_size: int | None = Field(None, gt=0)
    epochs: float | None = Field(None, gt=0)
    train_examples: int | None = Field(None, gt=0)
    lrs: int = Field(1, gt=0)
    seeds: int = Field(1, gt=0)
    source: str = Field(min_length=1, description="where the paper or its code states this budget")

    @model_validator(mode="after")
    def _one_unit(self):
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("budget: give either steps (with batch_size) or epochs (with train_examples)")
        if self.steps is not None and self.batch_size is None:
            raise ValueError("budget: steps needs batch_size")
        return self

    def sequences(self) -> float | None:
        """Training sequences of one run (None: the paper does not say)."""
        if self.steps is not None:
            return float(self.steps * self.batch_size)
        return None if self.train_examples is None else self.epochs * self.train_examples

    def describe(self) -> str:
        run = (f"{self.steps:,} steps of {self.batch_size}" if self.steps is not None else
               f"{self.epochs:g} epochs of {f'{self.train_examples:,}' if self.train_examples else 'an unstated'} "
               f"sequences")
        return f"{run} × {self.lrs} learning rate(s) × {self.seeds} seed(s) ({self.source})"


class Override(BaseModel):
    """Recipe values that differ at some grid points: ``set`` (path -> value, as ``--set``) applies at every grid
    point that has the values of ``at`` (grid path -> value), e.g. a batch size per sequence length."""

    model_config = ConfigDict(extra="forbid")

    at: dict[str, Any] = Field(min_length=1)
    set: dict[str, Any] = Field(min_length=1)

    def applies(self, point: dict[str, Any]) -> bool:
        return all(point.get(path) == value for path, value in self.at.items())


class Recipe(BaseModel):
    """One paper table or figure as an experiment (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9_]+$")
    paper: str
    source: str = Field(description="where in the paper the compared numbers are")
    claim: str
    deviations: str = Field("", description="how this recipe differs from the paper's protocol, and why")
    task: TaskSpec
    model: ModelSpec = ModelSpec()
    mixers: dict[str, MixerSpec] = Field(min_length=1)
    train: TrainSpec
    grid: dict[str, list[Any]] = {}
    where: list[Override] = Field([], description="values set at some grid points only")
    metric: Metric = "accuracy"
    data_seed: int = Field(0, ge=0)
    report: ReportSpec
    references: list[Reference] = []
    budget: Budget | None = Field(None, description="the paper's budget; the report and --dry-run give ours as a "
                                  "fraction of it")

    @model_validator(mode="before")
    @classmethod
    def _derived(cls, data):
        if isinstance(data, dict) and "budget_fraction" in data:     # a dump's computed field, recomputed here
            data = {k: v for k, v in data.items() if k != "budget_fraction"}
        return data

    @computed_field
    @property
    def budget_fraction(self) -> dict[str, float | None] | None:
        """Our budget over the paper's (``budget``): ``run`` (steps × batch of one run) and ``sweep`` (times the
        learning rates and seeds); None where the paper does not state its size."""
        if self.budget is None:
            return None
        paper = self.budget.sequences()
        if paper is None:
            return {"run": None, "sweep": None}
        run = self.train.steps * self.train.batch_size / paper
        sweep = run * len(self.train.lrs) * len(self.train.seeds) / (self.budget.lrs * self.budget.seeds)
        return {"run": round(run, 4), "sweep": round(sweep, 4)}

    def budget_line(self) -> str:
        """The paper's budget, ours, and the fraction, in words."""
        if self.budget is None:
            return "the recipe states no paper budget"
        f, t = self.budget_fraction, self.train
        ours = (f"{t.steps:,} steps of {t.batch_size} × {len(t.lrs)} learning rate(s) × {len(t.seeds)} seed(s)")
        frac = ("the paper does not state its data-set size, so no fraction" if f["run"] is None else
                f"{100 * f['run']:.3g}% of a paper run, {100 * f['sweep']:.3g}% of its sweep")
        return f"paper: {self.budget.describe()}; here: {ours}: {frac}"

    @model_validator(mode="after")
    def _check(self):
        for path, values in self.grid.items():
            if not values:
                raise ValueError(f"grid[{path!r}] is empty")
            twice = [v for i, v in enumerate(values) if v in values[:i]]
            if twice:
                raise ValueError(f"grid[{path!r}] gives {twice[0]!r} more than once; give each value once (its "
                                 f"runs would be counted twice)")
            _get(self.model_dump(exclude={"grid"}), path)        # the path exists
        for o in self.where:                                  # (an entry whose values left the grid is idle)
            for path in o.at:
                if path not in self.grid:
                    raise ValueError(f"where: at {path!r} is not a grid path ({sorted(self.grid)})")
            for path in o.set:
                if path in self.grid:
                    raise ValueError(f"where: {path!r} is a grid path; set it through the grid")
                _get(self.model_dump(exclude={"grid"}), path)
        if self.task.train_examples is not None and self.train.batch_size > self.task.train_examples:
            raise ValueError(f"train.batch_size = {self.train.batch_size} exceeds the fixed training set "
                             f"task.train_examples = {self.task.train_examples}")
        for ref in self.references:
            if ref.mixer not in self.mixers:
                raise ValueError(f"reference names mixer {ref.mixer!r}, not among {sorted(self.mixers)}")
        axes = [self.report.x] + ([self.report.panel] if self.report.panel else [])
        if self.report.kind == "min_depth":
            axes.append(self.report.depth)
        for axis in axes:
            if axis != "eval_length" and axis not in self.grid:
                raise ValueError(f"report axis {axis!r} is neither a grid path ({sorted(self.grid)}) nor "
                                 f"'eval_length'")
        if self.report.x == "eval_length" and not self.task.eval_lengths:
            raise ValueError("report.x = 'eval_length' needs task.eval_lengths")
        base = self.model_dump(exclude={"grid"})
        for point in self.points():                           # every grid point is a valid recipe
            if (all(_get(base, path) == value for path, value in point.items())
                    and not any(o.applies(point) for o in self.where)):
                self.task.check()                             # this recipe is at the point
            else:
                self.at(point)
        return self

    def points(self) -> list[dict[str, Any]]:
        """The grid's points in order: dicts path -> value ([{}] without a grid)."""
        keys = list(self.grid)
        return [dict(zip(keys, combo)) for combo in itertools.product(*(self.grid[k] for k in keys))]

    def at(self, point: dict[str, Any]) -> Recipe:
        """The recipe with the grid point's values set, then those of the ``where`` entries that apply there (its
        grid: that single point; its ``where``: none left)."""
        data = self.model_dump()
        for path, value in point.items():
            _set(data, path, value)
        for o in self.where:
            if o.applies(point):
                for path, value in o.set.items():
                    _set(data, path, value)
        data["grid"] = {path: [value] for path, value in point.items()}
        data["where"] = []
        return Recipe.model_validate(data)

    def test_lengths(self) -> list[int]:
        """The training length, then each of ``task.eval_lengths`` not equal to it."""
        first = self.task.length()
        return [first] + [L for L in self.task.eval_lengths if L != first]

    def planned_runs(self, mixers: int | None = None) -> int:
        """Runs of the whole grid, for all the recipe's mixers or for ``mixers`` of them."""
        return len(self.points()) * (mixers or len(self.mixers)) * len(self.train.seeds) * len(self.train.lrs)


def _get(data: dict, path: str):
    node = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            if isinstance(node, dict) and path.startswith("task.params."):
                return None                                    # a task parameter left at its default
            raise ValueError(f"grid path {path!r} does not name a recipe field")
        node = node[part]
    return node


def _set(data: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"{path!r}: {part!r} holds a value, not fields")
    node[leaf] = value


RECIPES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class RunOptions(BaseModel):
    """How ``kalmix bench run`` runs a recipe (every field a flag of the command; ``recipe`` its argument)."""

    model_config = ConfigDict(extra="forbid")

    recipe: str = Field(description="recipe YAML file, or the name of one shipped with kalmix (kalmix/bench/recipes)")
    out: str | None = Field(None, description="JSONL results file (none: runs/bench/RECIPE.jsonl); runs already in "
                            "it are skipped")
    device: str = Field(default_factory=_default_device, description="torch device: cpu, cuda or cuda:N (default: "
                        "cuda if available)")
    impl: Literal["naive", "torch", "triton"] | None = Field(None, description="kalmix ops' backend (none: triton "
                                                                               "on CUDA, torch otherwise)")
    mixers: list[str] | None = Field(None, description="only these of the recipe's mixer labels (none: all)")
    set: list[str] = Field([], description="PATH=VALUE overrides of recipe fields, VALUE as YAML, e.g. --set "
                           "train.steps=200 --set 'grid.task.params.num_kv_pairs=[4, 8]'")
    dry_run: bool = Field(False, description="check everything, print the resolved recipe and the number of runs")

    def out_path(self, recipe: Recipe) -> str:
        return os.path.join("runs", "bench", recipe.name + ".jsonl") if self.out is None else self.out


def recipe_names() -> list[str]:
    """The names of the recipes shipped with kalmix."""
    return sorted(f[:-5] for f in os.listdir(RECIPES_DIR) if f.endswith(".yaml"))


def resolve_recipe(name_or_path: str) -> str:
    """A recipe's file: an existing path as given, else the shipped recipe of that name."""
    if os.path.isdir(name_or_path):
        raise ValueError(f"recipe {name_or_path!r} is a folder; give a recipe YAML file or the name of a shipped "
                         f"recipe: {', '.join(recipe_names())}")
    if os.path.exists(name_or_path):
        return name_or_path
    shipped = os.path.join(RECIPES_DIR, name_or_path.removesuffix(".yaml") + ".yaml")
    if os.path.exists(shipped):
        return shipped
    raise FileNotFoundError(f"recipe {name_or_path!r} is neither a file nor a shipped recipe; shipped: "
                            f"{', '.join(recipe_names())}")


def load_recipe(path: str, overrides: list[str] = ()) -> Recipe:
    """A recipe from YAML, with ``PATH=VALUE`` overrides (VALUE parsed as YAML; ``grid.<path>=[...]`` replaces
    one grid axis). An override holds at every grid point: it replaces what the recipe's ``where`` entries set on
    that path (or inside it). Unknown fields are errors; so is YAML that does not parse (naming the file and line,
    or the override)."""
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe is a YAML mapping")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not PATH=VALUE")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ValueError(f"override {item!r}: VALUE is not valid YAML: {_yaml_problem(e)}") from None
        if key.startswith("grid."):
            data.setdefault("grid", {})[key[5:]] = value
            continue
        if key in (data.get("grid") or {}):
            raise ValueError(f"override {item!r}: the grid sets {key} at every point; override the axis instead, "
                             f"e.g. grid.{key}=[{value}]")
        _set(data, key, value)
        for entry in data.get("where") or []:
            if isinstance(entry, dict) and isinstance(entry.get("set"), dict):
                entry["set"] = {p: v for p, v in entry["set"].items() if p != key and not p.startswith(key + ".")}
        data["where"] = [e for e in data.get("where") or [] if not isinstance(e, dict) or e.get("set") != {}]
    return Recipe.model_validate(data)


def _yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(err, 'problem', None) or err}{where}"


# ------------------------------------------------------------------------------------------------- models

class CompressionModel(nn.Module):
    """MAD's compression autoencoder: the LM's last hidden state h [N, d], broadcast to every position with a fixed
    sinusoidal position code added, through a residual 2-layer MLP and the LM head: logits [N, T, V]. With the LM's
    ``mc_samples`` = S > 0 (KLA+) the encoder runs S times with sampled Kalman readouts and the logits are the
    Monte-Carlo marginal log-probs, as ``KalmixForCausalLM`` returns them."""

    def __init__(self, lm: KalmixForCausalLM, seq_len: int):
        super().__init__()
        d = lm.config.hidden_size
        self.lm = lm
        self.decoder = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.register_buffer("positions", sinusoidal_positions(seq_len, d), persistent=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        S = self.lm.config.mc_samples
        x = inputs.repeat(S, 1) if S else inputs
        h = self.lm.model(x, sample_readout=bool(S)).last_hidden_state[:, -1]
        z = h[:, None] + self.positions[:inputs.shape[1]].to(h.dtype)
        logits = self.lm.lm_head(z + self.decoder(z))
        return mc_marginal(logits, S) if S else logits


def lm_config(recipe: Recipe, spec: MixerSpec, impl: str | None) -> KalmixConfig:
    """The language model of ``spec`` in ``recipe``'s model shape, on the task's vocabulary."""
    m, config = recipe.model, dict(spec.config)
    if config.get("position") == "learned":
        config.setdefault("max_position_embeddings", max(recipe.test_lengths()))
    return KalmixConfig(vocab_size=recipe.task.vocab_size(), hidden_size=m.d_model, num_hidden_layers=m.n_layers,
                        mixer=spec.mixer, mixer_kwargs={spec.mixer: spec.kwargs} if spec.kwargs else None, mlp=m.mlp,
                        intermediate_size=m.intermediate_size, initializer_range=m.init_std,
                        tie_word_embeddings=m.tie_embeddings, impl=impl, **config)


def build_model(recipe: Recipe, spec: MixerSpec, impl: str | None) -> nn.Module:
    lm = KalmixForCausalLM(lm_config(recipe, spec, impl))
    if recipe.task.kind == "compression":
        return CompressionModel(lm, recipe.task.length())
    return lm


def logits_of(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return model(inputs) if isinstance(model, CompressionModel) else model(inputs).logits


def scores(pred: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Every metric of predictions pred [N, T] against labels [N, T] (−100: not scored):
    ``accuracy`` (per example, the mean over its scored positions, then the mean over examples: Zoology's),
    ``token_accuracy`` (pooled), ``sequence_accuracy`` (every scored position right), ``macro_accuracy`` (the
    mean over classes of per-class accuracy: MAD's)."""
    scored = labels != -100
    hit = (pred == labels) & scored
    per_example = hit.sum(1).double() / scored.sum(1).clamp_min(1).double()
    macro, micro = macro_micro_accuracy(pred, labels)
    return {"accuracy": per_example[scored.any(1)].mean().item(), "token_accuracy": micro,
            "sequence_accuracy": (hit.sum(1) == scored.sum(1)).double().mean().item(), "macro_accuracy": macro}


def evaluate(model: nn.Module, inputs, labels, device, precision: str, tokens: int = 2 ** 17) -> dict[str, float]:
    """``scores`` of the model's arg-max predictions on inputs [N, T], in batches of about ``tokens`` tokens."""
    batch_size = max(1, tokens // inputs.shape[1])
    preds = []
    with evaluating(model), autocast(device.type, precision):
        for i in range(0, len(inputs), batch_size):
            preds.append(logits_of(model, inputs[i:i + batch_size].to(device)).argmax(-1).cpu())
    return scores(torch.cat(preds), labels)


def what_ran(model: nn.Module, device: torch.device) -> str:
    """The kernels behind each mixer of ``model``, e.g. ``kaczmarz: kalmix triton``."""
    lm = model.lm if isinstance(model, CompressionModel) else model
    parts = {}
    for block in lm.model.layers:
        layer, name = block.mixer, block.mixer_type
        if name in BASELINES:
            import fla
            parts[name] = f"fla {fla.__version__}"
        elif name == "attention":
            parts[name] = "torch sdpa"
        elif "triton" not in MIXER_SPECS[name].op.impls:          # pure PyTorch, no Triton impl
            parts[name] = f"kalmix {layer.impl or 'torch'} (chunked PyTorch)"
        else:
            parts[name] = f"kalmix {layer.impl or ('triton' if device.type == 'cuda' else 'torch')}"
    return ", ".join(f"{k}: {v}" for k, v in parts.items())


# ------------------------------------------------------------------------------------------------- a run

class Stopped(Exception):
    """A run interrupted by SIGTERM (``timeout``): its checkpoint holds its progress; no result row is written."""


_STOP = threading.Event()           # set by the SIGTERM handler ``run`` installs; polled after every step


def _request_stop(signum, frame) -> None:
    _STOP.set()


def epoch_batch(n_train: int, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """Indices [batch_size] into a fixed training set of ``n_train`` at ``step`` with ``sampling: epochs``: a fresh
    permutation per epoch (a function of (seed, epoch)) cut into batches, the last partial one dropped."""
    epoch, i = divmod(step, n_train // batch_size)
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed * 2 ** 24 + epoch))
    return perm[i * batch_size:(i + 1) * batch_size]


class Batches:
    """A run's training batches, inputs and labels [batch_size, T], by step: drawn from the fixed training set
    ``fixed`` with replacement (one stream of draws seeded by ``seed``) or in epochs (``epoch_batch``), as
    ``train.sampling`` says; or, when ``fixed`` is None, fresh draws of ``task`` (``TaskSpec.fresh_batch``).
    ``state_dict`` / ``load_state_dict``: the position of the stream of draws, for checkpoints."""

    def __init__(self, train: TrainSpec, seed: int, fixed: tuple[torch.Tensor, torch.Tensor] | None = None,
                 task: TaskSpec | None = None):
        if fixed is None and task is None:
            raise ValueError("Batches needs a fixed training set or a task to draw fresh batches of")
        self.train, self.seed, self.fixed, self.task = train, seed, fixed, task
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.train.batch_size
        if self.fixed is None:
            return self.task.fresh_batch(n, self.seed, step)
        x, y = self.fixed
        idx = (torch.randint(len(x), (n,), generator=self.gen) if self.train.sampling == "replacement"
               else epoch_batch(len(x), n, self.seed, step))
        return x[idx], y[idx]

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])


def fit(model: nn.Module, train: TrainSpec, lr: float, batches: Batches, validate: Callable[[], float],
        device: torch.device, precision: str, checkpoint: str | None = None, desc: str = "",
        progress: bool = True) -> dict:
    """Train ``model`` by ``train``'s protocol at peak learning rate ``lr`` on ``batches`` (the mean cross-entropy
    of logits[:, t] against labels[:, t]) through ``kalmix train``'s optimisation (``kalmix.train.optim``: its
    parameter groups, schedule, autocast, clipping and update, configured by ``train.optim(lr)``).

    ``validate()``, the validation metric (higher is better), runs every ``train.eval_every`` steps and after the
    last: the best weights are kept, ``train.stop_at`` and ``train.patience`` stop the run early, and a non-finite
    mean training loss ends it as ``diverged``. The best weights are in ``model`` at the end.

    ``checkpoint``: a folder of ``kalmix.train.checkpoint`` checkpoints (weights, optimizer, random states, the
    batches' position, the best weights and the history), written at every evaluation but the last and when
    SIGTERM arrives (then ``Stopped`` is raised), and read at the start: a run cut short continues where it
    stopped, on the same batches.

    Returns {status ("ok" or "diverged"), steps_run, best_step, val (None: no evaluation), final_loss (the mean
    training loss since the evaluation before the last), history ([step, that loss, val] per evaluation),
    train_s, train_tokens_per_s, and resumed_at (the steps a run continued from) when it was resumed}."""
    opt = Optimization(model, train.optim(lr), train.steps, device, precision)
    st = {"best": -1.0, "best_step": 0, "best_state": None, "bad_evals": 0, "history": [], "tokens": 0,
          "train_s": 0.0, "loss_sum": 0.0, "loss_n": 0, "resumed_at": []}
    first = 0
    saved = ckpt.checkpoints(checkpoint) if checkpoint is not None else []
    if saved:
        meta = ckpt.load(saved[-1], model, opt.optimizer, sharded=False)
        batches.load_state_dict(meta["loader"]["batches"])
        st.update(meta["loader"]["progress"])
        first = meta["step"]
        st["resumed_at"] = st["resumed_at"] + [first]

    def save(step: int) -> None:
        if checkpoint is not None:
            done = {**st, "train_s": st["train_s"] + time.perf_counter() - t0, "loss_sum": float(st["loss_sum"])}
            ckpt.save(checkpoint, step, model, opt.optimizer, {"batches": batches.state_dict(), "progress": done},
                      {"train": train.model_dump(mode="json"), "lr": lr}, sharded=False, keep=1)

    status, step = "ok", first - 1
    loss_value = st["history"][-1][1] if st["history"] else float("nan")
    t0 = time.perf_counter()
    bar = tqdm(range(first, train.steps), desc=desc, leave=False, disable=None if progress else True,
               dynamic_ncols=True, initial=first, total=train.steps)
    for step in bar:
        x, y = batches(step)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with opt.autocast():
            logits = logits_of(model, x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.backward(loss)
        opt.clip(model.parameters())
        opt.update(step)
        st["tokens"] += x.numel()
        st["loss_sum"] = st["loss_sum"] + loss.detach()
        st["loss_n"] += 1
        if (step + 1) % train.eval_every == 0 or step == train.steps - 1:
            loss_value = (st["loss_sum"] / st["loss_n"]).item()        # the mean training loss since the last one
            st["loss_sum"], st["loss_n"] = 0.0, 0
            if not math.isfinite(loss_value):
                status = "diverged"
                break
            val = validate()
            st["history"].append([step + 1, round(loss_value, 5), round(val, 5)])
            bar.set_postfix(loss=f"{loss_value:.3f}", val=f"{val:.3f}")
            if val > st["best"]:
                st.update(best=val, best_step=step + 1, bad_evals=0,
                          best_state={k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
            else:
                st["bad_evals"] += 1
            if train.stop_at is not None and st["best"] >= train.stop_at:
                break
            if train.patience is not None and st["bad_evals"] >= train.patience:
                break
            if step + 1 < train.steps:
                save(step + 1)
        if _STOP.is_set():
            save(step + 1)
            bar.close()
            raise Stopped(f"stopped by SIGTERM after step {step + 1} of {train.steps}")
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = st["train_s"] + time.perf_counter() - t0
    if st["best_state"] is not None:
        model.load_state_dict(st["best_state"])
    out = {"status": status, "steps_run": step + 1, "best_step": st["best_step"],
           "val": st["best"] if st["best"] >= 0 else None, "final_loss": loss_value, "history": st["history"],
           "train_s": round(train_s, 2), "train_tokens_per_s": round(st["tokens"] / max(train_s, 1e-9))}
    if st["resumed_at"]:
        out["resumed_at"] = st["resumed_at"]
    return out


def run_one(recipe: Recipe, label: str, lr: float, seed: int, data: dict, device: torch.device,
            impl: str | None = None, progress: bool = True, checkpoint: str | None = None) -> dict:
    """Train one (mixer, lr, seed) at one grid point (``recipe`` already at it) with ``fit`` and score its best
    weights on the test sets. ``data``: ``{"train": (x, y) or None, "val": (x, y), "test": {length: (x, y)}}``;
    ``checkpoint``: ``fit``'s. Returns the result row."""
    spec, train = recipe.mixers[label], recipe.train
    precision = spec.precision or train.precision
    torch.manual_seed(seed)
    model = build_model(recipe, spec, impl).to(device)
    x_va, y_va = data["val"]
    result = fit(model, train, lr, Batches(train, seed, data["train"], recipe.task),
                 lambda: evaluate(model, x_va, y_va, device, precision)[recipe.metric], device, precision,
                 checkpoint, f"{label} lr={lr:g} seed={seed}", progress)
    row = {"status": result.pop("status"), "precision": precision, **result, "test": {}}
    if row["val"] is not None:
        for length, (x_te, y_te) in data["test"].items():
            row["test"][str(length)] = evaluate(model, x_te, y_te, device, precision)
    lm = model.lm if isinstance(model, CompressionModel) else model
    layer = lm.model.layers[0].mixer
    row["state_size"] = (layer.state_size(recipe.task.length()) if lm.model.layers[0].mixer_type == "attention"
                         else layer.state_size())
    row["params"] = sum(p.numel() for p in model.parameters())
    row["ran"] = what_ran(model, device)
    return row


# fields added to the recipe schema after results were first recorded: left out of a run's key while at their
# default (the behaviour before they existed), so that those results keep their keys
_LATER_DEFAULTS = {"train": {"betas": (0.9, 0.98), "sampling": "replacement", "decay_embeddings": True},
                   "model": {"intermediate_size": None, "tie_embeddings": False, "init_std": None}}


def _keyed(part: str, dump: dict) -> dict:
    later = _LATER_DEFAULTS[part]
    return {k: v for k, v in dump.items() if not (k in later and v == later[k])}


def run_key(recipe: Recipe, point: dict, label: str, lr: float, seed: int) -> str:
    """Identifies a run in a results file by everything that changes its outcome: the recipe at the grid point
    (``recipe.at(point)``: its task, model, this mixer, training protocol, data seed and metric), lr and seed."""
    blob = json.dumps([recipe.name, point, label, recipe.mixers[label].model_dump(), lr, seed,
                       _keyed("train", recipe.train.model_dump(exclude={"lrs", "seeds"})), recipe.task.model_dump(),
                       _keyed("model", recipe.model.model_dump()), recipe.data_seed, recipe.metric], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# outcomes a rerun keeps; the others (unavailable, error, oom) are tried again
FINAL = ("ok", "diverged")


# what every row of a results file holds (the report and a rerun's skipping read these)
ROW_KEYS = ("recipe", "spec", "key", "point", "mixer", "lr", "seed", "status", "time")


def read_rows(path: str) -> list[dict]:
    """The result rows of a JSONL file (blank lines skipped); a line that is not JSON, or not a result row of
    ``kalmix bench run`` (an object with ``ROW_KEYS``), is an error naming the file and line."""
    return read_jsonl_rows(path, ROW_KEYS, "not a `kalmix bench run` result row")


def recorded(path: str) -> set[str]:
    """The keys of the runs in ``path`` that have an outcome (see ``FINAL``)."""
    if not os.path.exists(path):
        return set()
    return {row["key"] for row in read_rows(path) if row["status"] in FINAL}


def _available(spec: MixerSpec, device: torch.device) -> str | None:
    """Why ``spec`` cannot run here (None: it can)."""
    if spec.mixer in BASELINES:
        if device.type != "cuda":
            return f"{spec.mixer} runs fla's Triton kernels, which need CUDA"
        try:
            import fla  # noqa: F401
        except ImportError:
            return f"{spec.mixer} needs fla (flash-linear-attention), which is not installed"
    return None


def git_sha() -> str | None:
    """The short commit of the kalmix checkout (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(__file__), timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict:
    out = {"torch": torch.__version__}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def plan(recipe: Recipe, out_path: str, device: str = "cpu", impl: str | None = None,
         mixers: list[str] | None = None) -> list[tuple]:
    """The runs of ``recipe`` not yet in ``out_path``, in order: (grid point, recipe at it, mixer label, seed, lr,
    key). ``mixers`` restricts the recipe's mixer labels. Checks, before any data is made: the device and backend,
    the mixer labels, the results file, and that every model of every grid point builds."""
    check_impl(impl, check_device(device))
    labels = list(recipe.mixers) if mixers is None else mixers
    unknown = sorted(set(labels) - set(recipe.mixers))
    if unknown:
        raise ValueError(f"recipe {recipe.name} has no mixer(s) {unknown}; it has {sorted(recipe.mixers)}")
    check_out(out_path, append=True)
    done = recorded(out_path)
    runs = {}                                           # key -> (point, recipe at it, label, seed, lr)
    for point in recipe.points():
        r = recipe.at(point)
        for label in labels:
            if _available(r.mixers[label], torch.device(device)) is None:
                try:
                    check_model(lambda: lm_config(r, r.mixers[label], impl), "its model")
                except ValueError as e:
                    raise ValueError(f"mixer {label} at {_fmt_point(point)}: {e}") from None
            for seed, lr in itertools.product(r.train.seeds, r.train.lrs):
                runs.setdefault(run_key(r, point, label, lr, seed), (point, r, label, seed, lr))
    return [(*run, key) for key, run in runs.items() if key not in done]


def _pinned(device: str) -> torch.device:
    """``device`` with its index ("cuda" -> "cuda:N", N the current device), made current: the device whose
    random state the checkpoints hold."""
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    return dev


def run(recipe: Recipe, out_path: str, device: str = "cpu", impl: str | None = None,
        mixers: list[str] | None = None, progress: bool = True) -> list[dict]:
    """Every run of ``plan`` (checked before any work), appended to ``out_path`` (JSONL) one row per run as it
    ends; a bar over the runs on a terminal and one line per finished run. Returns the new rows.

    A run in progress keeps its checkpoints in the folder ``OUT_PATH.ckpt/KEY`` (see ``fit``). SIGTERM (e.g. from
    ``timeout``) stops the current run after its step, saves its checkpoint and returns without writing its row:
    a run cut by time is never recorded, and the next call resumes it."""
    todo = plan(recipe, out_path, device, impl, mixers)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    dev = _pinned(device)
    total = recipe.planned_runs(None if mixers is None else len(mixers))
    ckpt_dir = out_path + ".ckpt"
    os.makedirs(ckpt_dir, exist_ok=True)
    base = {"recipe": recipe.name, "paper": recipe.paper, "spec": recipe.model_dump(mode="json"),
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", **_versions()}
    base["git"] = git_sha()
    rows, data, data_point = [], None, None
    tqdm.write(f"{recipe.name}: {len(todo)} runs to do, {total - len(todo)} of {total} already in {out_path}")
    outer = tqdm(todo, desc=recipe.name, disable=None if progress else True, dynamic_ncols=True)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _request_stop) if main_thread else None
    _STOP.clear()
    try:
        for i, (point, r, label, seed, lr, key) in enumerate(outer, 1):
            if _STOP.is_set():
                raise Stopped("stopped by SIGTERM between runs")
            spec = r.mixers[label]
            row = {**base, "key": key, "point": point, "mixer": label, "mixer_name": spec.mixer,
                   "lr": lr, "seed": seed, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            head = f"[{i}/{len(todo)}] {_fmt_point(point)} {label:>12} lr={lr:<8g} seed={seed:<4d}"
            reason = _available(spec, dev)
            t0 = time.time()
            folder = os.path.join(ckpt_dir, key)
            if reason is not None:
                row.update(status="unavailable", reason=reason)
            else:
                if data_point is not point:
                    data = {"train": r.task.build("train", r.data_seed) if r.task.train_examples else None,
                            "val": r.task.build("val", r.data_seed),
                            "test": {L: r.task.build("test", r.data_seed, L) for L in r.test_lengths()}}
                    data_point = point
                try:
                    row.update(run_one(r, label, lr, seed, data, dev, impl, progress, checkpoint=folder))
                except Stopped as e:
                    outer.write(f"{head} {e}; not recorded, resumes from {folder}")
                    raise
                except torch.cuda.OutOfMemoryError as e:
                    row.update(status="oom", reason=str(e).split(". ")[0][:300])
                except Exception as e:                    # noqa: BLE001  recorded and shown by the report
                    row.update(status="error", reason=f"{type(e).__name__}: {e}".splitlines()[0][:300])
            row["wall_s"] = round(time.time() - t0, 2)
            _append(out_path, row)
            if row["status"] in FINAL:
                shutil.rmtree(folder, ignore_errors=True)
            rows.append(row)
            if row["status"] == "ok":
                test = row["test"].get(str(r.task.length()), {})
                outer.write(f"{head} val={row['val']:.4f} test {recipe.metric}="
                            f"{test.get(recipe.metric, float('nan')):.4f} steps={row['steps_run']} "
                            f"{row['wall_s']:.0f}s")
            else:
                outer.write(f"{head} {row['status']}: {row.get('reason', '')}")
    except Stopped:
        pass
    finally:
        outer.close()
        if main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)
        _STOP.clear()                       # the stop was this call's: a later fit (bench mqar) runs to its end
    return rows


def _append(path: str, row: dict) -> None:
    """One JSONL line in a single write (a process killed mid-append leaves no half line behind)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


def _fmt_point(point: dict) -> str:
    return " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items()) or "-"
