"""`kalmix bench run RECIPE`: a paper's synthetic experiment as a pydantic recipe (``kalmix/bench/recipes/*.yaml``).

A recipe names a task of ``kalmix.tasks``, a model shape, the mixers to compare (each a ``KalmixConfig`` mixer with
its keyword arguments), a training protocol (steps, learning-rate sweep, seeds, early stopping) and a grid over any
of its fields (dotted paths such as ``task.params.num_kv_pairs`` or ``model.n_layers``). Every (grid point, mixer,
seed, learning rate) is one run: train on the task's train split, evaluate the validation split every
``eval_every`` steps (early stopping, best weights kept), then score the test split at the training length and at
each of ``task.eval_lengths``. One JSON row per run is appended to the results file as soon as it finishes; a rerun
skips the runs already recorded there, so a recipe larger than one sitting resumes where it stopped.
``kalmix bench report`` (``kalmix.bench.report``) turns the rows into tables and plots.

Data: every mixer, seed and learning rate sees the same train / validation / test sets (drawn from
``data_seed``); the run's seed sets the initialisation and the order of the batches. Labels follow
``kalmix.tasks``' convention (logits[:, t] scored against labels[:, t]).
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import os
import time
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from tqdm.auto import tqdm

from kalmix.bench.checks import check_device, check_impl, check_model, check_out
from kalmix.bench.mqar import _git_sha
from kalmix.layers import ALL_MIXERS, BASELINES
from kalmix.layers.baselines import _GatedLinearLayer
from kalmix.models import KalmixConfig, KalmixForCausalLM
from kalmix.models.modeling import mc_marginal
from kalmix.tasks import (CapacityMQARConfig, CompressionConfig, FuzzyRecallConfig, HardMQARConfig,
                          InContextRecallConfig, MemorizationConfig, MQARConfig, NeedleConfig, NoisyRecallConfig,
                          PalindromeConfig, SelectiveCopyingConfig, StackConfig, WordProblemConfig,
                          macro_micro_accuracy)
from kalmix.tasks.mad import sinusoidal_positions

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
    eval_lengths: list[int] = Field([], description="also test at these values of the task's length field")

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


class MixerSpec(BaseModel):
    """One compared model: a ``KalmixConfig`` mixer, its layer's keyword arguments and other config fields
    (e.g. ``mc_samples`` for KLA+)."""

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
    """AdamW on the task's cross-entropy; warm-up then cosine (or constant); the best of ``lrs`` by validation."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(gt=0)
    batch_size: int = Field(64, gt=0)
    lrs: list[float] = Field(min_length=1)
    seeds: list[int] = Field([0], min_length=1)
    weight_decay: float = Field(0.1, ge=0)
    warmup: float = Field(0.1, ge=0, lt=1, description="fraction of steps of linear warm-up")
    schedule: Literal["cosine", "constant"] = "cosine"
    grad_clip: float | None = Field(1.0, gt=0)
    eval_every: int = Field(200, gt=0)
    patience: int | None = Field(None, gt=0, description="stop after this many evaluations without improvement")
    stop_at: float | None = Field(None, gt=0, le=1, description="stop once the validation metric reaches this")
    precision: Literal["fp32", "bf16"] = "fp32"


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


