"""The one training configuration, shared by the CLI, the trainer and the REST service.

Every default lives here. Unknown keys are errors (``extra="forbid"``), and every error names
the dotted path of the offending field, e.g. ``optim.dense.lr: Input should be greater than 0``.
Numbers are checked: every float is finite (no NaN, no Infinity), a bool is not a number, and
every size (rows, tables, widths, batches, steps) has an upper bound stated in the JSON schema.
Whether a valid config fits the machine is a separate check (:mod:`dlrm_vrgd.resources`).

A config is loaded from YAML (:func:`load_config`) and patched with dotted overrides
(``--set optim.dense.lr=0.1``, values parsed as YAML scalars). The resolved config is stored
with every run and checkpoint (:meth:`TrainConfig.to_dict`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from dlrm_vrgd.redact import CREDENTIAL_ENV, redact, redact_obj

#: Criteo Kaggle (Display Advertising Challenge) cardinalities of C1..C26.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
NUM_DENSE = 13
NUM_SPARSE = 26


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field (dotted path)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


#: Upper bounds of sizes (generous: the checks that matter are the resource estimate's).
MAX_ROWS = 1 << 40  # rows of a split (Criteo 1TB has 4.4e9)
MAX_TABLE_ROWS = 2**31 - 1  # rows of one embedding table (as data.criteo allows)
MAX_TABLES = 1024
MAX_BAG = 4096  # ids of one table in a multi-hot row (MLPerf DLRMv2's largest: 100)
MAX_FEATURES = 1024  # dense features
MAX_EMBEDDING_DIM = 4096
MAX_WIDTH = 65_536  # one MLP layer
MAX_LAYERS = 64
MAX_BATCH = 1 << 24  # global batch (16M rows; the product targets 512k)
MAX_MICRO_BATCH = 1 << 22
MAX_STEPS = 1 << 40
MAX_EPOCHS = 1e6
MAX_SEED = (1 << 63) - 1
MAX_DAYS = 10_000
#: Longest ``data.path`` accepted, and longest component (Linux PATH_MAX / NAME_MAX).
MAX_PATH_CHARS = 4095
MAX_NAME_BYTES = 255


def _not_bool(value: Any) -> Any:
    # JSON true / YAML yes would otherwise become 1 (or 1.0): a bool is not a number.
    if isinstance(value, bool):
        raise PydanticCustomError("number_type", "Input should be a number, not a boolean")
    return value


NoBool = BeforeValidator(_not_bool)
#: A bool that is a JSON/YAML boolean, never ``"yes"``, ``1`` or ``"true"``.
Flag = Annotated[bool, Field(strict=True)]
# Numbers: no bool for an int or a float, no fraction for an int, finite floats only. Text
# that spells a number is accepted (PyYAML reads ``1e-3``, without a dot, as a string).
Fraction = Annotated[float, Field(allow_inf_nan=False, ge=0.0, lt=1.0), NoBool]


def Count(low: int = 1, high: int = MAX_ROWS) -> Any:  # noqa: N802 (a type, read as one)
    """An int (not a bool) in ``[low, high]``."""
    return Annotated[int, Field(ge=low, le=high), NoBool]


def Real(**bounds: float) -> Any:  # noqa: N802
    """A finite float (not a bool) with the given ``gt``/``ge``/``lt``/``le`` bounds."""
    return Annotated[float, Field(allow_inf_nan=False, **bounds), NoBool]


Seed = Count(0, MAX_SEED)
Rows = Count(1, MAX_ROWS)
Steps = Count(0, MAX_STEPS)
Width = Count(1, MAX_WIDTH)


class FieldRole:
    """A marker in a field's ``Annotated`` metadata that says what the field may change;
    :func:`marked_fields` finds the fields that carry one. Whoever adds a field marks it here,
    and the resume check and the study ledger follow without a list of their own."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: The field changes how a run is carried out, never what it trains nor the figures it writes
#: (where it is tracked, how its input is built ahead, when glibc's heap is handed back): a
#: resumed run may change it, and a study's cell digest leaves it out.
OPERATIONAL = FieldRole("OPERATIONAL")
#: The field was added after runs and study cells were recorded, and its default is what every
#: earlier one trained at: a cell digest leaves it out while it holds its default, so every
#: committed ledger still matches (a cell at another value is another cell).
ADDED_LATER = FieldRole("ADDED_LATER")


def marked_fields(section: type[BaseModel], role: FieldRole) -> dict[str, Any]:
    """``{name: default}`` of the fields of ``section`` that carry ``role`` (a default made by
    a factory is given as None)."""
    return {
        name: None if info.default_factory is not None else info.default
        for name, info in section.model_fields.items()
        if role in info.metadata
    }


def strip_marked(config: dict[str, Any], section: type[BaseModel] | None = None) -> dict[str, Any]:
    """A config dict (``TrainConfig``'s unless ``section`` says which) less, at every depth, the
    fields marked OPERATIONAL (they never change what is trained) and those marked ADDED_LATER
    that hold their default (a config written before the field existed trained at it). Two
    configs that train the same thing are equal after it: the resume check and the study ledger
    compare them so."""
    section = section or TrainConfig
    out: dict[str, Any] = {}
    for name, value in config.items():
        info = section.model_fields.get(name)
        if info is None:  # not a field (an old key): kept, for the caller to judge
            out[name] = value
            continue
        if OPERATIONAL in info.metadata:
            continue
        if ADDED_LATER in info.metadata and value == marked_fields(section, ADDED_LATER)[name]:
            continue
        below = _section_of(info.annotation, value)
        out[name] = strip_marked(value, below) if below and isinstance(value, dict) else value
    return out


