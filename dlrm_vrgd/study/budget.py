"""A study in short allocations: a time budget, a cell's cost estimated from the cells done so
far, and the few result files an allocation brings back.

GPU time comes in commands of a few minutes (one command of at most 10 minutes, at most 8 result
files of at most 16 MiB brought back). ``dlrm-vrgd study --budget-s N`` therefore runs cells
back to back in one process and, before each, asks :meth:`Budget.fits` whether the cell's
estimated cost still fits in what is left of ``N`` after :attr:`Budget.reserve_s` (the time the
report and the bundle take at the end); the first cell that would not fit is not started and the
study stops cleanly. A cell's cost is estimated by :func:`estimate` from the costs of finished
cells (this process's and those the ledger recorded in earlier allocations). With nothing to
estimate from, a cell is started while the budget is not spent: its cost is unknown, and the
next allocation will know it.

The bundle (``--bundle DIR``) is what an allocation brings back: the ledger (every finished
cell's figures and curves), the study config, the picks, the progress log, the reports and
``allocation.json`` (what this command did) — :data:`BUNDLE_FILES`, each refreshed after every
finished cell so that an allocation cut short still brings back every cell it finished.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlrm_vrgd.procfs import start_time
from dlrm_vrgd.rundir import atomic_write_bytes, atomic_write_json
from dlrm_vrgd.study.config import Cell, StudyConfig

logger = logging.getLogger(__name__)

#: What an allocation brings back (at most 8 files of at most 16 MiB each).
BUNDLE_FILES = (
    "cells.jsonl",
    "study.json",
    "picks.json",
    "metrics.jsonl",
    "results.md",
    "results.json",
    "allocation.json",
)
#: Most result files an allocation brings back, and the largest each may be.
MAX_BUNDLE_FILES = 8
MAX_BUNDLE_FILE_BYTES = 16 * 2**20
#: An estimate is the median cost of the matching finished cells times this margin.
SAFETY = 1.2


class BudgetSpent(Exception):
    """The next cell would not fit in what is left of the budget (not an error)."""

    def __init__(self, cell: Cell, estimate_s: float | None, left_s: float) -> None:
        super().__init__(
            f"cell {cell.id} (estimated {estimate_s if estimate_s is None else round(estimate_s)}"
            f" s) does not fit in the {left_s:.0f} s left"
        )
        self.cell = cell
        self.estimate_s = estimate_s
        self.left_s = left_s


#: What a cell's cost depends on: (global batch, optimizer, k micro-batches per step).
CostKey = tuple[int, str, int]


def cost_key(study: StudyConfig, cell: Cell) -> CostKey:
    g = cell.global_batch
    return (g, cell.optimizer, g // study.micro_batch(g, cell.groups))


@dataclass
class Budget:
    """``seconds`` of wall time from ``start`` (the clock's reading when made, unless given),
    of which ``reserve_s`` is kept for the report and the bundle at the end."""

    seconds: float
    reserve_s: float = 20.0
    clock: Callable[[], float] = time.monotonic
    start: float | None = None
    #: (cost key, seconds) of the cells finished so far, this process's and the ledger's.
    history: list[tuple[CostKey, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"budget: seconds must be > 0, got {self.seconds}")
        if not 0 <= self.reserve_s < self.seconds:
            raise ValueError(
                f"budget: reserve_s must be in [0, seconds), got {self.reserve_s} of {self.seconds}"
            )
        if self.start is None:
            self.start = self.clock()

    def elapsed(self) -> float:
        assert self.start is not None
        return self.clock() - self.start

    def left(self) -> float:
        """Seconds left for cells: the budget less the time spent and the reserve."""
        return self.seconds - self.reserve_s - self.elapsed()

    def check(self, cell: Cell, key: CostKey) -> float | None:
        """The cell's estimate if it fits in what is left; raises :class:`BudgetSpent` if not."""
        est = estimate(key, self.history)
        left = self.left()
        if left <= 0 or (est is not None and est > left):
            raise BudgetSpent(cell, est, left)
        return est


def estimate(key: CostKey, history: Iterable[tuple[CostKey, float]]) -> float | None:
    """A cell's cost from finished cells' costs: :data:`SAFETY` x the median over the most
    alike level that has any — the same (batch, optimizer, k); the same batch and k (the same
    steps and micro-batches: only the optimizer's step differs); the same batch; any cell. None
    with no history. The learning rate and the seed change none of a cell's cost."""
    done = list(history)
    g, _, k = key
    levels: list[Callable[[CostKey], bool]] = [
        lambda c: c == key,
        lambda c: (c[0], c[2]) == (g, k),
        lambda c: c[0] == g,
        lambda c: True,
    ]
    for alike in levels:
        costs = [s for c, s in done if alike(c)]
        if costs:
            return SAFETY * statistics.median(costs)
    return None


def process_age_s() -> float:
    """Seconds since this process started (its interpreter start and imports count against a
    budget too): ``/proc/self/stat``'s start time against ``/proc/uptime``; 0 where either is
    missing (not Linux)."""
    started = start_time(os.getpid())
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0
    if started is None or not started.isdigit():
        return 0.0
    return max(0.0, uptime - int(started) / ticks)


def write_bundle(out: Path, bundle: Path, allocation: dict[str, Any]) -> list[Path]:
    """Copy :data:`BUNDLE_FILES` that exist in ``out`` into ``bundle`` (each atomically) and
    write ``allocation.json``; raises ValueError naming a file over
    :data:`MAX_BUNDLE_FILE_BYTES` (it would not come back)."""
    bundle.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "allocation.json", allocation)
    written = []
    for name in BUNDLE_FILES:
        src = out / name
        if not src.is_file():
            continue
        size = src.stat().st_size
        if size > MAX_BUNDLE_FILE_BYTES:
            raise ValueError(
                f"{src}: {size:,} bytes, over the {MAX_BUNDLE_FILE_BYTES:,} an allocation brings "
                "back"
            )
        if src.resolve() != (bundle / name).resolve():
            atomic_write_bytes(bundle / name, src.read_bytes())
        written.append(bundle / name)
    assert len(written) <= MAX_BUNDLE_FILES
    return written


def allocation_record(
    budget: Budget | None,
    ran: list[tuple[str, float]],
    finished: int,
    total: int,
    stopped: BudgetSpent | None,
    done: bool,
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What one command of the study did (``allocation.json``), and the data it read."""
    return {
        "data": data,
        "ended_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "budget_s": None if budget is None else budget.seconds,
        "reserve_s": None if budget is None else budget.reserve_s,
        "elapsed_s": None if budget is None else round(budget.elapsed(), 1),
        "cells_run": [{"cell": c, "cost_s": round(s, 1)} for c, s in ran],
        "cells_finished": finished,
        "cells_total": total,
        "complete": done,
        "stopped": None
        if stopped is None
        else {
            "reason": "budget",
            "next_cell": stopped.cell.id,
            "estimate_s": None if stopped.estimate_s is None else round(stopped.estimate_s, 1),
            "left_s": round(stopped.left_s, 1),
        },
    }