class Reference(BaseModel):
    """A paper's number: ``value`` of ``mixer`` (a recipe mixer label) at the grid point ``at``."""

    model_config = ConfigDict(extra="forbid")

    mixer: str
    at: dict[str, Any] = {}
    value: float


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
    metric: Metric = "accuracy"
    data_seed: int = Field(0, ge=0)
    report: ReportSpec
    references: list[Reference] = []

    @model_validator(mode="after")
    def _check(self):
        for path, values in self.grid.items():
            if not values:
                raise ValueError(f"grid[{path!r}] is empty")
            _get(self.model_dump(exclude={"grid"}), path)        # the path exists
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
            if all(_get(base, path) == value for path, value in point.items()):
                self.task.check()                             # this recipe is at the point
            else:
                self.at(point)
        return self

    def points(self) -> list[dict[str, Any]]:
        """The grid's points in order: dicts path -> value ([{}] without a grid)."""
        keys = list(self.grid)
        return [dict(zip(keys, combo)) for combo in itertools.product(*(self.grid[k] for k in keys))]

    def at(self, point: dict[str, Any]) -> Recipe:
        """The recipe with the grid point's values set (its grid: that single point)."""
        data = self.model_dump()
        for path, value in point.items():
            _set(data, path, value)
        data["grid"] = {path: [value] for path, value in point.items()}
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
    one grid axis). Unknown fields are errors; so is YAML that does not parse (naming the file and line, or the
    override)."""
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
        elif key in (data.get("grid") or {}):
            raise ValueError(f"override {item!r}: the grid sets {key} at every point; override the axis instead, "
                             f"e.g. grid.{key}=[{value}]")
        else:
            _set(data, key, value)
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
    return KalmixConfig(vocab_size=recipe.task.vocab_size(), hidden_size=recipe.model.d_model,
                        num_hidden_layers=recipe.model.n_layers, mixer=spec.mixer,
                        mixer_kwargs={spec.mixer: spec.kwargs} if spec.kwargs else None, mlp=recipe.model.mlp,
                        tie_word_embeddings=False, impl=impl, **spec.config)


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


@torch.no_grad()
def evaluate(model: nn.Module, inputs, labels, device, precision: str, tokens: int = 2 ** 17) -> dict[str, float]:
    """``scores`` of the model's arg-max predictions on inputs [N, T], in batches of about ``tokens`` tokens."""
    batch_size = max(1, tokens // inputs.shape[1])
    was_training = model.training
    model.eval()
    preds = []
    for i in range(0, len(inputs), batch_size):
        with _autocast(device, precision):
            preds.append(logits_of(model, inputs[i:i + batch_size].to(device)).argmax(-1).cpu())
    model.train(was_training)
    return scores(torch.cat(preds), labels)


def _autocast(device: torch.device, precision: str):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def _lr(step: int, train: TrainSpec, lr: float) -> float:
    warm = int(train.warmup * train.steps)
    if step < warm:
        return lr * (step + 1) / warm
    if train.schedule == "constant":
        return lr
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, train.steps - warm)))


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
        elif isinstance(layer, _GatedLinearLayer):               # pure PyTorch, no Triton impl
            parts[name] = f"kalmix {layer.impl or 'torch'} (chunked PyTorch)"
        else:
            parts[name] = f"kalmix {layer.impl or ('triton' if device.type == 'cuda' else 'torch')}"
    return ", ".join(f"{k}: {v}" for k, v in parts.items())


# ------------------------------------------------------------------------------------------------- a run

