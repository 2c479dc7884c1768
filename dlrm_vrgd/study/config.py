"""A batch-size study: the grid, and the rules that turn it into training jobs (cells).

The grid is ``batch_sizes x optimizers x groups x lr_multipliers x seeds``. ``groups`` (k, the
micro-batches per step at a fixed global batch: ``B = G / k``) changes only the micro-batch and
hence the gradient-group count the GSNR is estimated from; without it the micro-batch is
``G / micro_batches`` or ``min(G, max_micro_batch)``. Each cell trains one epoch
over the same ``steps_at_largest x max(batch_sizes)`` training rows, so the largest batch gets
``steps_at_largest`` optimizer steps and a batch ``2^j`` times smaller gets ``2^j`` times more
(synthetic data is generated to that size; from day files — ``data.source: criteo``, e.g.
generated once by ``dlrm-vrgd generate`` — each cell runs that many steps over the first rows of
the shuffled training days, which must hold at least as many).
Learning rates: an optimizer's base LRs are set at ``reference_batch`` and scaled to each batch
by ``lr_rule`` (the square-root rule by default); the sweep multiplies that by each of
``lr_multipliers`` — values below 1 are below the rule. Warm-up and decay follow each cell's own
step count. Selection of the LR is on the validation split; the test split only reports.

Two protocols are reported: *tuned* (the multiplier with the best mean
validation AUC, per batch and optimizer) and *rule* (the multiplier ``rule_multiplier``, fixed
before the study — 1, or the one found best at the smallest batch by an earlier study — at every
batch size, so the LR follows the scaling rule alone; validation is never consulted). With
``tune_seeds``/``confirm_seeds`` (the two-stage protocol) the rule's multiplier is instead each
(optimizer, k)'s own pick at the smallest batch, fixed before any larger-batch cell runs, and
both protocols report only the fresh confirmation seeds (:mod:`dlrm_vrgd.study.protocol`).

``lr_rule: cowclip`` (per optimizer or for the study) is CowClip's rule (arXiv 2204.06240): the
embedding LR stays fixed, the tables' weight decay λ grows linearly with ``G``, the dense LR by
the square root.
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
LrRule = Literal["sqrt", "linear", "none", "cowclip"]
#: A Markdown page of the repository, by its relative path (named in reports, never read).
PagePath = Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_./-]*\.md$", max_length=300)]
#: k, micro-batches per step: B = G / k is at least one row.
Groups = list[Count(1, MAX_BATCH)]


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
    #: This optimizer's k values (micro-batches per step), instead of the study's ``groups``.
    groups: Groups | None = Field(default=None, min_length=1, max_length=MAX_AXIS)
    #: This optimizer's scaling rule, instead of the study's ``lr_rule``.
    lr_rule: LrRule | None = None
    #: This optimizer's multiplier under the rule protocol, instead of the study's.
    rule_multiplier: Real(gt=0, le=1e6) | None = None


class Endpoint(_Section):
    """A primary endpoint: the tuned interaction ``(optimizer − baseline at the largest batch)
    − (the same at the smallest)``, paired by seed. ``baseline`` defaults to the optimizer's
    own; ``groups`` picks one k of an optimizer that has several."""

    optimizer: Annotated[str, Field(max_length=100)]
    baseline: Annotated[str, Field(max_length=100)] | None = None
    groups: Count(1, MAX_BATCH) | None = None


class StudyConfig(_Section):
    name: Annotated[str, Field(min_length=1, max_length=200)] = "study"
    #: A TrainConfig the cells start from (data, model, and run settings such as eval_rows).
    base: dict[str, Any]
    batch_sizes: list[Count(1, MAX_BATCH)] = Field(min_length=1, max_length=MAX_AXIS)
    #: Micro-batch: ``G / micro_batches`` when set (the same number of gradient groups at every
    #: batch size, so GSNR is estimated alike), else ``min(G, max_micro_batch)``.
    micro_batches: Count(1, MAX_BATCH) | None = None
    max_micro_batch: Count(1, MAX_MICRO_BATCH) = 4096
    #: The ``groups`` axis: micro-batches per step (k) at a fixed global batch, B = G / k. Not
    #: with ``micro_batches``. An optimizer's own ``groups`` replaces it for that optimizer.
    groups: Groups | None = Field(default=None, min_length=1, max_length=MAX_AXIS)
    steps_at_largest: Count(1, MAX_STEPS) = 3000
    optimizers: list[StudyOptimizer] = Field(min_length=1, max_length=MAX_AXIS)
    lr_rule: LrRule = "sqrt"
    reference_batch: Count(1, MAX_BATCH) = 1024
    lr_multipliers: list[Real(gt=0, le=1e6)] = Field(
        default_factory=lambda: [0.125, 0.25, 0.5, 1.0, 2.0], min_length=1, max_length=MAX_AXIS
    )
    #: The multiplier of the *rule* protocol (one of ``lr_multipliers``), the same at every
    #: batch size; fixed before the study, never chosen on validation.
    rule_multiplier: Real(gt=0, le=1e6) = 1.0
    seeds: list[Count(0, MAX_SEED)] = Field(
        default_factory=lambda: [0, 1, 2], min_length=1, max_length=MAX_AXIS
    )
    #: Two-stage protocol (both set, disjoint; ``seeds`` is then unused): the ``tune_seeds``
    #: choose each (batch, optimizer, k)'s multiplier on validation AUC, the fresh
    #: ``confirm_seeds`` are trained at each chosen multiplier (and at the rule's) and are the
    #: only cells the report's figures come from. See :mod:`dlrm_vrgd.study.protocol`.
    tune_seeds: list[Count(0, MAX_SEED)] | None = Field(
        default=None, min_length=1, max_length=MAX_AXIS
    )
    confirm_seeds: list[Count(0, MAX_SEED)] | None = Field(
        default=None, min_length=1, max_length=MAX_AXIS
    )
    #: Two-stage: how many times a pick on the grid's edge is moved out by one notch (the
    #: ratio of the two multipliers at that edge) before the pick is taken as it is.
    edge_extensions: Count(0, 16) = 0
    #: A reported cell whose test AUC is below this has collapsed (the report counts them).
    collapse_auc: Real(gt=0, lt=1) = 0.78
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
    #: Two-stage: the batches the confirmation seeds train (default: every batch). A batch left
    #: out is tuned only; the report shows its tuning seeds' validation AUC, labelled as such.
    #: Must hold the smallest and the largest batch (the interactions need both).
    confirm_batches: list[Count(1, MAX_BATCH)] | None = Field(
        default=None, min_length=2, max_length=MAX_AXIS
    )
    #: The primary endpoints, fixed before any cell runs; the report adjusts their p-values by
    #: Holm's method over exactly these. None: every tuned interaction of an arm with its base
    #: is the family, and the report says it was not pre-registered.
    primary_endpoints: list[Endpoint] | None = Field(
        default=None, min_length=1, max_length=MAX_AXIS
    )
    #: Where the study was pre-registered: a page of this repository (e.g.
    #: ``docs/study/NAME/PREREGISTRATION.md``), named at the top of the report.
    preregistration: PagePath | None = None
    #: Cells run after seeing a study's results, to explain them (or a dry run of a design):
    #: the report labels every figure exploratory; its endpoints, if any, are not a test.
    exploratory: bool = False

    @model_validator(mode="after")
    def _check(self) -> StudyConfig:
        largest = max(self.batch_sizes)
        if (self.tune_seeds is None) != (self.confirm_seeds is None):
            raise ValueError("tune_seeds and confirm_seeds: set both (two-stage) or neither")
        if self.two_stage and set(self.tune_seeds or []) & set(self.confirm_seeds or []):
            raise ValueError("confirm_seeds must be fresh: they share seeds with tune_seeds")
        cells = len(self.batch_sizes) * len(self.lr_multipliers) * len(self.run_seeds)
        cells *= sum(len(self.groups_of(o)) for o in self.optimizers)
        if cells > MAX_CELLS:
            raise ValueError(f"the grid has {cells:,} cells, more than {MAX_CELLS:,}")
        if self.train_rows > MAX_ROWS:
            raise ValueError(
                f"steps_at_largest x max(batch_sizes) = {self.train_rows:,} training rows, "
                f"more than {MAX_ROWS:,}"
            )
        uses_groups = self.groups is not None or any(o.groups for o in self.optimizers)
        if uses_groups and self.micro_batches is not None:
            raise ValueError("groups and micro_batches both fix the micro-batch: set one")
        for g in self.batch_sizes:
            if largest % g:
                raise ValueError(f"batch_sizes: {g} does not divide the largest, {largest}")
            if self.micro_batches is not None and g % self.micro_batches:
                raise ValueError(f"batch_sizes: {g} is not divisible by micro_batches")
            for o in self.optimizers:
                for k in self.groups_of(o):
                    if k is not None and g % k:
                        raise ValueError(f"groups: batch size {g} is not divisible by k = {k}")
            b = self.micro_batch(g)
            if g % b:
                raise ValueError(f"batch_sizes: {g} is not a multiple of max_micro_batch {b}")
        for o in self.optimizers:
            if not self.two_stage and self.rule_multiplier_of(o) not in self.lr_multipliers:
                raise ValueError(
                    f"optimizers.{o.name}: rule_multiplier {self.rule_multiplier_of(o)} is not "
                    f"one of lr_multipliers {self.lr_multipliers}"
                )
            if self.lr_rule_of(o) == "cowclip" and not str(o.sparse.get("name", "")).startswith(
                "cowclip_"
            ):
                raise ValueError(
                    f"optimizers.{o.name}: lr_rule cowclip scales the tables' weight decay, "
                    "which needs a cowclip_* sparse optimizer"
                )
        names = [o.name for o in self.optimizers]
        if len(set(names)) != len(names):
            raise ValueError(f"optimizers: names must be unique, got {names}")
        self._check_reporting(names)
        for o in self.optimizers:
            if o.baseline is not None and o.baseline not in names:
                raise ValueError(f"optimizers.{o.name}.baseline: no optimizer {o.baseline!r}")
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ValueError("batch_sizes: repeated value")
        try:  # the base and each optimizer must make valid training configs
            for o in self.optimizers:
                for k in self.groups_of(o):
                    self.cell_config(Cell(largest, o.name, 1.0, self.run_seeds[0], k))
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return self

    def _check_reporting(self, names: list[str]) -> None:
        """The fields that say which batches confirm and what the report's primary family is."""
        if self.confirm_batches is not None:
            if not self.two_stage:
                raise ValueError("confirm_batches is for two-stage studies (tune/confirm seeds)")
            extra = sorted(set(self.confirm_batches) - set(self.batch_sizes))
            if extra:
                raise ValueError(f"confirm_batches: {extra} not in batch_sizes")
            ends = {min(self.batch_sizes), max(self.batch_sizes)}
            if not ends <= set(self.confirm_batches):
                raise ValueError(
                    f"confirm_batches must hold the smallest and largest batch {sorted(ends)}"
                )
        if self.exploratory and self.preregistration:
            raise ValueError("exploratory: an exploratory study has no pre-registration")
        for i, e in enumerate(self.primary_endpoints or []):
            where = f"primary_endpoints.{i}"
            if e.optimizer not in names:
                raise ValueError(f"{where}.optimizer: no optimizer {e.optimizer!r}")
            base = e.baseline or self.optimizer(e.optimizer).baseline
            if base is None:
                raise ValueError(f"{where}.baseline: {e.optimizer} has no baseline; name one")
            if base not in names or base == e.optimizer:
                raise ValueError(f"{where}.baseline: {base!r} is not another optimizer")
            ks = self.groups_of(self.optimizer(e.optimizer))
            if e.groups is not None and e.groups not in ks:
                raise ValueError(f"{where}.groups: {e.optimizer} has no k = {e.groups}")
        keys = [(e.optimizer, e.baseline, e.groups) for e in self.primary_endpoints or []]
        if len(set(keys)) != len(keys):
            raise ValueError("primary_endpoints: an endpoint is listed twice")

    @property
    def confirmed_batches(self) -> list[int]:
        """The batches the confirmation seeds train (two-stage)."""
        return sorted(self.confirm_batches or self.batch_sizes)

    @property
    def two_stage(self) -> bool:
        return self.tune_seeds is not None

    @property
    def run_seeds(self) -> list[int]:
        """The seeds of the LR grid: ``tune_seeds`` (two-stage) or ``seeds``."""
        return list(self.tune_seeds) if self.tune_seeds is not None else list(self.seeds)

    @property
    def train_rows(self) -> int:
        """The data sizing rule: the largest batch gets ``steps_at_largest`` steps."""
        return self.steps_at_largest * max(self.batch_sizes)

    def micro_batch(self, global_batch: int, groups: int | None = None) -> int:
        """B of a cell: ``G / k`` on the groups axis, else the study's fixed rule."""
        if groups is not None:
            return global_batch // groups
        if self.micro_batches is not None:
            return global_batch // self.micro_batches
        return min(global_batch, self.max_micro_batch)

    def groups_of(self, opt: StudyOptimizer) -> list[int | None]:
        """The k values of ``opt`` (``[None]``: off the groups axis)."""
        return list(opt.groups or self.groups or [None])

    def lr_rule_of(self, opt: StudyOptimizer) -> str:
        return opt.lr_rule or self.lr_rule

    def rule_multiplier_of(self, opt: StudyOptimizer) -> float:
        return opt.rule_multiplier if opt.rule_multiplier is not None else self.rule_multiplier

    def steps(self, global_batch: int) -> int:
        return self.train_rows // global_batch

    def lr_scale(self, global_batch: int, rule: str | None = None) -> float:
        """The dense LR's factor at ``global_batch`` under ``rule`` (the study's by default);
        CowClip's rule scales the dense LR by the square root."""
        ratio = global_batch / self.reference_batch
        rule = rule or self.lr_rule
        return {
            "sqrt": math.sqrt(ratio),
            "linear": ratio,
            "none": 1.0,
            "cowclip": math.sqrt(ratio),
        }[rule]

    def cells(self) -> list[Cell]:
        """The LR grid (two-stage: the tuning cells of the initial grid; the edge extensions
        and confirmation cells follow from their results, see :mod:`dlrm_vrgd.study.protocol`)."""
        return [
            Cell(g, o.name, m, seed, k)
            for g in sorted(self.batch_sizes)
            for o in self.optimizers
            for k in self.groups_of(o)
            for m in self.lr_multipliers
            for seed in self.run_seeds
        ]

    def optimizer(self, name: str) -> StudyOptimizer:
        return next(o for o in self.optimizers if o.name == name)

    def cell_config(self, cell: Cell) -> TrainConfig:
        """The TrainConfig of one cell (see the module docstring for the rules)."""
        opt = self.optimizer(cell.optimizer)
        steps = self.steps(cell.global_batch)
        rule = self.lr_rule_of(opt)
        scale = self.lr_scale(cell.global_batch, rule) * cell.lr_multiplier
        sparse = {**opt.sparse, "lr": opt.sparse_lr * scale}
        if rule == "cowclip":  # embedding LR fixed, λ ∝ G
            sparse["lr"] = opt.sparse_lr * cell.lr_multiplier
            ratio = cell.global_batch / self.reference_batch
            sparse["weight_decay"] = float(opt.sparse.get("weight_decay", 0.0)) * ratio
        raw = yaml.safe_load(yaml.safe_dump(self.base))  # deep copy
        data = raw.setdefault("data", {})
        if data.get("source", "synthetic") == "synthetic":  # rows made to measure: one epoch
            data["train_rows"] = self.train_rows
            length: dict[str, Any] = {"steps": None, "epochs": 1}
        else:  # day files hold what they hold: the steps fix the rows seen (the study checks
            length = {"steps": steps, "epochs": None}  # that the files hold enough, see run.py)
        raw["optim"] = {
            "dense": {**opt.dense, "lr": opt.dense_lr * scale},
            "sparse": sparse,
            "schedule": {
                "warmup_steps": math.ceil(self.warmup_fraction * steps),
                "decay": self.decay,
                "min_lr_factor": self.min_lr_factor,
                "lr_scaling": "none",
            },
        }
        run = raw.setdefault("run", {})
        run.pop("evals_per_epoch", None)  # the study sets the cadence: evals_per_run a cell
        run.update(
            global_batch=cell.global_batch,
            micro_batch=self.micro_batch(cell.global_batch, cell.groups),
            **length,
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
    #: k, the micro-batches per step, on the groups axis (None: the study's micro-batch rule).
    groups: int | None = None

    def __init__(
        self,
        global_batch: int,
        optimizer: str,
        lr_multiplier: float,
        seed: int,
        groups: int | None = None,
    ) -> None:
        super().__init__(
            global_batch=global_batch,
            optimizer=optimizer,
            lr_multiplier=lr_multiplier,
            seed=seed,
            groups=groups,
        )

    @property
    def id(self) -> str:
        k = "" if self.groups is None else f"-k{self.groups}"
        return f"G{self.global_batch}-{self.optimizer}{k}-lr{self.lr_multiplier:g}-s{self.seed}"


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
