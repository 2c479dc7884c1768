"""A study's ledger: what every finished cell measured, in one small file that is committed.

A cell's run directory (``cells/<id>/``: checkpoints, curves, TensorBoard) is large and stays
out of git, so a study resumed in a fresh checkout would find none of its finished cells and
train them all again (round three lost 62 cells that way). The ledger, ``OUT/cells.jsonl``,
keeps for each finished cell the figures the report reads from its run directory
(:func:`cell_figures`) and the SHA-256 of the config it trained. A cell counts as finished when
its run directory holds ``result.json`` (its ``config.json`` must be the config the study gives
it now) or when the ledger holds it under the digest of that config; either way it is never
rerun. The ledger is rewritten whole (to a temporary file, then renamed) after each cell, so a
process killed at any moment leaves it holding every cell finished before. ``cost_s`` beside a
cell's figures is what the cell cost in its study process: :mod:`dlrm_vrgd.study.budget`
estimates the next cells' cost from it, across allocations.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dlrm_vrgd.advice import finite
from dlrm_vrgd.config import strip_marked
from dlrm_vrgd.rundir import CONFIG, RESULT, atomic_write_bytes, read_jsonl
from dlrm_vrgd.study.config import Cell, StudyConfig

LEDGER = "cells.jsonl"


def _untracked(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` less what does not change what a cell trains (:func:`strip_marked`): the
    fields marked OPERATIONAL (tracking, the input pipeline, the heap's hand-back: a finished
    cell is reused whatever they were), and those marked ADDED_LATER while they hold their
    default (every cell recorded before the field existed trained at it; a cell at another value
    is another cell), at every depth (``optim.dense.initial_accumulator_value``, ``data.split``)."""
    return strip_marked(config)


def cell_config(study: StudyConfig, cell: Cell) -> dict[str, Any]:
    """The config the study gives ``cell``, as JSON would give it back, less its tracking."""
    return _untracked(json.loads(json.dumps(study.cell_config(cell).to_dict())))


