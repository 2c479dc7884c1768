"""A batch-size study: the grid, and the rules that turn it into training jobs (cells).

The grid is ``batch_sizes x optimizers x lr_multipliers x seeds``. Each cell trains one epoch
over the same ``steps_at_largest x max(batch_sizes)`` training rows, so the largest batch gets
``steps_at_largest`` optimizer steps and a batch ``2^j`` times smaller gets ``2^j`` times more.
Learning rates: an optimizer's base LRs are set at ``reference_batch`` and scaled to each batch
by ``lr_rule`` (the square-root rule by default); the sweep multiplies that by each of
``lr_multipliers`` — values below 1 are below the rule. Warm-up and decay follow each cell's own
step count. Selection of the LR is on the validation split; the test split only reports.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dlrm_vrgd.config import (
    MAX_BATCH,
    MAX_MICRO_BATCH,
    MAX_ROWS,
    MAX_SEED,
    MAX_STEPS,
    ConfigError,
    Count,
    Real,
    TrainConfig,
    format_validation_error,
    parse_config,
)

#: Most cells (trainings) one study may hold.
MAX_CELLS = 10_000
#: Longest list of batch sizes, optimizers, LR multipliers or seeds.
MAX_AXIS = 64


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StudyOptimizer(_Section):
    """One optimizer of the grid: dense and sparse settings plus base LRs at the reference
    batch. ``baseline`` names the optimizer this one is compared against (its base)."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.+-]+$", max_length=100)]
    dense: dict[str, Any]
    sparse: dict[str, Any]
    dense_lr: Real(gt=0, le=1e6)
    sparse_lr: Real(gt=0, le=1e6)
    baseline: Annotated[str, Field(max_length=100)] | None = None