def _section_of(annotation: Any, value: Any) -> type[BaseModel] | None:
    """The model a field's ``value`` is validated as: its annotation's, or, for a union of
    sections told apart by ``source`` (``data``), the member whose ``source`` it names."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    members = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    if len(members) == 1:
        return members[0]
    for member in members:
        source = member.model_fields.get("source")
        if source is not None and isinstance(value, dict) and value.get("source") == source.default:
            return member
    return None


def field_error(loc: tuple[str | int, ...], message: str, value: Any) -> ValidationError:
    """A validation error at ``loc`` (a model validator's errors otherwise name the model)."""
    detail = InitErrorDetails(
        type=PydanticCustomError("value_error", message), loc=loc, input=value
    )
    return ValidationError.from_exception_data("TrainConfig", [detail])


# ----------------------------------------------------------------------------------- data
class SyntheticData(_Section):
    """Planted-signal synthetic Criteo (see :mod:`dlrm_vrgd.data.synthetic`)."""

    #: Picks this section: planted-signal synthetic rows.
    source: Literal["synthetic"] = "synthetic"
    #: Seed of the data and of the hidden teacher (the same seed gives the same rows everywhere).
    seed: Seed = 0
    #: Rows of the training split.
    train_rows: Rows = 4_000_000
    #: Rows of the validation split.
    val_rows: Rows = 200_000
    #: Rows of the test split.
    test_rows: Rows = 200_000
    #: Dense (count) features per row.
    num_dense: Count(1, MAX_FEATURES) = NUM_DENSE
    #: Rows of each embedding table, one per categorical feature (default: Kaggle's, capped at
    #: 100k).
    cardinalities: list[Count(1, MAX_TABLE_ROWS)] = Field(
        default_factory=lambda: [min(c, 100_000) for c in CRITEO_KAGGLE_CARDINALITIES],
        min_length=1,
        max_length=MAX_TABLES,
    )
    #: Exponent of the Zipf-like law of each table's ids (larger: a few ids dominate).
    zipf_exponent: Real(gt=0.0, le=3.0) = 1.05
    #: Share of dense values that are missing (stored as 0).
    dense_missing_rate: Fraction = 0.2
    #: Mean click probability (the teacher's bias is fitted to it).
    click_rate: Real(gt=0.0, lt=1.0) = 0.25
    #: Embedding width d of the hidden teacher.
    teacher_dim: Count(1, 1024) = 4
    #: Rank R of the teacher's pairwise (feature-interaction) terms.
    teacher_rank: Count(1, 1024) = 4
    #: Standard deviation of the teacher's logit: larger means a higher oracle AUC.
    signal_scale: Real(gt=0.0, le=1e3) = 1.6
    #: Rows generated per block (every block is a pure function of seed, split and index).
    chunk_rows: Count(1, MAX_MICRO_BATCH) = 8192
    #: Keep up to this many MB of generated rows in memory, shared by every run of a process
    #: with the same data (a study trains many cells on the same rows); 0 = none.
    cache_mb: Count(0, 1 << 24) = 0
    #: Multi-hot ids: the bag size of each table (ids a row of it), made from the one-hot ids
    #: by MLPerf DLRMv2's synthesis (docs/input.md); None: one id a table.
    multi_hot_sizes: Annotated[
        list[Count(1, MAX_BAG)] | None, Field(max_length=MAX_TABLES), ADDED_LATER
    ] = None

    @model_validator(mode="after")
    def _check_bags(self) -> SyntheticData:
        sizes = self.multi_hot_sizes
        if sizes is not None and len(sizes) != len(self.cardinalities):
            raise ValueError(
                f"multi_hot_sizes: {len(sizes)} bag sizes for {len(self.cardinalities)} tables"
            )
        return self


class CriteoData(_Section):
    """Preprocessed Criteo day files in torchrec's npy layout (``dlrm-vrgd preprocess``); see
    :mod:`dlrm_vrgd.data.criteo.source`. Days default to: train = every labeled day but the last,
    val and test = the last labeled day, divided at ``val_fraction`` (torchrec's convention).
    Training rows are shuffled by blocks of ``shuffle_block_rows`` with ``run.seed``."""

    #: Picks this section: preprocessed Criteo day files.
    source: Literal["criteo"] = "criteo"
    #: The directory `dlrm-vrgd preprocess --out` wrote (relative paths: from the working dir).
    path: Annotated[Path, Field(json_schema_extra={"maxLength": MAX_PATH_CHARS})]
    #: `days`: the splits the day fields below name. `mlperf`: MLPerf DLRMv2's, whatever the
    #: manifest's splits: train on every labeled day but the last, and halve the last (day 23
    #: of Criteo 1TB): its first ⌈N/2⌉ rows validate, the other ⌊N/2⌋ test. It takes no
    #: train_days / val_days / test_days / val_fraction, and `max_val_rows` defaults to None
    #: (the whole half, as MLPerf evaluates).
    split: Annotated[Literal["days", "mlperf"], ADDED_LATER] = "days"
    #: Days to train on (None: every labeled day but the last).
    train_days: list[Count(0, MAX_DAYS)] | None = Field(
        default=None, min_length=1, max_length=MAX_DAYS
    )
    #: Validation days (None: the last labeled day, its first `val_fraction` of rows).
    val_days: list[Count(0, MAX_DAYS)] | None = Field(
        default=None, min_length=1, max_length=MAX_DAYS
    )
    #: Test days (None: the last labeled day, its rows after `val_fraction`).
    test_days: list[Count(0, MAX_DAYS)] | None = Field(
        default=None, min_length=1, max_length=MAX_DAYS
    )
    #: Where val and test are the same days: the first fraction of their rows is val.
    val_fraction: Real(gt=0.0, lt=1.0) = 0.5
    #: Keep only the first N validation rows (None: all).
    max_val_rows: Rows | None = 1_000_000
    #: Keep only the first N test rows (None: all).
    max_test_rows: Rows | None = None
    #: Read-time table cap (one for all tables, or 26): ids become ``id % cap``.
    max_rows_per_table: Count(1, MAX_TABLE_ROWS) | list[Count(1, MAX_TABLE_ROWS)] | None = None
    #: Training rows are read in blocks of this many rows, visited in a new order each epoch.
    shuffle_block_rows: Count(1, MAX_MICRO_BATCH) = 65_536
    #: Check every file's SHA-256 against the manifest when opening (sizes always are).
    verify_checksums: Flag = False
    #: Multi-hot ids: the bag size of each table. Days of one-hot ids are made multi-hot as
    #: they are read, by MLPerf DLRMv2's synthesis (tables of `max_rows_per_table` rows);
    #: days of MLPerf's `day_{i}_sparse_multi_hot.npz` are read as they are (their sizes must
    #: match). None: one-hot days one id a table, multi-hot days their own sizes.
    multi_hot_sizes: Annotated[
        list[Count(1, MAX_BAG)] | None, Field(max_length=MAX_TABLES), ADDED_LATER
    ] = None
    #: Keep the synthesis's lookup tables (23 GB at MLPerf's caps) in this directory, made once
    #: and memory-mapped by every rank and worker (None: drawn in memory by each process).
    multi_hot_cache: Annotated[
        Path | None, Field(json_schema_extra={"maxLength": MAX_PATH_CHARS}), OPERATIONAL
    ] = None

    @field_validator("path")
    @classmethod
    def _check_path(cls, path: Path) -> Path:
        text = str(path)
        if len(text) > MAX_PATH_CHARS:
            raise ValueError(f"longer than {MAX_PATH_CHARS} characters ({len(text):,})")
        if "\x00" in text:
            raise ValueError("contains a NUL character")
        for part in path.parts:
            if len(os.fsencode(part)) > MAX_NAME_BYTES:
                raise ValueError(
                    f"a component is longer than {MAX_NAME_BYTES} bytes: {part[:40]}..."
                )
        return path

    @model_validator(mode="before")
    @classmethod
    def _mlperf_eval_rows(cls, raw: Any) -> Any:
        """``split: mlperf`` validates on the whole half: ``max_val_rows`` None unless given."""
        if isinstance(raw, dict) and raw.get("split") == "mlperf" and "max_val_rows" not in raw:
            return {**raw, "max_val_rows": None}
        return raw

    @model_validator(mode="after")
    def _check_days(self) -> CriteoData:
        if self.split == "mlperf":
            given = [n for n in ("train_days", "val_days", "test_days") if getattr(self, n)]
            given += ["val_fraction"] if self.val_fraction != 0.5 else []
            if given:
                raise ValueError(
                    f"data.split mlperf trains on every labeled day but the last and halves "
                    f"the last for val and test: it takes no data.{', data.'.join(given)}"
                )
        for name in ("train_days", "val_days", "test_days"):
            days = getattr(self, name)
            if days is not None and len(set(days)) != len(days):
                raise ValueError(f"{name} lists a day twice: {days}")
        if self.train_days is not None:
            for name in ("val_days", "test_days"):
                both = set(self.train_days) & set(getattr(self, name) or [])
                if both:
                    raise ValueError(f"{name} {sorted(both)} are also train_days")
        if isinstance(self.max_rows_per_table, list) and len(self.max_rows_per_table) != NUM_SPARSE:
            raise ValueError(
                f"max_rows_per_table: one value or {NUM_SPARSE}, got {len(self.max_rows_per_table)}"
            )
        return self


DataConfig = Annotated[SyntheticData | CriteoData, Field(discriminator="source")]


# ---------------------------------------------------------------------------------- model
class ModelConfig(_Section):
    #: torchrec's DLRM (dot interaction) or DLRM_DCN (low-rank cross layers).
    arch: Literal["dlrm", "dlrm_dcn"] = "dlrm"
    #: Width D of every embedding table.
    embedding_dim: Count(1, MAX_EMBEDDING_DIM) = 16
    #: Widths of the bottom MLP over the dense features; the last is `embedding_dim`.
    dense_arch: list[Width] = Field(
        default_factory=lambda: [64, 16], min_length=1, max_length=MAX_LAYERS
    )
    #: Widths of the top MLP over the interactions; the last is 1 (the logit).
    over_arch: list[Width] = Field(
        default_factory=lambda: [64, 32, 1], min_length=1, max_length=MAX_LAYERS
    )
    #: Cross layers of `dlrm_dcn`.
    dcn_num_layers: Count(1, MAX_LAYERS) = 3
    #: Rank of each `dlrm_dcn` cross layer.
    dcn_low_rank_dim: Count(1, MAX_WIDTH) = 16
    #: Tables on FBGEMM's TBE kernels (torchrec), or plain PyTorch (no torchrec, no FBGEMM; one
    #: process).
    embedding_backend: Literal["fbgemm", "torch"] = "fbgemm"
    #: How the tables' weights are stored: `fp32`, or `fp16` (FBGEMM's weights_precision: half
    #: the memory and lookup bandwidth; writes rounded stochastically; the Adagrad sums, the
    #: lookups and every GSNR sum stay float32). fbgemm backend only.
    embedding_precision: Annotated[Literal["fp32", "fp16"], ADDED_LATER] = "fp32"

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.dense_arch[-1] != self.embedding_dim:
            raise ValueError(
                f"dense_arch must end with embedding_dim ({self.embedding_dim}), "
                f"got {self.dense_arch}"
            )
        if self.over_arch[-1] != 1:
            raise ValueError(f"over_arch must end with 1 (one logit), got {self.over_arch}")
        if self.embedding_precision != "fp32" and self.embedding_backend != "fbgemm":
            raise ValueError(
                f"embedding_precision {self.embedding_precision} needs embedding_backend: fbgemm "
                "(the torch backend's tables are float32)"
            )
        return self


# ---------------------------------------------------------------------------------- optim
DenseOptimizerName = Literal[
    "sgd", "adam", "adamw", "adagrad", "lars", "lamb",
    "vrsgd", "vradam", "vrlars", "vrlamb", "vradagrad",
]  # fmt: skip
SparseOptimizerName = Literal[
    "rowwise_adagrad",
    "adagrad",
    "sgd",
    "gsnr_rowwise_adagrad",
    "gsnr_adagrad",
    "gsnr_sgd",
    "cowclip_rowwise_adagrad",
    "cowclip_sgd",
]


class DenseOptimConfig(_Section):
    """Dense-layer optimizer. ``vr*`` names are the VRGD variants of sgd / adamw / LARS / LAMB /
    Adagrad (DESIGN.md 4.2, docs/vrgd.md); ``gamma`` and ``gsnr_beta`` apply to them only,
    ``trust_coefficient`` to (vr)lars, ``initial_accumulator_value`` to (vr)adagrad. ``lars`` /
    ``lamb`` are the plain algorithms (VRLARS / VRLAMB with γ = 1); ``adagrad`` is
    ``torch.optim.Adagrad`` (``lr_decay`` 0)."""

    #: Plain `sgd`, `adam`, `adamw`, `adagrad`, `lars`, `lamb`, or VRGD `vrsgd`, `vradam`,
    #: `vrlars`, `vrlamb`, `vradagrad`.
    name: DenseOptimizerName = "adamw"
    #: Base learning rate of the dense layers (before warm-up, decay and batch scaling).
    lr: Real(gt=0.0, le=1e6) = 1e-3
    #: Momentum of (vr)sgd and (vr)lars.
    momentum: Fraction = 0.0
    #: Dampening of the momentum, as `torch.optim.SGD`.
    dampening: Fraction = 0.0
    #: Nesterov momentum (needs momentum > 0 and dampening 0).
    nesterov: Flag = False
    #: Weight decay, as each base optimizer applies it; never scaled by the GSNR ratio.
    weight_decay: Real(ge=0.0, le=1e6) = 0.0
    #: Adam's and LAMB's moment factors (β1, β2).
    betas: tuple[Fraction, Fraction] = (0.9, 0.999)
    #: Added to the denominator of the adaptive optimizers (MLPerf's DLRMv2 Adagrad uses 1e-8
    #: since mlcommons/training fd4672ca, as its compliance checker requires; torch's: 1e-10).
    eps: Real(gt=0.0, le=1.0) = 1e-8
    #: The starting sum of squares of (vr)adagrad, as `torch.optim.Adagrad`'s (MLPerf: 0).
    initial_accumulator_value: Annotated[Real(ge=0.0, le=1e6), ADDED_LATER] = 0.0
    #: Lower clip of the GSNR ratio: 1 reproduces the base optimizer exactly.
    gamma: Real(gt=0.0, le=1.0) = 0.1
    #: EMA factor of the ratio for vradam / vrlamb.
    gsnr_beta: Fraction = 0.9
    #: Where vradam / vrlamb apply the ratio: ``gradient`` (the paper's: ``p̂⊙ḡ`` feeds both
    #: moments) or ``update`` (the moments see ``ḡ``; Adam's step is scaled by ``p̂``). vrsgd and
    #: vrlars are linear in ``ḡ``: both values mean the same for them. vradagrad has one
    #: placement, whatever this says: its sum sees ``ḡ`` and ``r`` scales its step.
    gsnr_placement: Literal["gradient", "update"] = "gradient"
    #: LARS's trust coefficient η (lars and vrlars).
    trust_coefficient: Real(gt=0.0, le=1e6) = 0.001

    @model_validator(mode="after")
    def _check_nesterov(self) -> DenseOptimConfig:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0")
        return self


class SparseOptimConfig(_Section):
    """Embedding-table optimizer: FBGEMM's fused EXACT_ROWWISE_ADAGRAD (``rowwise_adagrad``),
    EXACT_ADAGRAD (``adagrad``: full, element-wise Adagrad, one sum per weight element, as
    MLPerf DLRMv2's tables; fbgemm backend only) or EXACT_SGD (``sgd``); the ``gsnr_`` variants
    scale each row's step by its GSNR ratio (DESIGN.md 4.3) with lower clip ``gamma`` and the
    ``step`` or ``ema`` estimator (``gsnr_adagrad``: ``w −= lr·r_row·ḡ/(√s + ε)`` element-wise,
    ``s += ḡ⊙ḡ`` unscaled).
    ``gsnr_placement: update`` (default) keeps the kernel's state on the unscaled gradient and
    scales the row's step; ``gradient`` hands ``r_row·ḡ_row`` to the kernel (the first design,
    whose damping row-wise Adagrad largely cancels; the same as ``update`` for ``sgd``).
    The ``cowclip_`` variants clip each touched row's step gradient by CowClip (arXiv
    2204.06240) as its authors' code does: ``g_j = ḡ_j + 2·weight_decay·w_j`` (the mean-loss
    gradient plus Keras's L2), then ``g_j·min(1, t_j/‖g_j‖)`` with
    ``t_j = clip_ratio·cnt_j·max(‖w_j‖, clip_ratio·zeta·√D)``, ``cnt_j`` the samples holding
    the id (see :mod:`dlrm_vrgd.optim.sparse`, docs/cowclip.md)."""

    #: FBGEMM's `rowwise_adagrad`, `adagrad` (element-wise) or `sgd`, their `gsnr_` (row-wise
    #: GSNR) or `cowclip_` (CowClip) variants.
    name: SparseOptimizerName = "rowwise_adagrad"
    #: Base learning rate of the embedding tables.
    lr: Real(gt=0.0, le=1e6) = 0.05
    #: Added to Adagrad's denominator (outside the square root).
    eps: Real(gt=0.0, le=1.0) = 1e-8
    #: Lower clip of the rows' GSNR ratio (`gsnr_` names): 1 is the plain optimizer.
    gamma: Real(gt=0.0, le=1.0) = 0.1
    #: Row-wise GSNR from this step's micro-batches (`step`) or per-row averages across steps
    #: (`ema`: two floats per table row).
    estimator: Literal["step", "ema"] = "step"
    #: Averaging factor of the `ema` estimator.
    ema_beta: Fraction = 0.9
    #: Where the ratio acts: on the row's step (`update`) or on the gradient handed to the
    #: kernel (`gradient`); see the section's description.
    gsnr_placement: Literal["update", "gradient"] = "update"
    #: CowClip's r: the row's mean-loss gradient is bounded by r x cnt x max(‖w‖, r·ζ·√D).
    clip_ratio: Real(gt=0.0, le=1e30) = 1.0
    #: CowClip's ζ (their ``bound``): the lower bound of the weight norm is r·ζ·√D.
    zeta: Real(ge=0.0, le=1e6) = 1e-5
    #: CowClip's λ (Keras ``l2``): ``2λ·w_j`` is added to each touched row's gradient, before
    #: the clip.
    weight_decay: Real(ge=0.0, le=1e6) = 0.0
    #: Rows replayed through the fused kernel per call (bounds transient memory).
    replay_chunk_rows: Count(1, MAX_MICRO_BATCH) = 65_536

    @property
    def kernel(self) -> str:
        """The fused FBGEMM update: ``rowwise_adagrad``, ``adagrad`` or ``sgd``."""
        return self.name.removeprefix("gsnr_").removeprefix("cowclip_")

    @property
    def gsnr(self) -> bool:
        return self.name.startswith("gsnr_")

    @property
    def cowclip(self) -> bool:
        return self.name.startswith("cowclip_")

    @model_validator(mode="after")
    def _check_weight_decay(self) -> SparseOptimConfig:
        if self.weight_decay and not self.cowclip:
            raise ValueError(
                f"weight_decay applies to the cowclip_* optimizers only, not {self.name!r}"
            )
        return self


class ScheduleConfig(_Section):
    """Linear warm-up, then a decay to ``min_lr_factor`` at the last step (DESIGN.md 4.4)."""

    #: Steps of linear warm-up from 0 to the base learning rates.
    warmup_steps: Steps = 0
    #: Decay after warm-up to `min_lr_factor` × the base LR at the last step.
    decay: Literal["none", "poly", "cosine"] = "none"
    #: Learning rate at the last step, as a fraction of the base LR.
    min_lr_factor: Real(ge=0.0, le=1.0) = 0.0
    #: Scale both base LRs by the global batch relative to ``reference_batch``.
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    #: The global batch at which `lr_scaling` leaves the base LRs as they are.
    reference_batch: Count(1, MAX_BATCH) = 8192


class OptimConfig(_Section):
    dense: DenseOptimConfig = Field(default_factory=DenseOptimConfig)
    sparse: SparseOptimConfig = Field(default_factory=SparseOptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)


# ------------------------------------------------------------------------------------ run
TableSharding = Literal[
    "table_wise", "column_wise", "table_column_wise", "row_wise", "data_parallel"
]


def check_uri(uri: str) -> str:
    """A tracking URI or artifact location without credentials, query string or fragment;
    the message says where credentials go instead (never echoing the URI)."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in uri):
        raise ValueError("contains a control character")
    env = " / ".join(CREDENTIAL_ENV)
    if redact(uri) != uri:
        raise ValueError(
            "carries credentials (user:password@ or a secret query parameter); a URI is "
            f"stored and shown with the run, so set them in the environment instead: {env}"
        )
    if "?" in uri or "#" in uri:
        raise ValueError(
            f"has a query string or fragment; MLflow URIs take none (credentials: {env})"
        )
    return uri


class MlflowConfig(_Section):
    """Export a run to an MLflow tracking server (``pip install 'dlrm-vrgd[tracking]'``); see
    :mod:`dlrm_vrgd.tracking.mlflow_sink`. The run directory stays the record: a server that
    cannot be reached is logged once and training goes on."""

    #: ``http(s)://HOST:PORT``, ``sqlite:///PATH`` or ``file:PATH`` (MLflow's own URI forms),
    #: without credentials: MLflow reads them from ``MLFLOW_TRACKING_USERNAME`` /
    #: ``MLFLOW_TRACKING_PASSWORD`` or ``MLFLOW_TRACKING_TOKEN`` in the environment.
    tracking_uri: Annotated[str, Field(min_length=1, max_length=2000)]
    #: MLflow experiment (created if missing).
    experiment: Annotated[str, Field(min_length=1, max_length=500)] = "dlrm-vrgd"
    #: Where a newly created experiment keeps artifacts. None: the server decides; for a
    #: ``sqlite:///PATH`` store, ``PATH``'s folder, beside the database (``runs/mlflow.db`` ->
    #: ``runs/mlflow-artifacts/``), never MLflow's ``./mlruns`` in the working directory.
    artifact_location: Annotated[str, Field(min_length=1, max_length=2000)] | None = None
    #: With ``--export-model``: register the exported model under this name in MLflow's model
    #: registry (a new version per run). The model directory is logged as the run's ``model``
    #: artifact either way.
    register_model: (
        Annotated[str, Field(min_length=1, max_length=250, pattern=r"^[A-Za-z0-9][\w.\- ]*$")]
        | None
    ) = None
    #: MLflow run name (None: the run directory's name).
    run_name: Annotated[str, Field(min_length=1, max_length=250)] | None = None
    #: Nest the run under this MLflow run (a study sets it for its cells).
    parent_run_id: Annotated[str, Field(min_length=1, max_length=200)] | None = None

    @field_validator("tracking_uri", "artifact_location")
    @classmethod
    def _check_uris(cls, uri: str | None) -> str | None:
        return uri if uri is None else check_uri(uri)


class InputConfig(_Section):
    """The input pipeline (:mod:`dlrm_vrgd.data.pipeline`): the micro-batches of the coming
    steps, keyed by ``(step, group)``, are built ahead of the step by a background builder
    (into pinned buffers and copied to the GPU on a side stream with ``device: cuda``). The
    rows are the same whatever is chosen here: only when they are built changes."""

    #: Who builds the micro-batches: `serial` (the step builds each one when it needs it:
    #: nothing ahead), `threads`, `processes` (forked worker processes; Linux), or `auto`:
    #: one thread for preprocessed npy days (`data.source: criteo`), and for live synthetic
    #: data worker processes with `device: cuda` and one thread with `device: cpu` (the step's
    #: own threads keep the cores busy there).
    builder: Literal["auto", "serial", "threads", "processes"] = "auto"
    #: Builder threads or processes (None: one thread; processes: the cores per rank less 2,
    #: between 1 and 16).
    workers: Count(1, 256) | None = None
    #: Micro-batches built ahead of the one the step is using (None: 2 per worker, at least 2).
    #: Host memory grows by about `depth` micro-batches.
    depth: Count(1, 1024) | None = None


class RunConfig(_Section):
    #: G: rows per optimizer step, over all ranks (G = world size × A × micro_batch).
    global_batch: Count(1, MAX_BATCH) = 8192
    #: B: rows per forward/backward pass on one rank; memory is set by it, not by G.
    micro_batch: Count(1, MAX_MICRO_BATCH) = 1024
    #: Training length: ``steps`` or ``epochs`` (fractions allowed), not both; neither = 1 epoch.
    steps: Count(1, MAX_STEPS) | None = None
    #: Training length in passes over the training rows (fractions allowed); see `steps`.
    epochs: Real(gt=0.0, le=MAX_EPOCHS) | None = None
    #: Evaluate on the validation rows every N steps (0: only at the end). Or give
    #: `evals_per_epoch`, not both.
    eval_every: Steps = 100
    #: Evaluate this many times an epoch instead of every `eval_every` steps (MLPerf DLRMv2:
    #: 20): every ⌊train rows / (global_batch × evals_per_epoch)⌋ steps (at least 1), MLPerf's
    #: reference rounding, so every eval falls at a fixed count of rows. Setting it leaves
    #: `eval_every` at 0; a config that sets both (eval_every not 0) is refused.
    evals_per_epoch: Annotated[Count(1, 1_000_000) | None, ADDED_LATER] = None
    #: Stop at the first validation evaluation (periodic, or the final one) whose AUC reaches
    #: this (MLPerf DLRMv2: 0.80275); its step is checkpointed and result.json's ``target``
    #: records the rows, epochs and time it took. Never reached: the run goes to its end.
    target_auc: Annotated[Real(gt=0.0, le=1.0) | None, ADDED_LATER] = None
    #: Rows per forward pass of an evaluation.
    eval_batch: Count(1, MAX_MICRO_BATCH) = 16_384
    #: Rows of the validation split used by periodic evals (None: all of it).
    eval_rows: Rows | None = None
    #: At the end, also score the first N training rows (split "train"; 0 = skip), to show
    #: the train - test gap.
    final_train_eval_rows: Count(0, MAX_ROWS) = 0
    #: Checkpoint every N steps (0: none during training). A finished run always checkpoints
    #: its last step.
    checkpoint_every: Steps = 0
    #: Also checkpoint when this many seconds passed since the last checkpoint (0 = off): a
    #: long step loses at most this much work to a crash or a lost node.
    checkpoint_every_s: Count(0, 30 * 86_400) = 0
    #: Newest checkpoints kept; the best-validation one is kept beside them (see below).
    keep_checkpoints: Count(1, 1000) = 2
    #: With periodic evals, checkpoint each new best validation AUC and never prune it
    #: (``checkpoints/best.json`` names it; ``dlrm-vrgd export --best`` exports it), whether
    #: or not periodic checkpoints are on.
    keep_best_checkpoint: bool = True
    #: Stop after this many periodic evaluations without a better validation AUC (None: off;
    #: needs ``eval_every`` or ``evals_per_epoch``). The schedule keeps its planned length; the
    #: final evals score the last weights, and the best ones stay in the best checkpoint.
    early_stop_patience: Count(1, 1_000_000) | None = None
    #: Write a `kind: train` record to metrics.jsonl every N steps (and at step 1).
    log_every: Count(1, MAX_STEPS) = 1
    #: Write per-tensor / per-table GSNR summaries to gsnr.jsonl every N steps.
    gsnr_every: Count(1, MAX_STEPS) = 1
    #: EMA factor of the gradient noise scale's two estimates (DESIGN.md 4.6), updated every
    #: step: an effective window of (1 + β) / (1 − β) steps (39 at 0.95).
    noise_scale_beta: Real(ge=0.0, lt=1.0) = 0.95
    #: Seed of the initial weights and of the data order.
    seed: Seed = 0
    #: Where each rank trains (`cuda`: one GPU per rank).
    device: Literal["cpu", "cuda"] = "cpu"
    #: CPU threads of each process (None: torch's choice for one process; the cores divided by
    #: `nproc_per_node` when `train` launches several ranks).
    threads: Count(1, 4096) | None = None
    #: Fix glibc's mmap threshold (KiB) so freed buffers return to the system: resident memory
    #: stops creeping over many micro-batches, steps get slower (see dlrm_vrgd/malloc.py); 0 = off.
    malloc_mmap_threshold_kb: Count(0, 32 * 1024) = 0
    #: When glibc's free heap pages go back to the system (CPU memory; dlrm_vrgd/malloc.py):
    #: `micro_batch` after every micro-batch (resident memory follows what is alive; each
    #: micro-batch re-touches its pages: steps 16-37% slower on 2 CPU cores than `growth`),
    #: `growth` once the heap has grown by 64 MiB (peak 56-127 MB higher, 16k-512k rows a step
    #: of the Kaggle-sized model), `never`. `auto` (default) is `micro_batch` with
    #: `device: cpu` and `never` with `device: cuda` (the step's tensors live on the GPU; the
    #: host keeps only reused input buffers). The sparse step's chunks hand back in every mode.
    heap_release: Annotated[Literal["auto", "micro_batch", "growth", "never"], OPERATIONAL] = "auto"
    #: How micro-batches reach the step: built ahead in the background (docs/input.md).
    input: Annotated[InputConfig, OPERATIONAL] = Field(default_factory=InputConfig)
    #: Numeric precision of the MLPs and the interaction (dlrm_vrgd/precision.py): `fp32`;
    #: `tf32` (a GPU's TF32 matmuls; on a CPU the same as fp32); `bf16` (autocast to bfloat16,
    #: float32 master weights). Tables, GSNR and Adagrad sums stay float32 or wider.
    precision: Annotated[Literal["fp32", "tf32", "bf16"], ADDED_LATER] = "fp32"
    #: Processes per node, nodes (torchrun); world size W = nnodes x nproc_per_node.
    nproc_per_node: Count(1, 256) = 1
    #: Hosts of a multi-node job (each runs `nproc_per_node` ranks).
    nnodes: Count(1, 4096) = 1
    #: c10d rendezvous HOST:PORT, required for nnodes > 1 (every node runs the same command).
    rdzv_endpoint: Annotated[str, Field(max_length=300)] | None = None
    #: torchrun's rendezvous id (a multi-node job needs one of its own).
    rdzv_id: Annotated[str, Field(min_length=1, max_length=200)] = "dlrm-vrgd"
    #: Sharding types the planner may use for the tables (W > 1). row_wise needs a GPU.
    sharding: list[TableSharding] = Field(
        default_factory=lambda: ["table_wise"], min_length=1, max_length=8
    )
    #: Longest wait of a collective (all-reduce, all-to-all, barrier): a rank that froze or
    #: died fails the job after this many seconds instead of hanging it.
    collective_timeout_s: Count(10, 86_400) = 180
    #: Write TensorBoard event files to ``tb/`` in the run directory (rank 0, off the step).
    tensorboard: Annotated[Flag, OPERATIONAL] = True
    #: Also export params, metrics and artifacts to MLflow (None: off).
    mlflow: Annotated[MlflowConfig | None, OPERATIONAL] = None

    @model_validator(mode="before")
    @classmethod
    def _one_eval_cadence(cls, raw: Any) -> Any:
        """``evals_per_epoch`` given without ``eval_every``: no step cadence (eval_every 0);
        both given (eval_every not 0): refused, naming both."""
        if not isinstance(raw, dict) or raw.get("evals_per_epoch") is None:
            return raw
        if "eval_every" not in raw:
            return {**raw, "eval_every": 0}
        if raw["eval_every"] not in (0, None):
            raise ValueError(
                f"run.eval_every ({raw['eval_every']!r}) and run.evals_per_epoch "
                f"({raw['evals_per_epoch']!r}) are both set: evaluate every N steps or N times "
                "an epoch, not both (leave eval_every out or set it to 0)"
            )
        return raw

    @model_validator(mode="after")
    def _check_batch(self) -> RunConfig:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("set run.steps or run.epochs, not both")
        world = self.world_size
        per_rank, rem = divmod(self.global_batch, world)
        if rem:
            raise ValueError(
                f"global_batch ({self.global_batch}) must be divisible by the world size "
                f"nnodes x nproc_per_node ({world})"
            )
        if per_rank % self.micro_batch:
            raise ValueError(
                f"global_batch / world size ({per_rank}) must be a multiple of "
                f"micro_batch ({self.micro_batch})"
            )
        if self.early_stop_patience is not None and not (self.eval_every or self.evals_per_epoch):
            raise ValueError(
                "run.early_stop_patience needs periodic evaluations: set eval_every or "
                "evals_per_epoch"
            )
        if "data_parallel" in self.sharding:
            raise ValueError(
                "sharding: data_parallel tables would be trained by the dense optimizer, "
                "silently ignoring the sparse (row-wise / GSNR) one; use table_wise or column_wise"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def eval_interval(self, train_rows: int) -> int:
        """Steps between periodic evaluations (0: none) over ``train_rows`` training rows:
        ``eval_every``, or with ``evals_per_epoch`` ⌊train_rows / (global_batch ×
        evals_per_epoch)⌋, at least 1 (MLPerf's reference: ``validation_freq_within_epoch =
        TOTAL_TRAINING_SAMPLES // (GLOBAL_BATCH_SIZE * 20)``)."""
        if self.evals_per_epoch is None:
            return self.eval_every
        return max(1, train_rows // (self.global_batch * self.evals_per_epoch))

    @property
    def accumulation_steps(self) -> int:
        """A: micro-batches per rank per global step."""
        return self.global_batch // (self.world_size * self.micro_batch)


class TrainConfig(_Section):
    """The whole job. ``G = world_size x A x B`` rows per optimizer step (DESIGN.md 2)."""

    data: DataConfig = Field(default_factory=SyntheticData)
    model: ModelConfig = Field(default_factory=ModelConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _check_multi_hot(self) -> TrainConfig:
        """Multi-hot ids train on FBGEMM's tables only: the torch backend's lookup takes one id
        a table. Every table optimizer (plain, ``gsnr_``, ``cowclip_``) handles bags with
        repeated ids (tests/optim/test_sparse_multihot.py, issue 46)."""
        if getattr(self.data, "multi_hot_sizes", None) is None:
            return self
        if self.model.embedding_backend != "fbgemm":
            raise field_error(
                ("data", "multi_hot_sizes"),
                "multi-hot ids need model.embedding_backend: fbgemm (the torch backend's lookup "
                "takes one id a table)",
                self.data.multi_hot_sizes,  # type: ignore[union-attr]
            )
        return self

    @model_validator(mode="after")
    def _check_table_optimizer(self) -> TrainConfig:
        """Element-wise Adagrad is FBGEMM's EXACT_ADAGRAD: the torch backend's tables keep
        row-wise sums only."""
        if self.optim.sparse.kernel == "adagrad" and self.model.embedding_backend != "fbgemm":
            raise field_error(
                ("optim", "sparse", "name"),
                "element-wise adagrad needs model.embedding_backend: fbgemm (the torch "
                "backend's tables keep one Adagrad sum per row)",
                self.optim.sparse.name,
            )
        return self

    @model_validator(mode="after")
    def _check_length(self) -> TrainConfig:
        if isinstance(self.data, SyntheticData):
            try:  # a length too long to count fails here, not in the trainer
                self.total_steps(self.data.train_rows)
            except ConfigError as err:
                raise field_error(
                    ("run", "epochs"), str(err).partition(": ")[2], self.run.epochs
                ) from None
        return self

    def total_steps(self, train_rows: int) -> int:
        """Optimizer steps of the run over ``train_rows`` training rows; a
        :class:`ConfigError` naming ``run.epochs`` when that is more than ``MAX_STEPS``."""
        if self.run.steps is not None:
            return self.run.steps
        epochs = 1.0 if self.run.epochs is None else self.run.epochs
        try:
            steps = max(1, math.ceil(epochs * train_rows / self.run.global_batch))
        except (OverflowError, ValueError):
            steps = MAX_STEPS + 1
        if steps > MAX_STEPS:
            raise ConfigError(
                f"run.epochs: {epochs:g} epochs of {train_rows:,} rows at global_batch "
                f"{self.run.global_batch:,} is more than {MAX_STEPS:,} steps"
            )
        return steps

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON; the URIs of ``run.mlflow`` pass :func:`redact` (a no-op for a
        validated config: defence in depth for every file and answer that stores it)."""
        out = self.model_dump(mode="json")
        if out["run"].get("mlflow") is not None:
            out["run"]["mlflow"] = redact_obj(out["run"]["mlflow"])
        return out


# ------------------------------------------------------------------------------- loading
def format_validation_error(err: ValidationError, source: str = "config") -> str:
    lines = [f"invalid {source}:"]
    for e in err.errors():
        lines.append(f"  {error_field(e['loc']) or '<root>'}: {e['msg']}")
    return "\n".join(lines)


def error_field(loc: tuple[Any, ...] | list[Any]) -> str:
    """The dotted field of a pydantic error location, without union member tags."""
    return ".".join(str(p) for p in loc if not _is_union_tag(p))


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the discriminator value ("synthetic") and union members
    # ("constrained-int", "list[constrained-int]") into the error path; drop them.
    if part in ("synthetic", "criteo"):
        return True
    return isinstance(part, str) and any(c in part for c in "-[(")


def parse_config(raw: dict[str, Any], source: str = "config") -> TrainConfig:
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


#: Keys of which a config holds one at most: an override of one replaces the other where it
#: came from the file (``--set run.steps=30`` on a config with ``epochs``).
EXCLUSIVE = {
    "run.steps": "run.epochs",
    "run.epochs": "run.steps",
    "run.eval_every": "run.evals_per_epoch",
    "run.evals_per_epoch": "run.eval_every",
}


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides; values are YAML scalars or flow collections. An
    override of one of :data:`EXCLUSIVE` drops its partner (unless an override sets it too)."""
    keys = {item.partition("=")[0] for item in overrides}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. optim.dense.lr=0.1")
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"override {key}: cannot parse value {text!r}: {err}") from None
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key}: {part} is not a section")
            node = child
        node[parts[-1]] = value
        partner = EXCLUSIVE.get(key)
        if partner is not None and value is not None and partner not in keys:
            *where, name = partner.split(".")
            section = raw
            for part in where:
                section = section.get(part) if isinstance(section, dict) else None
            if isinstance(section, dict):
                section.pop(name, None)
    return raw


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (empty: ``{}``); :class:`ConfigError` naming
    the file (and the line) otherwise."""
    path = Path(path)
    try:
        loaded = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: not valid YAML: {err}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return loaded


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config (or the defaults when ``path`` is None) and apply overrides. A
    mistake is blamed where it is: a field an override set is named with its ``--set``, one
    of the file with the file; an unknown key gets the nearest known one ("did you mean")."""
    overrides = overrides or []
    raw = read_yaml_mapping(path) if path is not None else {}
    raw = apply_overrides(raw, overrides)
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as err:
        source = "config" if path is None else str(path)
        raise ConfigError(_blamed(err, source, overrides)) from None


def _blamed(err: ValidationError, source: str, overrides: list[str]) -> str:
    """The errors of a config read from ``source`` with ``overrides``, each under the
    override that set its field (``--set KEY=VALUE: field: message``) or the file."""
    by_override, by_file = [], []
    for e in err.errors():
        name = error_field(e["loc"]) or "<root>"
        message = e["msg"]
        if e["type"] == "extra_forbidden":
            near = nearest_key(e["loc"])
            message += f" (an unknown key; did you mean {near}?)" if near else " (an unknown key)"
        item = next((o for o in overrides if _covers(o.partition("=")[0], name)), None)
        if item is not None:
            by_override.append(f"  --set {redact(item)}: {name}: {message}")  # no secret echoed
        else:
            by_file.append(f"  {name}: {message}")
    head = f"invalid {source}:" if by_file else "invalid --set override:"
    return "\n".join([head, *by_file, *by_override])


def _covers(key: str, name: str) -> bool:
    """Whether an override of ``key`` set the field ``name`` (or a section holding it, or a
    field of the section it names)."""
    return key == name or name.startswith(key + ".") or key.startswith(name + ".")


#: The tags pydantic puts into an error's location for the members of ``data``.
_UNION_TAGS: dict[str, type[BaseModel]] = {"synthetic": SyntheticData, "criteo": CriteoData}


def nearest_key(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """The known key closest to the unknown one at ``loc`` (dotted), if one is close."""
    import difflib
    import types
    import typing

    models: list[type[BaseModel]] = [TrainConfig]
    path = [p for p in loc if isinstance(p, str)]
    kept: list[str] = []
    for part in path[:-1]:
        if part in _UNION_TAGS or _is_union_tag(part):
            tagged = [m for m in models if _UNION_TAGS.get(part) is m]
            models = tagged or models
            continue
        nxt: list[type[BaseModel]] = []
        for model in models:
            info = model.model_fields.get(part)
            if info is None:
                continue
            todo: list[Any] = [info.annotation]
            while todo:
                t = todo.pop()
                if isinstance(t, type) and issubclass(t, BaseModel):
                    nxt.append(t)
                elif isinstance(t, types.UnionType) or typing.get_origin(t) is not None:
                    todo.extend(typing.get_args(t))
        if not nxt:
            return None
        models, kept = nxt, [*kept, part]
    names = sorted({f for m in models for f in m.model_fields})
    found = difflib.get_close_matches(path[-1], names, n=1, cutoff=0.6) if path else []
    return ".".join([*kept, found[0]]) if found else None