def run_one(recipe: Recipe, label: str, lr: float, seed: int, data: dict, device: torch.device,
            impl: str | None = None, progress: bool = True) -> dict:
    """Train one (mixer, lr, seed) at one grid point (``recipe`` already at it) and score it. ``data``:
    ``{"train": (x, y), "val": (x, y), "test": {length: (x, y)}}``. Returns the result row."""
    spec, train = recipe.mixers[label], recipe.train
    precision = spec.precision or train.precision
    torch.manual_seed(seed)
    model = build_model(recipe, spec, impl).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2 and not getattr(p, "_no_weight_decay", False)]
    rest = [p for p in model.parameters() if p.dim() < 2 or getattr(p, "_no_weight_decay", False)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))
    x_va, y_va = data["val"]
    gen = torch.Generator().manual_seed(seed)
    best, best_step, best_state, bad_evals, history = -1.0, 0, None, 0, []
    status, step, loss_value = "ok", 0, float("nan")
    t0, tokens = time.perf_counter(), 0
    bar = tqdm(range(train.steps), desc=f"{label} lr={lr:g} seed={seed}", leave=False,
               disable=None if progress else True, dynamic_ncols=True)
    for step in bar:
        if data["train"] is None:
            x, y = recipe.task.fresh_batch(train.batch_size, seed, step)
        else:
            x_tr, y_tr = data["train"]
            idx = torch.randint(len(x_tr), (train.batch_size,), generator=gen)
            x, y = x_tr[idx], y_tr[idx]
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = _lr(step, train, lr)
        with _autocast(device, precision):
            logits = logits_of(model, x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if train.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        opt.step()
        tokens += x.numel()
        last = step == train.steps - 1
        if (step + 1) % train.eval_every == 0 or last:
            loss_value = loss.item()
            if not math.isfinite(loss_value):
                status = "diverged"
                break
            val = evaluate(model, x_va, y_va, device, precision)[recipe.metric]
            history.append([step + 1, round(loss_value, 5), round(val, 5)])
            bar.set_postfix(loss=f"{loss_value:.3f}", val=f"{val:.3f}")
            if val > best:
                best, best_step, bad_evals = val, step + 1, 0
                best_state = copy.deepcopy(model.state_dict())
            else:
                bad_evals += 1
            if train.stop_at is not None and best >= train.stop_at:
                break
            if train.patience is not None and bad_evals >= train.patience:
                break
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    row = {"status": status, "precision": precision, "steps_run": step + 1, "best_step": best_step,
           "val": best if best >= 0 else None,
           "final_loss": loss_value, "history": history, "train_s": round(train_s, 2),
           "train_tokens_per_s": round(tokens / train_s), "test": {}}
    if best_state is not None:
        model.load_state_dict(best_state)
        for length, (x_te, y_te) in data["test"].items():
            row["test"][str(length)] = evaluate(model, x_te, y_te, device, precision)
    lm = model.lm if isinstance(model, CompressionModel) else model
    layer = lm.model.layers[0].mixer
    row["state_size"] = (layer.state_size(recipe.task.length()) if lm.model.layers[0].mixer_type == "attention"
                         else layer.state_size())
    row["params"] = sum(p.numel() for p in model.parameters())
    row["ran"] = what_ran(model, device)
    return row


def run_key(recipe: Recipe, point: dict, label: str, lr: float, seed: int) -> str:
    """Identifies a run in a results file by everything that changes its outcome: the recipe at the grid point
    (``recipe.at(point)``: its task, model, this mixer, training protocol, data seed and metric), lr and seed."""
    blob = json.dumps([recipe.name, point, label, recipe.mixers[label].model_dump(), lr, seed,
                       recipe.train.model_dump(exclude={"lrs", "seeds"}), recipe.task.model_dump(),
                       recipe.model.model_dump(), recipe.data_seed, recipe.metric], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# outcomes a rerun keeps; the others (unavailable, error, oom) are tried again
FINAL = ("ok", "diverged")


# what every row of a results file holds (the report and a rerun's skipping read these)
ROW_KEYS = ("recipe", "spec", "key", "point", "mixer", "lr", "seed", "status", "time")


def read_rows(path: str) -> list[dict]:
    """The result rows of a JSONL file (blank lines skipped); a line that is not JSON, or not a result row of
    ``kalmix bench run`` (an object with ``ROW_KEYS``), is an error naming the file and line."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from None
                missing = [k for k in ROW_KEYS if k not in row] if isinstance(row, dict) else list(ROW_KEYS)
                if missing:
                    raise ValueError(f"{path}:{n}: not a `kalmix bench run` result row (it lacks "
                                     f"{', '.join(missing)})")
                rows.append(row)
    return rows


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
    check_out(out_path)
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


def run(recipe: Recipe, out_path: str, device: str = "cpu", impl: str | None = None,
        mixers: list[str] | None = None, progress: bool = True) -> list[dict]:
    """Every run of ``plan`` (checked before any work), appended to ``out_path`` (JSONL) one row per run as it
    ends; a bar over the runs on a terminal and one line per finished run. Returns the new rows."""
    todo = plan(recipe, out_path, device, impl, mixers)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    dev = torch.device(device)
    total = recipe.planned_runs(None if mixers is None else len(mixers))
    base = {"recipe": recipe.name, "paper": recipe.paper, "spec": recipe.model_dump(mode="json"),
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", **_versions()}
    base["git"] = _git_sha()
    rows, data, data_point = [], None, None
    tqdm.write(f"{recipe.name}: {len(todo)} runs to do, {total - len(todo)} of {total} already in {out_path}")
    outer = tqdm(todo, desc=recipe.name, disable=None if progress else True, dynamic_ncols=True)
    for i, (point, r, label, seed, lr, key) in enumerate(outer, 1):
        spec = r.mixers[label]
        row = {**base, "key": key, "point": point, "mixer": label, "mixer_name": spec.mixer,
               "lr": lr, "seed": seed, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        reason = _available(spec, dev)
        t0 = time.time()
        if reason is not None:
            row.update(status="unavailable", reason=reason)
        else:
            if data_point is not point:
                data = {"train": r.task.build("train", r.data_seed) if r.task.train_examples else None,
                        "val": r.task.build("val", r.data_seed),
                        "test": {L: r.task.build("test", r.data_seed, L) for L in r.test_lengths()}}
                data_point = point
            try:
                row.update(run_one(r, label, lr, seed, data, dev, impl, progress))
            except torch.cuda.OutOfMemoryError as e:
                row.update(status="oom", reason=str(e).split(". ")[0][:300])
            except Exception as e:                    # noqa: BLE001  recorded and shown by the report
                row.update(status="error", reason=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        row["wall_s"] = round(time.time() - t0, 2)
        with open(out_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        rows.append(row)
        head = f"[{i}/{len(todo)}] {_fmt_point(point)} {label:>12} lr={lr:<8g} seed={seed:<4d}"
        if row["status"] == "ok":
            test = row["test"].get(str(r.task.length()), {})
            outer.write(f"{head} val={row['val']:.4f} test {recipe.metric}="
                        f"{test.get(recipe.metric, float('nan')):.4f} steps={row['steps_run']} {row['wall_s']:.0f}s")
        else:
            outer.write(f"{head} {row['status']}: {row.get('reason', '')}")
    outer.close()
    return rows


def _fmt_point(point: dict) -> str:
    return " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items()) or "-"
