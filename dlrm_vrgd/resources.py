"""What a job needs in memory, estimated from its config before anything is launched.

:func:`estimate` adds up, per node, the parts that grow with the config: the embedding tables
(weights and row-wise optimizer state), the step's row accumulator, the dense layers with their
gradients and optimizer state, the activations of one micro-batch and of one eval batch, the
cached data, and a fixed runtime allowance (Python, torch, torchrec). Each part names the config
fields that drive it. :func:`check_fits` refuses a job whose estimate exceeds the memory of
the machine that would hold it (:class:`ResourceError`, a :class:`ConfigError` naming the
fields of the parts that dominate), so that a job too big for the host is a clear error at
submission, not an out-of-memory kill an hour in.

The estimate is deliberately simple (float32 everywhere, a fixed factor for autograd's saved
tensors): it is meant to catch a job off by orders of magnitude, not to plan a tight fit.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from dlrm_vrgd.config import NUM_DENSE, NUM_SPARSE, ConfigError, CriteoData, TrainConfig
from dlrm_vrgd.study.config import Cell, StudyConfig

logger = logging.getLogger(__name__)

FLOAT = 4
INDEX = 8
GIB = 1 << 30
#: Python, torch, torchrec and FBGEMM loaded, per process.
RUNTIME_BYTES = 1 * GIB
#: Activation memory of a training micro-batch, as a multiple of its forward tensors
#: (saved for backward, their gradients, temporaries).
TRAIN_ACTIVATION_FACTOR = 3
#: Rows of an eval split kept in memory (train.loop.EVAL_CACHE_ROWS).
EVAL_CACHE_ROWS = 250_000
#: Optimizer-state tensors per dense parameter (plus one for its gradient, one for the GSNR
#: group sum and one for the sum of squares of the VR variants).
DENSE_STATE = {
    "sgd": 1, "adam": 2, "adamw": 2, "adagrad": 1, "lars": 1, "lamb": 2,
    "vrsgd": 1, "vradam": 3, "vrlars": 1, "vrlamb": 3, "vradagrad": 1,
}  # fmt: skip
#: A part counts as driving the estimate when it is at least this share of the total.
DRIVER_SHARE = 0.25


class ResourceError(ConfigError):
    """A job that cannot fit the memory of its host; ``fields`` are the config fields that
    drive the estimate."""

    def __init__(self, reason: str, fields: list[str]) -> None:
        super().__init__(f"{', '.join(fields)}: {reason}")
        self.reason = reason
        self.fields = fields


@dataclass(frozen=True)
class Part:
    name: str
    bytes: int
    fields: tuple[str, ...]


@dataclass(frozen=True)
class Estimate:
    """Memory of the busiest node of a job, by part."""

    parts: tuple[Part, ...]

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts)

    def drivers(self) -> list[Part]:
        """The parts that dominate, largest first."""
        total = max(self.total, 1)
        ranked = sorted(self.parts, key=lambda p: -p.bytes)
        return [p for p in ranked if p.bytes >= DRIVER_SHARE * total] or ranked[:1]

    def fields(self) -> list[str]:
        out: list[str] = []
        for part in self.drivers():
            out += [f for f in part.fields if f not in out]
        return out

    def describe(self) -> str:
        return ", ".join(f"{p.name} {gib(p.bytes)}" for p in self.drivers())


def gib(n: int | float) -> str:
    return f"{n / GIB:,.1f} GiB"


def table_rows(cfg: TrainConfig) -> list[int] | None:
    """Rows of every table: the synthetic cardinalities, or a preprocessed directory's (read
    from its manifest, capped by ``max_rows_per_table``; the caps alone when the manifest
    cannot be read); None when neither is known."""
    data = cfg.data
    if not isinstance(data, CriteoData):
        return list(data.cardinalities)
    caps = data.max_rows_per_table
    caps = None if caps is None else caps if isinstance(caps, list) else [caps] * NUM_SPARSE
    try:
        manifest = json.loads((Path(data.path) / "manifest.json").read_text())
        cards = [int(c) for c in manifest["sparse"]["cardinalities"]]
    except (OSError, ValueError, KeyError, TypeError):
        return caps
    if caps is None:
        return cards
    return [min(c, k) for c, k in zip(cards, caps, strict=False)]


def _mlp_params(widths: list[int], inputs: int) -> int:
    total = 0
    for w in widths:
        total += inputs * w + w
        inputs = w
    return total


def estimate(cfg: TrainConfig) -> Estimate:
    """Memory of the busiest node of ``cfg`` (see the module docstring)."""
    model, run, data = cfg.model, cfg.run, cfg.data
    rows = table_rows(cfg)
    tables = len(rows) if rows is not None else NUM_SPARSE
    dense_in = data.num_dense if not isinstance(data, CriteoData) else NUM_DENSE
    dim = model.embedding_dim
    procs = run.nproc_per_node
    parts = []

    table_fields = (
        ("data.cardinalities", "model.embedding_dim")
        if not isinstance(data, CriteoData)
        else ("data.max_rows_per_table", "model.embedding_dim")
    )
    if rows is not None:
        per_row = dim + 1 + (2 if cfg.optim.sparse.estimator == "ema" else 0)  # + row state
        # tables are sharded over the nodes: a node holds its share (at least the largest table)
        share = max(sum(rows) / run.nnodes, max(rows))
        parts.append(Part("embedding tables", int(share * per_row * FLOAT), table_fields))

    # the rows one rank's share of the global batch touches, accumulated until the step
    touched = run.global_batch // run.world_size * tables
    if rows is not None:
        touched = min(touched, sum(rows))
    parts.append(
        Part(
            "step row accumulator",
            procs * touched * ((dim + 1) * FLOAT + 2 * INDEX),
            ("run.global_batch", "model.embedding_dim"),
        )
    )

    features = tables + 1
    if model.arch == "dlrm":
        interaction = dim + features * (features - 1) // 2
        cross = 0
    else:
        interaction = features * dim
        cross = model.dcn_num_layers * (2 * interaction * model.dcn_low_rank_dim + interaction)
    params = (
        _mlp_params(model.dense_arch, dense_in) + _mlp_params(model.over_arch, interaction) + cross
    )
    copies = 2 + DENSE_STATE[cfg.optim.dense.name]  # weights, gradients, optimizer state
    parts.append(
        Part(
            "dense layers and optimizer state",
            procs * params * copies * FLOAT,
            ("model.dense_arch", "model.over_arch", "model.embedding_dim"),
        )
    )

    per_row = (
        dense_in
        + tables * dim
        + sum(model.dense_arch)
        + features * features
        + interaction
        + sum(model.over_arch)
        + (model.dcn_num_layers * interaction * 2 if model.arch == "dlrm_dcn" else 0)
    )
    parts.append(
        Part(
            "training activations",
            procs * run.micro_batch * per_row * FLOAT * TRAIN_ACTIVATION_FACTOR,
            ("run.micro_batch", "model.embedding_dim", "model.dense_arch", "model.over_arch"),
        )
    )
    parts.append(
        Part(
            "eval activations",
            procs * run.eval_batch * per_row * FLOAT,
            ("run.eval_batch", "model.embedding_dim"),
        )
    )

    row_bytes = (1 + dense_in) * FLOAT + tables * INDEX
    cached = 2 * EVAL_CACHE_ROWS * row_bytes  # val and test
    data_fields: tuple[str, ...] = ("run.eval_rows",)
    if not isinstance(data, CriteoData):
        cached += data.cache_mb * (1 << 20) + 4 * data.chunk_rows * row_bytes
        data_fields = ("data.cache_mb", "data.chunk_rows")
    parts.append(Part("data in memory", procs * cached, data_fields))
    parts.append(Part("runtime", procs * RUNTIME_BYTES, ("run.nproc_per_node",)))
    return Estimate(tuple(parts))


def host_memory_bytes() -> int:
    """Physical memory of this host, or the cgroup limit of this process when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def check_fits(
    cfg: TrainConfig, memory_bytes: int | None = None, where: str = "this host"
) -> Estimate:
    """Refuse (:class:`ResourceError`) a job whose estimate exceeds ``memory_bytes`` (default:
    this host's memory). Jobs on GPUs hold their tables and activations in GPU memory, which
    this host cannot measure before launch: only CPU jobs are checked."""
    est = estimate(cfg)
    if cfg.run.device != "cpu":
        return est
    limit = host_memory_bytes() if memory_bytes is None else memory_bytes
    if est.total > limit:
        fields = est.fields()
        raise ResourceError(
            f"the job needs about {gib(est.total)} of memory per node ({est.describe()}), "
            f"more than the {gib(limit)} of {where}; make these fields smaller (or shard over "
            "more nodes)",
            fields,
        )
    logger.info("memory estimate %s per node (limit %s)", gib(est.total), gib(limit))
    return est


def check_study_fits(study: StudyConfig, memory_bytes: int | None = None) -> None:
    """:func:`check_fits` for every batch size and optimizer of a study (the seed and the LR do
    not change what a cell needs); the error names the study field behind the cell's."""
    for g in sorted(set(study.batch_sizes), reverse=True):
        for opt in study.optimizers:
            cell = study.cell_config(Cell(g, opt.name, 1.0, study.seeds[0]))
            try:
                check_fits(cell, memory_bytes)
            except ResourceError as err:
                fields = [_study_field(f) for f in err.fields]
                raise ResourceError(
                    f"study cell G={g} {opt.name}: {err.reason}", list(dict.fromkeys(fields))
                ) from None


def _study_field(field: str) -> str:
    """Where a cell's field comes from in the study config."""
    if field in ("run.global_batch", "run.micro_batch"):
        return "batch_sizes"
    if field.startswith("optim."):
        return "optimizers"
    return f"base.{field}"
