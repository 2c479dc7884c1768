"""A checkpoint of any number of ranks as whole tables, and whole tables as any rank's shards.

A rank's checkpoint state (:meth:`dlrm_vrgd.train.loop.Trainer.state_dict`) holds the dense
parameters and dense optimizer state (replicated: every rank holds the same), and, per FBGEMM
lookup, the tables or table *shards* it owns: a shard is labelled
``t_cat_3[rows R0+NR, cols C0+NC]`` (:func:`~dlrm_vrgd.train.distributed._shard_label`), a
whole table by its name. With each shard go its optimizer state (the Adagrad sum of squares:
one scalar per row of the shard for row-wise Adagrad, or one per weight element, ``nr x nc``,
for full Adagrad, ``optim.sparse.name: adagrad``) and, with the ``ema`` GSNR estimator, the
two per-row EMA scalars of the sparse optimizer (kept per lookup and row space; see
:class:`~dlrm_vrgd.optim.sparse.SparseRowwiseOptimizer`).

:func:`gather_checkpoint` reads every rank's file (sizes and SHA-256 checked) and reassembles
whole tables (:class:`FullTable`); :func:`rank_state` cuts them into the shards of a trainer on
any number of ranks and produces the state dict that trainer loads. Row-wise state moves with
its rows exactly. Where the *column* split of a table changes, the per-row scalars of each new
shard are combined from the old shards it overlaps (``o`` = columns in common):

* Adagrad sum (a mean over the shard's columns of ``g²``): ``s_new = Σ_old (o / NC_new)·s_old``
  — exact when shards are merged (a whole row's sum is the column-weighted mean of its slices'),
  an estimate when a row is split (each slice inherits the whole row's value);
* EMA scalars (sums over the shard's columns): ``e_new = Σ_old (o / NC_old)·e_old`` — exact
  when merged, split in proportion to the columns otherwise.

Element-wise Adagrad sums belong to their elements: they are cut and joined by rows and columns
exactly as the weights are, whatever the old and new splits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dlrm_vrgd import checkpoint as ckpt
from dlrm_vrgd.embedding.capture import LookupLayout

_LABEL = re.compile(r"^(?P<name>[^\[]+)\[rows (\d+)\+(\d+), cols (\d+)\+(\d+)\]$")


@dataclass(frozen=True)
class Shard:
    """Rows ``[r0, r0+nr)`` and columns ``[c0, c0+nc)`` of table ``name``."""

    name: str
    r0: int
    nr: int
    c0: int
    nc: int

    @staticmethod
    def parse(label: str, rows: int, cols: int) -> Shard:
        """The shard a lookup's table label names (a bare name: the whole ``rows x cols``)."""
        m = _LABEL.match(label)
        if m is None:
            return Shard(label, 0, rows, 0, cols)
        r0, nr, c0, nc = (int(g) for g in m.groups()[1:])
        if (nr, nc) != (rows, cols):
            raise ckpt.CheckpointError(
                f"shard {label}: holds a {rows} x {cols} tensor, its label says {nr} x {nc}"
            )
        return Shard(m.group("name"), r0, nr, c0, nc)


@dataclass
class ColumnSegment:
    """The per-row optimizer scalars of the columns ``[c0, c0+nc)`` of a whole table."""

    c0: int
    nc: int
    #: Adagrad sums: ``rows`` (row-wise), ``rows x nc`` (element-wise), None for SGD
    state: torch.Tensor | None
    ema: tuple[torch.Tensor, torch.Tensor] | None  # rows each, None without the EMA estimator


@dataclass
class FullTable:
    name: str
    weight: torch.Tensor  # rows x dim
    segments: list[ColumnSegment] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return int(self.weight.shape[0])

    @property
    def dim(self) -> int:
        return int(self.weight.shape[1])


@dataclass
class FullState:
    """A checkpoint independent of how many ranks wrote it."""

    step: int
    world_size: int
    config: dict[str, Any]
    tables: dict[str, FullTable]  # by table name, in the order of the model's tables
    rank0: dict[str, Any]  # rank 0's state: dense, dense_opt, sparse_opt param groups, rng, ...
    #: Each writing rank's CUDA generator (None where it ran on the CPU): a rank of the resumed
    #: run takes the one of the rank with its number (:func:`rank_state`).
    cuda_rng: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def dense(self) -> dict[str, torch.Tensor]:
        return self.rank0["dense"]