def config_digest(config: dict[str, Any]) -> str:
    """SHA-256 of a cell config, its tracking keys left out, in canonical JSON."""
    canonical = json.dumps(_untracked(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_finished_cell(study: StudyConfig, cell: Cell, run_dir: Path) -> None:
    """A finished cell is reused only if it trained exactly the config the study asks of it."""
    stored = json.loads((run_dir / CONFIG).read_text())
    if _untracked(stored) != cell_config(study, cell):
        raise ValueError(
            f"{run_dir / CONFIG} differs from the config this study gives cell {cell.id}: "
            "use another output directory"
        )


def cell_figures(study: StudyConfig, cell: Cell, run_dir: Path) -> dict[str, Any]:
    """What one finished cell measured (``rows_to_target`` is filled in by the report)."""
    result = json.loads((run_dir / RESULT).read_text())
    records = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r for r in records if r.get("kind") == "eval" and r.get("split") == "val"]
    (dense_ratio, dense_clip, table_ratio, table_clip, cowclip), curve, noise = _gsnr_figures(
        run_dir / "gsnr.jsonl"
    )
    late = (result.get("noise_scale") or {}).get("scopes", {}).get("model") or {}
    cfg = result["config"]
    return {
        "cell": cell.id,
        "global_batch": cell.global_batch,
        "optimizer": cell.optimizer,
        "lr_multiplier": cell.lr_multiplier,
        "seed": cell.seed,
        # k: micro-batches (gradient groups) per step, on the groups axis or not
        "groups": cell.groups or cell.global_batch // cfg["run"]["micro_batch"],
        "dense_lr": cfg["optim"]["dense"]["lr"],
        "sparse_lr": cfg["optim"]["sparse"]["lr"],
        "steps": result["steps"],
        "rows": result["samples"],
        "val_auc": result["val"]["auc"],
        "test_auc": result["test"]["auc"],
        "oracle_test_auc": result["test"].get("oracle_auc"),
        "oracle_val_auc": result["val"].get("oracle_auc"),
        "train_auc": (result.get("train") or {}).get("auc"),
        "wall_s": result["timings"]["train_seconds"],
        "rows_to_target": None,
        "steps_to_target": None,
        "gsnr_dense": dense_ratio,
        "gsnr_dense_clipped": dense_clip,
        "gsnr_tables": table_ratio,
        "gsnr_tables_clipped": table_clip,
        # CowClip cells: the fraction of touched rows whose gradient the clip shrank, mean over
        # the recorded steps
        "cowclip_clipped": cowclip,
        "val_curve": [(r["samples"], r["auc"], r["step"]) for r in evals],
        # [fraction of training, dense ratio, table ratio] (the plots read it)
        "gsnr_curve": curve,
        # the gradient noise scale (DESIGN.md 4.6): the model's B_simple over the last half of
        # training (the window's ratio of means, `dlrm-vrgd advise`'s headline), the 10th and
        # 90th percentiles of its smoothed per-step series there (its drift), and its curve
        "b_simple": late.get("b_simple"),
        "b_simple_p10": (late.get("smoothed") or {}).get("p10"),
        "b_simple_p90": (late.get("smoothed") or {}).get("p90"),
        "b_simple_curve": noise,
    }


#: At most this many points of a cell's GSNR curve are kept (evenly spaced, the last included).
CURVE_POINTS = 50


def _weighted(rec: dict[str, Any]) -> tuple[float | None, ...]:
    """One gsnr.jsonl record's element-weighted dense ratio and fraction clipped, its
    touched-row-weighted table ratio and fraction clipped, and the touched-row-weighted fraction
    of rows CowClip clipped (None where not measured)."""
    dense_r = dense_c = table_r = table_c = cow = None
    measured = [d for d in rec.get("dense", []) if d.get("raw_gsnr") is not None]
    n = sum(d["numel"] for d in measured)
    if n:
        dense_r = sum(d["ratio"] * d["numel"] for d in measured) / n
        dense_c = sum(d["frac_clipped"] * d["numel"] for d in measured) / n
    tables = [t for t in rec.get("tables", []) if t.get("ratio") is not None]
    n = sum(t["touched_rows"] for t in tables)
    if n:
        table_r = sum(t["ratio"] * t["touched_rows"] for t in tables) / n
        table_c = sum(t["frac_clipped"] * t["touched_rows"] for t in tables) / n
    clipped = [t for t in rec.get("tables", []) if t.get("cowclip_clipped") is not None]
    n = sum(t["touched_rows"] for t in clipped)
    if n:
        cow = sum(t["cowclip_clipped"] * t["touched_rows"] for t in clipped) / n
    return dense_r, dense_c, table_r, table_c, cow


def _thin(curve: list[list[Any]]) -> list[list[Any]]:
    """At most :data:`CURVE_POINTS` points of a curve, evenly spaced, its last one kept."""
    if len(curve) <= CURVE_POINTS:
        return curve
    every = -(-len(curve) // CURVE_POINTS)
    return curve[-1::-every][::-1]


def _b_simple(rec: dict[str, Any]) -> float | None:
    """A gsnr.jsonl record's smoothed B_simple for the whole model (None without one)."""
    return finite(((rec.get("noise_scale") or {}).get("model") or {}).get("b_simple"))


def _gsnr_figures(
    path: Path,
) -> tuple[list[float | None], list[list[float | None]], list[list[float]]]:
    """The means over steps of :func:`_weighted`'s five figures; the curve of the two ratios
    against the fraction of training done; and the curve of the model's smoothed B_simple
    (gradient noise scale) against it (each at most :data:`CURVE_POINTS` points)."""
    records = read_jsonl(path)
    per_step = [(rec["step"], _weighted(rec)) for rec in records]
    means: list[float | None] = []
    for i in range(5):
        xs = [w[i] for _, w in per_step if w[i] is not None]
        means.append(sum(xs) / len(xs) if xs else None)
    last = records[-1]["step"] if records else 1
    curve = [[round(step / last, 3), w[0], w[2]] for step, w in per_step]
    if all(d is None and t is None for _, d, t in curve):  # not a VR cell: nothing to plot
        curve = []
    noise = [[round(r["step"] / last, 3), b] for r in records if (b := _b_simple(r)) is not None]
    return means, _thin(curve), _thin(noise)


#: Figures a ledger record must hold, as finite numbers, to be used.
_REQUIRED = ("val_auc", "test_auc")
#: Figures that, when present, are a finite number or null.
_NUMBERS = (
    "dense_lr", "sparse_lr", "steps", "rows", "oracle_test_auc", "oracle_val_auc", "train_auc",
    "wall_s", "gsnr_dense", "gsnr_dense_clipped", "gsnr_tables", "gsnr_tables_clipped",
    "b_simple", "b_simple_p10", "b_simple_p90", "groups", "cowclip_clipped",
)  # fmt: skip
#: Curves and the length of their points: lists of points, each a list of finite numbers or
#: nulls.
_CURVES = {"val_curve": 3, "gsnr_curve": 3, "b_simple_curve": 2}


def cell_identity(cell: Cell) -> dict[str, Any]:
    """The figures that say which cell this is, from the study (k only where the cell sets it:
    otherwise it comes from the micro-batch rule, and the record's figure stands)."""
    ident = {
        "cell": cell.id,
        "global_batch": cell.global_batch,
        "optimizer": cell.optimizer,
        "lr_multiplier": cell.lr_multiplier,
        "seed": cell.seed,
    }
    if cell.groups is not None:
        ident["groups"] = cell.groups
    return ident


def _number(value: Any) -> bool:
    return finite(value) is not None


class Ledger:
    """The finished cells of the study in ``out``: from their run directories, else from
    ``cells.jsonl``. ``figures(cell)`` is None for a cell that has not finished."""

    def __init__(self, study: StudyConfig, out: Path):
        self.study = study
        self.out = Path(out)
        self.path = self.out / LEDGER
        self._records: dict[str, dict[str, Any]] = {}
        self._figures: dict[str, dict[str, Any]] = {}
        for n, rec in enumerate(read_jsonl(self.path), start=1):
            self._records[_valid(rec, f"{self.path}:{n}")] = rec

    def __len__(self) -> int:
        return len(self._records)

    def figures(self, cell: Cell) -> dict[str, Any] | None:
        """The cell's figures if it has finished; raises ValueError where what is stored for it
        trained another config than the study gives it now."""
        if cell.id in self._figures:
            return self._figures[cell.id]
        run_dir = self.out / "cells" / cell.id
        if (run_dir / RESULT).exists():
            check_finished_cell(self.study, cell, run_dir)
            figures = cell_figures(self.study, cell, run_dir)
        elif cell.id in self._records:
            rec = self._records[cell.id]
            if rec["config_sha256"] != config_digest(cell_config(self.study, cell)):
                raise ValueError(
                    f"{self.path}: cell {cell.id} trained another config than this study gives "
                    "it (config_sha256 differs): use another output directory"
                )
            # what the cell is comes from the study, never from the file
            figures = {**rec["figures"], **cell_identity(cell)}
        else:
            return None
        self._figures[cell.id] = figures
        return figures

    def val_auc(self, cell: Cell) -> float | None:
        """The cell's validation AUC, None while it has not finished."""
        figures = self.figures(cell)
        return None if figures is None else figures["val_auc"]

    def records(self) -> dict[str, dict[str, Any]]:
        """The ledger's records by cell id, as read and as recorded since (checked in shape)."""
        return dict(self._records)

    def cost_s(self, cell_id: str) -> float | None:
        """What the cell cost in its study process (seconds, start to ledger), where recorded."""
        rec = self._records.get(cell_id)
        return None if rec is None else finite(rec.get("cost_s"))

    def record(self, cell: Cell, cost_s: float | None = None) -> None:
        """Put a cell whose run directory has just finished (or is missing from the ledger)
        into ``cells.jsonl``, rewritten whole; ``cost_s`` (the cell's wall time in the study's
        process) estimates the next cells' (:mod:`dlrm_vrgd.study.budget`). A cost already
        recorded is kept where none is given."""
        figures = self.figures(cell)
        if figures is None:
            raise ValueError(f"cell {cell.id} has not finished")
        digest = config_digest(cell_config(self.study, cell))
        rec: dict[str, Any] = {"cell": cell.id, "config_sha256": digest, "figures": figures}
        cost = self.cost_s(cell.id) if cost_s is None else round(cost_s, 2)
        if cost is not None:
            rec["cost_s"] = cost
        if self._records.get(cell.id) == json.loads(json.dumps(rec)):
            return
        self._records[cell.id] = rec
        lines = [json.dumps(r, separators=(",", ":")) for r in self._records.values()]
        atomic_write_bytes(self.path, ("\n".join(lines) + "\n").encode())


def _valid(rec: dict[str, Any], where: str) -> str:
    """A ledger record's cell id, once its shape is checked (it is read, never trusted)."""
    cell, digest, figures = rec.get("cell"), rec.get("config_sha256"), rec.get("figures")
    if not isinstance(cell, str) or not cell:
        raise ValueError(f"{where}: 'cell' must be a cell id")
    if not isinstance(digest, str) or len(digest) != 64:
        raise ValueError(f"{where}: 'config_sha256' must be 64 hex digits")
    if not isinstance(figures, dict):
        raise ValueError(f"{where}: 'figures' must be an object")
    cost = rec.get("cost_s")
    if cost is not None and not (_number(cost) and cost >= 0):
        raise ValueError(f"{where}: 'cost_s' must be a finite number >= 0 or absent")
    for key in _REQUIRED:
        if not _number(figures.get(key)):
            raise ValueError(f"{where}: figures.{key} must be a finite number")
    for key in _NUMBERS:
        if figures.get(key) is not None and not _number(figures[key]):
            raise ValueError(f"{where}: figures.{key} must be a finite number or null")
    for key, size in _CURVES.items():
        curve = figures.get(key)
        if curve is None:
            continue
        if not isinstance(curve, list) or not all(
            isinstance(p, list) and len(p) == size and all(v is None or _number(v) for v in p)
            for p in curve
        ):
            raise ValueError(f"{where}: figures.{key} must be a list of points of {size} numbers")
    return cell