class StudyConfig(_Section):
    name: Annotated[str, Field(min_length=1, max_length=200)] = "study"
    #: A TrainConfig the cells start from (data, model, and run settings such as eval_rows).
    base: dict[str, Any]
    batch_sizes: list[Count(1, MAX_BATCH)] = Field(min_length=1, max_length=MAX_AXIS)
    #: Micro-batch: ``G / micro_batches`` when set (the same number of gradient groups at every
    #: batch size, so GSNR is estimated alike), else ``min(G, max_micro_batch)``.
    micro_batches: Count(1, MAX_BATCH) | None = None
    max_micro_batch: Count(1, MAX_MICRO_BATCH) = 4096
    steps_at_largest: Count(1, MAX_STEPS) = 3000
    optimizers: list[StudyOptimizer] = Field(min_length=1, max_length=MAX_AXIS)
    lr_rule: Literal["sqrt", "linear", "none"] = "sqrt"
    reference_batch: Count(1, MAX_BATCH) = 1024
    lr_multipliers: list[Real(gt=0, le=1e6)] = Field(
        default_factory=lambda: [0.125, 0.25, 0.5, 1.0, 2.0], min_length=1, max_length=MAX_AXIS
    )
    seeds: list[Count(0, MAX_SEED)] = Field(
        default_factory=lambda: [0, 1, 2], min_length=1, max_length=MAX_AXIS
    )
    warmup_fraction: Real(ge=0, lt=1) = 0.05
    decay: Literal["none", "poly", "cosine"] = "cosine"
    min_lr_factor: Real(ge=0, le=1) = 0.0
    evals_per_run: Count(1, 100_000) = 10
    #: Cells trained at once, each in its own process with ``cores / workers`` threads (small
    #: models are bound by per-step overhead, which one thread serves as well as two). How the
    #: study runs, not what it measures: a finished study may be resumed with another value.
    workers: Count(1, 1024) = 1
    #: "Rows to reach" this validation AUC; None: 0.01 below the oracle's validation AUC.
    target_auc: Real(gt=0.5, lt=1.0) | None = None
    train_eval_rows: Count(1, MAX_ROWS) = 50_000

    @model_validator(mode="after")
    def _check(self) -> StudyConfig:
        largest = max(self.batch_sizes)
        cells = (
            len(self.batch_sizes)
            * len(self.optimizers)
            * len(self.lr_multipliers)
            * len(self.seeds)
        )
        if cells > MAX_CELLS:
            raise ValueError(f"the grid has {cells:,} cells, more than {MAX_CELLS:,}")
        if self.train_rows > MAX_ROWS:
            raise ValueError(
                f"steps_at_largest x max(batch_sizes) = {self.train_rows:,} training rows, "
                f"more than {MAX_ROWS:,}"
            )
        for g in self.batch_sizes:
            if largest % g:
                raise ValueError(f"batch_sizes: {g} does not divide the largest, {largest}")
            if self.micro_batches is not None and g % self.micro_batches:
                raise ValueError(f"batch_sizes: {g} is not divisible by micro_batches")
            b = self.micro_batch(g)
            if g % b:
                raise ValueError(f"batch_sizes: {g} is not a multiple of max_micro_batch {b}")
        names = [o.name for o in self.optimizers]
        if len(set(names)) != len(names):
            raise ValueError(f"optimizers: names must be unique, got {names}")
        for o in self.optimizers:
            if o.baseline is not None and o.baseline not in names:
                raise ValueError(f"optimizers.{o.name}.baseline: no optimizer {o.baseline!r}")
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ValueError("batch_sizes: repeated value")
        try:  # the base and each optimizer must make valid training configs
            for o in self.optimizers:
                self.cell_config(Cell(max(self.batch_sizes), o.name, 1.0, self.seeds[0]))
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return self

    @property
    def train_rows(self) -> int:
        """The data sizing rule: the largest batch gets ``steps_at_largest`` steps."""
        return self.steps_at_largest * max(self.batch_sizes)

    def micro_batch(self, global_batch: int) -> int:
        if self.micro_batches is not None:
            return global_batch // self.micro_batches
        return min(global_batch, self.max_micro_batch)

    def steps(self, global_batch: int) -> int:
        return self.train_rows // global_batch

    def lr_scale(self, global_batch: int) -> float:
        ratio = global_batch / self.reference_batch
        return {"sqrt": math.sqrt(ratio), "linear": ratio, "none": 1.0}[self.lr_rule]

    def cells(self) -> list[Cell]:
        return [
            Cell(g, o.name, m, seed)
            for g in sorted(self.batch_sizes)
            for o in self.optimizers
            for m in self.lr_multipliers
            for seed in self.seeds
        ]

    def optimizer(self, name: str) -> StudyOptimizer:
        return next(o for o in self.optimizers if o.name == name)

    def cell_config(self, cell: Cell) -> TrainConfig:
        """The TrainConfig of one cell (see the module docstring for the rules)."""
        opt = self.optimizer(cell.optimizer)
        steps = self.steps(cell.global_batch)
        scale = self.lr_scale(cell.global_batch) * cell.lr_multiplier
        raw = yaml.safe_load(yaml.safe_dump(self.base))  # deep copy
        raw.setdefault("data", {})["train_rows"] = self.train_rows
        raw["optim"] = {
            "dense": {**opt.dense, "lr": opt.dense_lr * scale},
            "sparse": {**opt.sparse, "lr": opt.sparse_lr * scale},
            "schedule": {
                "warmup_steps": math.ceil(self.warmup_fraction * steps),
                "decay": self.decay,
                "min_lr_factor": self.min_lr_factor,
                "lr_scaling": "none",
            },
        }
        run = raw.setdefault("run", {})
        run.update(
            global_batch=cell.global_batch,
            micro_batch=self.micro_batch(cell.global_batch),
            steps=None,
            epochs=1,
            seed=cell.seed,
            eval_every=max(1, steps // self.evals_per_run),
            checkpoint_every=0,
            final_train_eval_rows=self.train_eval_rows,
        )
        return parse_config(raw, source=f"study cell {cell.id}")


class Cell(BaseModel):
    """One training job of the grid."""

    model_config = ConfigDict(frozen=True)

    global_batch: int
    optimizer: str
    lr_multiplier: float
    seed: int

    def __init__(self, global_batch: int, optimizer: str, lr_multiplier: float, seed: int) -> None:
        super().__init__(
            global_batch=global_batch, optimizer=optimizer, lr_multiplier=lr_multiplier, seed=seed
        )

    @property
    def id(self) -> str:
        return f"G{self.global_batch}-{self.optimizer}-lr{self.lr_multiplier:g}-s{self.seed}"


def load_study(path: str | Path, overrides: list[str] | None = None) -> StudyConfig:
    """Read a study YAML (``--set`` overrides as for train configs)."""
    from dlrm_vrgd.config import apply_overrides

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"study config not found: {path}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    raw = apply_overrides(raw, overrides or [])
    try:
        study = StudyConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, str(path))) from None
    return study