def _lookup_layout(tables: dict[str, Any]) -> LookupLayout:
    rows = [int(w.shape[0]) for w in tables["weights"]]
    dims = [int(w.shape[1]) for w in tables["weights"]]
    return LookupLayout.of(list(range(len(rows))), dims, rows)


def _ema_per_table(
    tables: dict[str, Any], spaces: list[tuple[torch.Tensor, torch.Tensor]] | None
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """A lookup's EMA state (per row space) cut into one ``(signal, second)`` pair per table."""
    n = len(tables["weights"])
    if not spaces:
        return [None] * n
    layout = _lookup_layout(tables)
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n
    for space, (sig, sec) in zip(layout.spaces, spaces, strict=True):
        for i, t in enumerate(space.tables):
            a, b = space.offsets[i], space.offsets[i + 1]
            out[t] = (sig[a:b], sec[a:b])
    return out


def gather_checkpoint(path: Path) -> FullState:
    """Read and verify every rank's state of checkpoint directory ``path``; whole tables."""
    path = Path(path)
    manifest = ckpt.read_manifest(path)
    world = int(manifest["world_size"])
    states = [ckpt.load_rank_state(path, r) for r in range(world)]
    pieces: dict[str, list[tuple[Shard, torch.Tensor, torch.Tensor | None, Any]]] = {}
    order: list[str] = []
    for rank, state in enumerate(states):
        ema = state["sparse_opt"].get("ema") or []
        for li, tables in enumerate(state["tables"]):
            per_table_ema = _ema_per_table(tables, ema[li] if li < len(ema) else None)
            parts = zip(
                tables["names"], tables["weights"], tables["states"], per_table_ema, strict=True
            )
            for label, w, s, e in parts:
                shard = Shard.parse(label, int(w.shape[0]), int(w.shape[1]))
                if shard.name not in pieces:
                    pieces[shard.name] = []
                    order.append(shard.name)
                state_rows = s if s.numel() else None
                if state_rows is not None and tuple(state_rows.shape) not in (
                    (shard.nr,),
                    (shard.nr, shard.nc),
                ):
                    raise ckpt.CheckpointError(
                        f"{path}: rank {rank}, {label}: optimizer state of shape "
                        f"{tuple(state_rows.shape)} for a {shard.nr} x {shard.nc} shard (one sum "
                        "per row or one per element)"
                    )
                pieces[shard.name].append((shard, w, state_rows, e))
    tables = {name: _assemble(name, pieces[name], path) for name in _model_order(order)}
    cuda = [st["rng"].get("cuda") for st in states]
    return FullState(int(manifest["step"]), world, manifest["config"], tables, states[0], cuda)


def _model_order(names: list[str]) -> list[str]:
    """Table names in feature order (``t_cat_0, t_cat_1, ...``), whatever rank owned them."""

    def key(name: str) -> tuple[int, str]:
        m = re.search(r"(\d+)$", name)
        return (int(m.group(1)) if m else -1, name)

    return sorted(names, key=key)


def _assemble(
    name: str, parts: list[tuple[Shard, torch.Tensor, torch.Tensor | None, Any]], path: Path
) -> FullTable:
    rows = max(s.r0 + s.nr for s, *_ in parts)
    dim = max(s.c0 + s.nc for s, *_ in parts)
    weight = torch.empty(rows, dim)
    covered = torch.zeros(rows, dim, dtype=torch.int32)
    columns: dict[tuple[int, int], list[tuple[Shard, torch.Tensor | None, Any]]] = {}
    for shard, w, s, e in parts:
        weight[shard.r0 : shard.r0 + shard.nr, shard.c0 : shard.c0 + shard.nc] = w
        covered[shard.r0 : shard.r0 + shard.nr, shard.c0 : shard.c0 + shard.nc] += 1
        columns.setdefault((shard.c0, shard.nc), []).append((shard, s, e))
    if not bool((covered == 1).all()):
        raise ckpt.CheckpointError(
            f"{path}: the shards of table {name} do not cover its {rows} x {dim} weights exactly "
            "once (a rank's file is missing or the checkpoint mixes two plans)"
        )
    segments = []
    shapes = {s.dim() for *_, s, _ in parts if s is not None}
    if len(shapes) > 1:
        raise ckpt.CheckpointError(
            f"{path}: table {name} has row-wise and element-wise optimizer state in its shards"
        )
    for (c0, nc), items in sorted(columns.items()):
        has_state = all(s is not None for _, s, _ in items)
        has_ema = all(e is not None for _, _, e in items)
        state = None
        if has_state:
            state = torch.zeros(rows, nc) if shapes == {2} else torch.zeros(rows)
        ema = (torch.zeros(rows), torch.zeros(rows)) if has_ema else None
        for shard, s, e in items:
            sl = slice(shard.r0, shard.r0 + shard.nr)
            if state is not None:
                state[sl] = s
            if ema is not None:
                ema[0][sl], ema[1][sl] = e[0], e[1]
        segments.append(ColumnSegment(c0, nc, state, ema))
    return FullTable(name, weight, segments)


# ------------------------------------------------------------------------ back into shards
def _overlap(a0: int, an: int, b0: int, bn: int) -> int:
    return max(0, min(a0 + an, b0 + bn) - max(a0, b0))


def shard_scalars(table: FullTable, shard: Shard) -> tuple[torch.Tensor | None, Any]:
    """The Adagrad sums (``nr``, or ``nr x nc`` element-wise) and EMA pairs of the rows and
    columns of ``shard`` (module docstring)."""
    rows = slice(shard.r0, shard.r0 + shard.nr)
    state: torch.Tensor | None = None
    ema: tuple[torch.Tensor, torch.Tensor] | None = None
    for seg in table.segments:
        o = _overlap(seg.c0, seg.nc, shard.c0, shard.nc)
        if o == 0:
            continue
        if seg.state is not None and seg.state.dim() == 2:  # element-wise: the columns in common
            if state is None:
                state = torch.zeros(shard.nr, shard.nc)
            c0 = max(seg.c0, shard.c0)
            state[:, c0 - shard.c0 : c0 - shard.c0 + o] = seg.state[
                rows, c0 - seg.c0 : c0 - seg.c0 + o
            ]
        elif seg.state is not None:
            part = seg.state[rows] * (o / shard.nc)
            state = part if state is None else state + part
        if seg.ema is not None:
            f = o / seg.nc
            sig, sec = seg.ema[0][rows] * f, seg.ema[1][rows] * f
            ema = (sig, sec) if ema is None else (ema[0] + sig, ema[1] + sec)
    return state, ema


def rank_state(
    full: FullState, lookups: list[Any], with_ema: bool, rank: int = 0
) -> dict[str, Any]:
    """The state dict (:meth:`Trainer.load_state_dict`'s) of rank ``rank``, whose row-wise
    lookups are ``lookups`` (their ``table_names`` are shard labels), cut from ``full``. Its CPU
    generator is rank 0's (every rank seeds it alike); its CUDA generator is the one of the
    writing rank with its number, if that rank ran on a GPU (a rank the old run did not have
    keeps the run's seed: a resharded run is not bit for bit the old one anyway)."""
    state = dict(full.rank0)
    state["rng"] = {"torch": full.rank0["rng"]["torch"]}
    if rank < len(full.cuda_rng) and full.cuda_rng[rank] is not None:
        state["rng"]["cuda"] = full.cuda_rng[rank]
    state.pop("noise_scale", None)  # its table EMAs are per rank: they start again
    tables_out = []
    ema_out = []
    for lk in lookups:
        names, weights, states = [], [], []
        shapes = [tuple(w.shape) for w in lk.table_weights()]
        per_table_ema = []
        for label, (r, c) in zip(lk.table_names, shapes, strict=True):
            shard = Shard.parse(label, r, c)
            table = full.tables.get(shard.name)
            if table is None:
                raise ckpt.CheckpointError(f"the checkpoint has no table {shard.name}")
            if shard.r0 + shard.nr > table.rows or shard.c0 + shard.nc > table.dim:
                raise ckpt.CheckpointError(
                    f"{label}: outside the checkpoint's {table.rows} x {table.dim} table"
                )
            names.append(label)
            weights.append(
                table.weight[shard.r0 : shard.r0 + shard.nr, shard.c0 : shard.c0 + shard.nc]
            )
            s, e = shard_scalars(table, shard)
            states.append(s if s is not None else torch.zeros(0))
            per_table_ema.append(e)
        tables_out.append({"names": names, "weights": weights, "states": states})
        if with_ema:
            layout = _lookup_layout({"weights": weights})
            spaces = []
            for space in layout.spaces:
                parts = [per_table_ema[t] for t in space.tables]
                if any(p is None for p in parts):
                    raise ckpt.CheckpointError("the checkpoint has no EMA state to resume from")
                spaces.append(
                    (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))  # type: ignore[index]
                )
            ema_out.append(spaces)
    state["tables"] = tables_out
    sparse_opt = dict(state["sparse_opt"])
    sparse_opt["ema"] = ema_out
    state["sparse_opt"] = sparse_opt
    return state
