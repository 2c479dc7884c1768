"""The two-stage protocol: which cells a study needs, given the cells it has finished.

Stage 1 (*tune*): every (batch, optimizer, k) trains the LR grid on ``tune_seeds``; its pick is
the multiplier with the best mean **validation** AUC. A pick on the grid's edge moves the edge
out by one notch (the ratio of the two outermost multipliers there; ×2 / ÷2 for a grid of one),
up to ``edge_extensions`` times; a pick still on the edge after that is reported as an edge
pick. Stage 2 (*confirm*): the fresh ``confirm_seeds`` train at each pick (the *tuned*
protocol) and at the *rule* multiplier — each (optimizer, k)'s own pick at the smallest batch,
fixed once the smallest batch's tuning is complete and before any larger-batch cell runs — at
every batch of ``confirm_batches`` (default: all). Only confirmation cells are reported; test
AUC is never read to choose anything.

Everything here is a pure function of the study config and the finished cells' validation AUCs,
so the runner (which cells to train next) and the report (which cells are which) agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dlrm_vrgd.study.config import Cell, StudyConfig

Group = tuple[int, str, "int | None"]  # (global batch, optimizer, k)


@dataclass
class GroupPlan:
    """One (batch, optimizer, k): its tried grid, its pick once stage 1 is complete (None
    before), and whether that pick sits on the grid's edge ("low", "high" or None)."""

    grid: list[float]
    pick: float | None = None
    edge: str | None = None
    val_by_lr: dict[float, float] = field(default_factory=dict)


@dataclass
class Plan:
    groups: dict[Group, GroupPlan]
    #: (optimizer, k) → the rule's multiplier (the smallest batch's pick), once known.
    rule: dict[tuple[str, int | None], float]
    #: Cells needed now that are not finished, in the order to run them.
    todo: list[Cell]
    tune_cells: list[Cell]
    confirm_cells: list[Cell]


def _notch(grid: list[float], side: str) -> float:
    if len(grid) == 1:
        return grid[0] * (2.0 if side == "high" else 0.5)
    if side == "high":
        return grid[-1] * grid[-1] / grid[-2]
    return grid[0] * grid[0] / grid[1]


def plan(study: StudyConfig, val_auc: dict[str, float]) -> Plan:
    """The two-stage plan given ``val_auc`` (cell id → validation AUC of each finished cell)."""
    if not study.two_stage:
        raise ValueError("plan() is for two-stage studies (tune_seeds and confirm_seeds)")
    tune_seeds, confirm_seeds = study.run_seeds, list(study.confirm_seeds or [])
    smallest = min(study.batch_sizes)
    groups: dict[Group, GroupPlan] = {}
    tune_cells: list[Cell] = []
    missing_tune: dict[Group, list[Cell]] = {}
    for g in sorted(study.batch_sizes):
        for opt in study.optimizers:
            for k in study.groups_of(opt):
                grid = sorted(study.lr_multipliers)
                gp = GroupPlan(grid)
                for extension in range(study.edge_extensions + 1):
                    cells = [Cell(g, opt.name, m, s, k) for m in gp.grid for s in tune_seeds]
                    tune_cells += [c for c in cells if c not in tune_cells]
                    missing = [c for c in cells if c.id not in val_auc]
                    if missing:
                        missing_tune[(g, opt.name, k)] = missing
                        break
                    gp.val_by_lr = {
                        m: sum(val_auc[Cell(g, opt.name, m, s, k).id] for s in tune_seeds)
                        / len(tune_seeds)
                        for m in gp.grid
                    }
                    pick = max(gp.grid, key=lambda m: gp.val_by_lr[m])
                    edge = None
                    if len(gp.grid) > 1 or study.edge_extensions:
                        edge = (
                            "low" if pick == gp.grid[0] else "high" if pick == gp.grid[-1] else None
                        )
                    if edge is None or extension == study.edge_extensions:
                        gp.pick, gp.edge = pick, edge
                        break
                    gp.grid = sorted([*gp.grid, _notch(gp.grid, edge)])
                groups[(g, opt.name, k)] = gp
    rule = {
        (opt, k): gp.pick
        for (g, opt, k), gp in groups.items()
        if g == smallest and gp.pick is not None
    }
    confirm_cells: list[Cell] = []
    confirmed = set(study.confirmed_batches)
    for (g, opt, k), gp in groups.items():
        if g not in confirmed:  # tuned only (``confirm_batches``)
            continue
        ms = [m for m in (gp.pick, rule.get((opt, k))) if m is not None]
        for m in dict.fromkeys(ms):
            confirm_cells += [Cell(g, opt, m, s, k) for s in confirm_seeds]
    # Larger batches wait until every smallest-batch tuning is complete (the rule is fixed).
    smallest_done = not any(key[0] == smallest for key in missing_tune)
    todo = [c for key, cs in missing_tune.items() for c in cs if key[0] == smallest]
    if smallest_done:
        todo += [c for key, cs in missing_tune.items() for c in cs if key[0] != smallest]
    todo += [c for c in confirm_cells if c.id not in val_auc]
    if not smallest_done:
        todo = [c for c in todo if c.global_batch == smallest]
    return Plan(groups, rule, todo, tune_cells, confirm_cells)


def finished_val_aucs(
    study: StudyConfig, val_of: Callable[[Cell], float | None]
) -> tuple[dict[str, float], Plan]:
    """A two-stage study's finished cells (cell id → validation AUC, from ``val_of``: None for
    a cell that has not finished) and the plan they lead to."""
    val: dict[str, float] = {}
    while True:
        p = plan(study, val)
        new = False
        for cell in p.tune_cells + p.confirm_cells:
            if cell.id not in val and (auc := val_of(cell)) is not None:
                val[cell.id] = auc
                new = True
        if not new:
            return val, p
