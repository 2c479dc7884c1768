"""What a job needs in memory, estimated from its config before anything is launched.

:func:`estimate` adds up, per node, the parts that grow with the config: the embedding tables
(weights and row-wise optimizer state), the step's row accumulator, the dense layers with their
gradients and optimizer state, the activations of one micro-batch and of one eval batch, the
cached data, and a fixed runtime allowance (Python, torch, torchrec). Each part names the config
fields that drive it. :func:`check_fits` refuses a job whose estimate exceeds the memory of
the machine that would hold it (:class:`ResourceError`, a :class:`ConfigError` naming the
fields of the parts that dominate), so that a job too big for the host is a clear error at
submission, not an out-of-memory kill an hour in.

With several ranks (or on a GPU) :func:`memory_plan` then places the tables' weights and
optimizer state on the ranks the way ``run.sharding`` would (a model of torchrec's planner, not
its own answer: see :func:`memory_plan`) and adds what every rank holds in full (dense layers,
activations, the runtime); :func:`check_fits` refuses a plan whose largest rank exceeds the
memory of one rank (a GPU's, or the host's divided by its ranks), naming that rank, its
numbers and the fields that change it.

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
#: Optimizer state of the embedding tables by FBGEMM kernel (``SparseOptimConfig.kernel``):
#: (float32 values per row, float32 values per weight). Row-wise Adagrad keeps one sum per row,
#: full (element-wise) Adagrad one per weight.
SPARSE_STATE: dict[str, tuple[int, int]] = {
    "rowwise_adagrad": (1, 0), "sgd": (0, 0), "adagrad": (0, 1),
}  # fmt: skip
#: Memory of one GPU (``run.device: cuda``) when the caller does not say: an 80 GB card's.
DEVICE_MEMORY_BYTES = 80 * GIB
#: torchrec's narrowest column-wise shard (``torchrec.distributed.planner.constants.MIN_CW_DIM``).
MIN_CW_DIM = 128
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


def _row_bytes(cfg: TrainConfig, cols: int) -> tuple[int, int]:
    """Bytes of one table row of ``cols`` columns: (weights, optimizer state, with the ``ema``
    estimator's two floats)."""
    sparse = cfg.optim.sparse
    per_row, per_weight = SPARSE_STATE[sparse.kernel]
    per_row += 2 if sparse.estimator == "ema" and sparse.gsnr else 0
    weight = 2 if cfg.model.embedding_precision == "fp16" else FLOAT
    return cols * weight, (per_row + per_weight * cols) * FLOAT


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
        per_row = sum(_row_bytes(cfg, dim))  # weights and optimizer state
        # tables are sharded over the nodes: a node holds its share (at least the largest table)
        share = max(sum(rows) / run.nnodes, max(rows))
        parts.append(Part("embedding tables", int(share * per_row), table_fields))

    # the rows one rank's share of the global batch touches (each id of a multi-hot bag),
    # accumulated until the step
    bags = getattr(data, "multi_hot_sizes", None)
    touched = run.global_batch // run.world_size * (sum(bags) if bags else tables)
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


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds: table weights, their optimizer state, the rest (replicated on every
    rank: dense layers and their state, activations, the runtime), and which table shards."""

    rank: int
    tables: int
    state: int
    rest: int
    shards: tuple[str, ...]

    @property
    def total(self) -> int:
        return self.tables + self.state + self.rest

    def describe(self) -> str:
        return (
            f"rank {self.rank}: {gib(self.total)} (tables {gib(self.tables)}, state "
            f"{gib(self.state)}, the rest {gib(self.rest)})"
        )


@dataclass(frozen=True)
class MemoryPlan:
    """Memory of every rank of a job under one sharding type, against the memory of a rank."""

    sharding: str
    ranks: tuple[RankMemory, ...]
    limit: int
    #: What ``limit`` is, in words ("a GPU", "the host's ... over 2 ranks").
    where: str
    estimate: Estimate

    def largest(self) -> RankMemory:
        return max(self.ranks, key=lambda r: (r.total, -r.rank))

    @property
    def fits(self) -> bool:
        return self.largest().total <= self.limit

    def lines(self) -> list[str]:
        """One line per rank, then what a rank may hold (for people, before launch)."""
        head = (
            f"memory plan: {len(self.ranks)} rank(s), {self.sharding} (a model of torchrec's "
            f"planner), at most {gib(self.limit)} a rank ({self.where})"
        )
        return [head] + [f"  {r.describe()}" for r in self.ranks]


def _shards(cfg: TrainConfig, rows: list[int], sharding: str, world: int) -> list[tuple]:
    """The shards torchrec cuts for ``sharding``: (name, rows, cols, rank or None to place)."""
    dim = cfg.model.embedding_dim
    out: list[tuple] = []
    for t, n in enumerate(rows):
        if world == 1:
            out.append((f"table {t} ({n:,} rows)", n, dim, 0))
        elif sharding == "row_wise":  # ceil(rows / W) on the first ranks, the rest on the last
            block = -(-n // world)
            out += [
                (f"table {t} rows {k * block:,}+", max(0, min(block, n - k * block)), dim, k)
                for k in range(world)
            ]
        elif sharding in ("column_wise", "table_column_wise"):
            # torchrec: blocks of the smallest divisor of D >= 128 that is a multiple of 4 (D
            # itself when none): a 128-wide table is one shard
            block = next((c for c in range(MIN_CW_DIM, dim) if dim % c == 0 and c % 4 == 0), dim)
            name = f"table {t} ({n:,} rows)"
            out += [(f"{name} columns {k * block}+", n, block, None) for k in range(dim // block)]
        else:  # table_wise
            out.append((f"table {t} ({n:,} rows)", n, dim, None))
    return out


def _plan_one(cfg: TrainConfig, rows: list[int], sharding: str, limit: int, where: str,
              rest: int, est: Estimate) -> MemoryPlan:  # fmt: skip
    world = cfg.run.world_size
    weights, state = [0] * world, [0] * world
    names: list[list[str]] = [[] for _ in range(world)]
    shards = _shards(cfg, rows, sharding, world)
    # largest first onto the least-loaded rank (the lowest of equals)
    for name, n, cols, rank in sorted(shards, key=lambda s: -s[1] * s[2]):
        if rank is None:
            rank = min(range(world), key=lambda r: (weights[r] + state[r], r))
        w, st = _row_bytes(cfg, cols)
        weights[rank] += n * w
        state[rank] += n * st
        names[rank].append(name)
    ranks = tuple(RankMemory(r, weights[r], state[r], rest, tuple(names[r])) for r in range(world))
    return MemoryPlan(sharding, ranks, limit, where, est)


def memory_plan(
    cfg: TrainConfig,
    memory_bytes: int | None = None,
    device_memory_bytes: int | None = None,
    est: Estimate | None = None,
) -> MemoryPlan | None:
    """Every rank's memory for ``cfg.run.sharding`` over W = nnodes x nproc_per_node ranks (None
    when the tables' sizes are unknown).

    A model of torchrec's planner, not its answer: ``table_wise`` puts whole tables, largest
    first, onto the least-loaded rank; ``column_wise`` (and ``table_column_wise``) cut each
    table as torchrec does (blocks of the smallest divisor of D that is >= 128 and a multiple of
    4, the whole D when none: D = 128 is one block) and place the blocks the same way;
    ``row_wise`` gives every rank ceil(rows / W) rows of every table. With several types
    allowed, the plan with the smallest largest rank is shown (row_wise only on a GPU). Every
    rank also holds the rest of :func:`estimate` in full (its parts per process; the cached data
    stays on the host with ``run.device: cuda``).

    A rank may hold ``device_memory_bytes`` on a GPU (default :data:`DEVICE_MEMORY_BYTES`), or
    ``memory_bytes`` (default: this host's) divided by ``nproc_per_node`` on a CPU."""
    rows = table_rows(cfg)
    if rows is None:
        return None
    run = cfg.run
    est = est or estimate(cfg)
    gpu = run.device == "cuda"
    host = [p for p in est.parts if p.name == "data in memory"] if gpu else []
    rest = sum(p.bytes for p in est.parts if p.name != "embedding tables" and p not in host)
    rest //= run.nproc_per_node
    if gpu:
        limit = DEVICE_MEMORY_BYTES if device_memory_bytes is None else device_memory_bytes
        where = "the memory of a GPU"
    else:
        node = host_memory_bytes() if memory_bytes is None else memory_bytes
        limit = node // run.nproc_per_node
        where = f"{gib(node)} of host memory over {run.nproc_per_node} rank(s)"
    allowed = [s for s in run.sharding if gpu or s != "row_wise"] or list(run.sharding)
    plans = [_plan_one(cfg, rows, s, limit, where, rest, est) for s in allowed]
    return min(plans, key=lambda p: p.largest().total)


def _plan_fields(cfg: TrainConfig, plan: MemoryPlan) -> list[str]:
    """The fields that change the largest rank: the sharding and the world size, then what sizes
    the tables, then the drivers of the rest when the rest outweighs the tables."""
    tables = "data.max_rows_per_table" if isinstance(cfg.data, CriteoData) else "data.cardinalities"
    fields = ["run.sharding", "run.nproc_per_node", "run.nnodes", tables, "model.embedding_dim"]
    big = plan.largest()
    if big.rest > big.tables + big.state:
        rest = Estimate(tuple(p for p in plan.estimate.parts if p.name != "embedding tables"))
        fields += [f for f in rest.fields() if f not in fields]
    return fields


def check_fits(
    cfg: TrainConfig,
    memory_bytes: int | None = None,
    where: str = "this host",
    device_memory_bytes: int | None = None,
) -> MemoryPlan | None:
    """Refuse (:class:`ResourceError`) a job whose estimate exceeds ``memory_bytes`` (default:
    this host's memory; checked for CPU jobs only), or whose :func:`memory_plan` has a rank
    holding more than a rank may (a GPU's ``device_memory_bytes``, or the node's memory over
    its ranks). Returns the plan (None when the tables' sizes are unknown)."""
    est = estimate(cfg)
    if cfg.run.device == "cpu":
        limit = host_memory_bytes() if memory_bytes is None else memory_bytes
        if est.total > limit:
            fields = est.fields()
            raise ResourceError(
                f"the job needs about {gib(est.total)} of memory per node ({est.describe()}), "
                f"more than the {gib(limit)} of {where}; make these fields smaller (or shard "
                "over more nodes)",
                fields,
            )
        logger.info("memory estimate %s per node (limit %s)", gib(est.total), gib(limit))
        memory_bytes = limit
    plan = memory_plan(cfg, memory_bytes, device_memory_bytes, est)
    if plan is None:
        return None
    for line in plan.lines():
        logger.info("%s", line)
    if not plan.fits:
        big = plan.largest()
        world = len(plan.ranks)
        shards = ", ".join(big.shards[:4]) + (", ..." if len(big.shards) > 4 else "")
        raise ResourceError(
            f"rank {big.rank} of {world} needs about {gib(big.total)} (tables {gib(big.tables)}, "
            f"state {gib(big.state)}, the rest {gib(big.rest)}), more than the "
            f"{gib(plan.limit)} a rank may use ({plan.where}); its table shards: {shards} "
            f"({plan.sharding} over {world} rank(s), a model of torchrec's planner); shard "
            "differently or over more ranks, or make the tables smaller",
            _plan_fields(cfg, plan),
        )
    return plan


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
