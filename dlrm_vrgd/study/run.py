"""Run a study: every cell of the grid, one after another, resumably; then the report.

Layout of the study directory::

    OUT/
      study.json          the resolved StudyConfig
      metrics.jsonl       one ``kind: cell`` record per finished cell (progress: step = cells done)
      cells.jsonl         the ledger: each finished cell's figures and config digest (committed)
      cells/<cell id>/    one run directory per cell (metrics.jsonl, gsnr.jsonl, result.json,
                          tb/: ``tensorboard --logdir OUT`` shows the whole grid)
      mlflow.json         the study's MLflow parent run (with ``run.mlflow`` in the base config)
      picks.json          two-stage only: each (batch, optimizer, k)'s grid, pick and edge flag
      results.json        every cell's figures and the per-(batch, optimizer) summary
      result.json         the same, written last: the study is complete
      results.csv         one line per (batch, optimizer): the summary, flat
      results.md          the summary as a Markdown table, with the regime stated
      auc_vs_batch.png    test AUC (mean ± sd over seeds, best LR on val) against batch size
      auc_vs_rows.png     validation AUC against rows seen, best LR, per batch size
      gsnr_ratio.png      mean GSNR ratio over training, dense and tables, VR optimizers

With ``tune_seeds``/``confirm_seeds`` the cells run in rounds (tune the smallest batch, fix the
rule's multipliers, tune the rest and extend edge picks, confirm; ``picks.json`` records each
pick): see :mod:`dlrm_vrgd.study.protocol`. A cell whose ``result.json`` exists, or that the
ledger ``cells.jsonl`` holds (:mod:`dlrm_vrgd.study.ledger`: what a finished cell measured, kept
small so that it is committed and a fresh checkout resumes), is finished and never rerun; an
unfinished cell (no ``result.json``: the study was interrupted) is started again from scratch.
A finished study may be grown — more learning-rate multipliers or seeds — in the same
directory: only the new cells run. With ``workers == 1`` all cells run in this process, so the
synthetic rows are generated once (``data.cache_mb``) and shared; with more, each worker
process keeps its own copy.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dlrm_vrgd.advice import finite
from dlrm_vrgd.config import ConfigError, MlflowConfig, TrainConfig
from dlrm_vrgd.rundir import RESULT, JsonlWriter, atomic_write_bytes, atomic_write_json
from dlrm_vrgd.study.budget import (
    Budget,
    BudgetSpent,
    CostKey,
    allocation_record,
    cost_key,
    write_bundle,
)
from dlrm_vrgd.study.config import Cell, StudyConfig
from dlrm_vrgd.study.ledger import Ledger
from dlrm_vrgd.study.protocol import Plan, finished_val_aucs
from dlrm_vrgd.study.report import write_report

logger = logging.getLogger(__name__)

#: ``on_cell(index, total, cell, status, record)``: status "skip" (finished before), "start"
#: (sequential runs only) or "done"; ``record`` is the cell's progress record (None on start).
CellCallback = Callable[[int, int, Cell, str, dict[str, Any] | None], None]


def run_study(
    study: StudyConfig,
    out: Path,
    on_cell: CellCallback | None = None,
    train_callbacks: list[Any] | None = None,
    budget: Budget | None = None,
    bundle: Path | None = None,
) -> dict[str, Any]:
    """Train every unfinished cell, then write the report; returns the results dict.

    ``on_cell`` (see :data:`CellCallback`) hears about each cell; ``train_callbacks`` are passed
    to each cell's training when the cells run in this process (``study.workers == 1``). With a
    ``budget`` (:mod:`dlrm_vrgd.study.budget`) a cell whose estimated cost does not fit in what
    is left is not started: the study stops there, writes its report from the cells finished
    and returns with ``results["stopped"]`` saying why (``result.json``, "complete", is written
    only once every cell is). ``bundle`` is a directory that receives the files an allocation
    brings back (:data:`~dlrm_vrgd.study.budget.BUNDLE_FILES`), refreshed after every cell.
    """
    out = Path(out)
    if budget is not None and study.workers != 1:
        raise ConfigError(
            "a time budget runs the cells one after another in this process: set workers: 1 "
            f"(the study has workers: {study.workers})"
        )
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "study.json"
    resolved = study.model_dump(mode="json")
    if saved.exists() and _spec(json.loads(saved.read_text())) != _spec(resolved):
        raise ValueError(
            f"{out} holds a different study (study.json differs): use another output directory"
        )
    cells = study.cells()
    data_info = _check_day_files(study, cells[0])
    ledger = Ledger(study, out)
    # Refuse a directory whose finished cells trained other configs before touching anything
    # (a refused resume once left a committed study's metrics.jsonl empty).
    if study.two_stage:
        finished_val_aucs(study, ledger.val_auc)
    else:
        for cell in cells:
            ledger.figures(cell)
    atomic_write_json(saved, resolved)
    (out / RESULT).unlink(missing_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)  # rewritten below, from the cells themselves
    log = JsonlWriter(out / "metrics.jsonl")
    done = 0
    ran: list[tuple[str, float]] = []  # the cells this process trained, and their cost
    if budget is not None:
        budget.history += ledger_costs(ledger)

    def finished(i: int, cell: Cell, status: str, cost_s: float | None = None) -> None:
        nonlocal done
        done += 1
        ledger.record(cell, cost_s)
        record = _cell_record(done, len(cells), cell, ledger, status)
        log.write(record)
        if cost_s is not None:
            ran.append((cell.id, cost_s))
            if budget is not None:
                budget.history.append((cost_key(study, cell), cost_s))
            if bundle is not None:
                alloc = allocation_record(budget, ran, done, len(cells), None, False, data_info)
                write_bundle(out, bundle, alloc)
        if on_cell:
            on_cell(i, len(cells), cell, status, record)

    mlflow = _study_mlflow(study, cells, out)

    def run_cells(todo: list[tuple[int, Cell]]) -> None:
        for _, cell in todo:
            run_dir = out / "cells" / cell.id
            if run_dir.exists():  # interrupted: start the cell again
                shutil.rmtree(run_dir)
        if study.workers == 1:
            from dlrm_vrgd.train.run import train

            clock = time.perf_counter if budget is None else budget.clock
            for i, cell in todo:
                if budget is not None:
                    budget.check(cell, cost_key(study, cell))
                if on_cell:
                    on_cell(i, len(cells), cell, "start", None)
                t0 = clock()
                train(
                    _with_parent(study.cell_config(cell), mlflow),
                    out / "cells" / cell.id,
                    callbacks=list(train_callbacks or []),
                    final_checkpoints=False,  # a cell's figures are in the ledger
                )
                _release_memory()
                cost = clock() - t0
                logger.info("cell %s done in %.1fs", cell.id, cost)
                finished(i, cell, "done", cost)
        else:
            _run_parallel(study, out, todo, finished, mlflow)

    stopped: BudgetSpent | None = None
    try:
        if study.two_stage:
            _run_two_stage(study, out, cells, ledger, finished, run_cells)
        else:
            todo = []
            for i, cell in enumerate(cells):
                if ledger.figures(cell) is not None:
                    finished(i, cell, "skip")
                    continue
                todo.append((i, cell))
            run_cells(todo)
    except BudgetSpent as spent:
        stopped = spent
        logger.info("study %s stopped: %s", study.name, spent)
    finally:
        log.close()
    results = write_report(study, out)
    complete = stopped is None and results["cells_finished"] == results["cells_total"]
    results["stopped"] = None if stopped is None else str(stopped)
    if complete:
        atomic_write_json(out / RESULT, results)
    if bundle is not None:
        alloc = allocation_record(
            budget,
            ran,
            results["cells_finished"],
            results["cells_total"],
            stopped,
            complete,
            data_info,
        )
        write_bundle(out, bundle, alloc)
    if mlflow is not None:
        from dlrm_vrgd.tracking.mlflow_sink import log_study_report

        log_study_report(mlflow[0], mlflow[1], out)
    return results


def _check_day_files(study: StudyConfig, cell: Cell) -> dict[str, Any] | None:
    """A study reading day files (``data.source: criteo``) needs ``train_rows`` training rows
    in them: fewer would make every cell repeat rows, and the batches would no longer see the
    same data. Checked (from the manifest) before any cell runs. Returns what the files are —
    their training rows and, for generated data, the oracle metrics their manifest records —
    for ``allocation.json`` (None for synthetic data, whose cells report the oracle)."""
    data = study.cell_config(cell).data
    if data.source == "synthetic":
        return None
    from dlrm_vrgd.data import build_splits

    rows = build_splits(data).train.num_rows
    if rows < study.train_rows:
        raise ConfigError(
            f"base.data.path {data.path}: {rows:,} training rows, fewer than the study's "
            f"steps_at_largest x max(batch_sizes) = {study.train_rows:,}"
        )
    if rows > study.train_rows:
        logger.warning(
            "%s holds %s training rows; each cell reads %s of them (the first of its shuffle)",
            data.path,
            f"{rows:,}",
            f"{study.train_rows:,}",
        )
    info: dict[str, Any] = {"path": str(data.path), "train_rows": rows}
    try:  # the manifest was checked by build_splits; the oracle is read as data, never trusted
        generated = json.loads((Path(data.path) / "manifest.json").read_text()).get("generated")
        oracle = generated.get("oracle") if isinstance(generated, dict) else None
        if isinstance(oracle, dict):
            info["oracle"] = {
                split: {k: v for k, v in m.items() if finite(v) is not None}
                for split, m in oracle.items()
                if split in ("train", "val", "test") and isinstance(m, dict)
            }
    except (OSError, ValueError, AttributeError):
        pass
    return info


def ledger_costs(ledger: Ledger) -> list[tuple[CostKey, float]]:
    """The recorded cost of every cell in the ledger, keyed for :func:`budget.estimate`."""
    out = []
    for cell_id, rec in ledger.records().items():
        cost, f = ledger.cost_s(cell_id), rec["figures"]
        if cost is not None and isinstance(f.get("groups"), int):
            out.append(((int(f["global_batch"]), str(f["optimizer"]), f["groups"]), cost))
    return out


def _release_memory() -> None:
    """Hand a finished cell's tensors back before the next one (its trainer is gone): the
    CUDA caching allocator's blocks too, so that a 512k cell never meets its predecessor's."""
    import gc

    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _run_two_stage(
    study: StudyConfig,
    out: Path,
    cells: list[Cell],
    ledger: Ledger,
    finished: Callable[[int, Cell, str], None],
    run_cells: Callable[[list[tuple[int, Cell]]], None],
) -> None:
    """Tune, extend edge picks, fix the rule, confirm: rounds of the cells the plan needs now
    (:mod:`dlrm_vrgd.study.protocol`), until it needs none. ``picks.json`` records the picks
    and the rule's multipliers as they are fixed."""
    val, p = finished_val_aucs(study, ledger.val_auc)
    cells[:] = p.tune_cells + p.confirm_cells  # the total as known now
    for i, cell in enumerate(c for c in cells if c.id in val):
        finished(i, cell, "skip")
    while True:
        _write_picks(out, p)
        if not p.todo:
            return
        cells[:] = p.tune_cells + p.confirm_cells
        run_cells([(cells.index(c), c) for c in p.todo])
        val, p = finished_val_aucs(study, ledger.val_auc)


def _write_picks(out: Path, p: Plan) -> None:
    atomic_write_json(
        out / "picks.json",
        {
            "rule": [
                {"optimizer": o, "groups": k, "lr_multiplier": m} for (o, k), m in p.rule.items()
            ],
            "tuned": [
                {
                    "global_batch": g,
                    "optimizer": o,
                    "groups": k,
                    "grid": gp.grid,
                    "lr_multiplier": gp.pick,
                    "edge": gp.edge,
                }
                for (g, o, k), gp in p.groups.items()
            ],
        },
    )


def _study_mlflow(
    study: StudyConfig, cells: list[Cell], out: Path
) -> tuple[MlflowConfig, str] | None:
    """The MLflow settings of the cells and the study's parent run id, when asked for."""
    cfg = study.cell_config(cells[0]).run.mlflow
    if cfg is None:
        return None
    from dlrm_vrgd.tracking.mlflow_sink import study_parent_run

    run_id = study_parent_run(cfg, out, study.model_dump(mode="json"))
    return None if run_id is None else (cfg, run_id)


def _with_parent(cfg: TrainConfig, mlflow: tuple[MlflowConfig, str] | None) -> TrainConfig:
    """A cell's config with its MLflow run nested under the study's run."""
    if mlflow is None or cfg.run.mlflow is None:
        return cfg
    nested = cfg.run.mlflow.model_copy(update={"parent_run_id": mlflow[1]})
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"mlflow": nested})})


#: Settings that only choose which cells run, how many at once, or how they are reported: a
#: finished study may be resumed with more learning rates or seeds, or another target AUC.
_GRID_ONLY = (
    "workers",
    "lr_multipliers",
    "seeds",
    "target_auc",
    "rule_multiplier",
    "groups",
    "confirm_seeds",
    "collapse_auc",
    "primary_endpoints",
    "preregistration",
    "exploratory",
)
#: Study fields added after studies were first run: at their defaults they are left out of the
#: spec, so that a study.json written before them still matches.
_LATER_STUDY_FIELDS = {"tune_seeds": None, "edge_extensions": 0, "confirm_batches": None}


#: Optimizer fields added after studies were first run: unset, they are left out of the spec so
#: that a study.json written before them still matches.
_LATER_OPTIMIZER_FIELDS = ("groups", "lr_rule", "rule_multiplier")


def _spec(resolved: dict[str, Any]) -> dict[str, Any]:
    """What every cell of a study shares: its config less the grid-only settings."""
    spec = {k: v for k, v in resolved.items() if k not in _GRID_ONLY}
    for k, default in _LATER_STUDY_FIELDS.items():
        if spec.get(k, default) == default:
            spec.pop(k, None)
    spec["optimizers"] = [
        {k: v for k, v in o.items() if not (k in _LATER_OPTIMIZER_FIELDS and v is None)}
        for o in spec.get("optimizers", [])
    ]
    return spec


def _run_parallel(
    study: StudyConfig,
    out: Path,
    todo: list[tuple[int, Cell]],
    finished: Callable[[int, Cell, str], None],
    mlflow: tuple[MlflowConfig, str] | None,
) -> None:
    threads = max(1, (os.cpu_count() or 1) // study.workers)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(study.workers, mp_context=context) as pool:
        running = {}
        for i, cell in todo:
            config = _with_parent(study.cell_config(cell), mlflow).to_dict()
            args = (config, str(out / "cells" / cell.id), threads)
            running[pool.submit(_train_cell, *args)] = (i, cell)
        for future in as_completed(running):
            future.result()  # a failed cell fails the study (finished cells stay finished)
            i, cell = running[future]
            finished(i, cell, "done")


def _train_cell(config: dict[str, Any], run_dir: str, threads: int) -> None:
    """One cell in a worker process (spawned: a fresh interpreter)."""
    import torch

    from dlrm_vrgd.config import parse_config
    from dlrm_vrgd.train.run import train

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    torch.set_num_threads(threads)
    train(parse_config(config), Path(run_dir), final_checkpoints=False)


def _cell_record(done: int, total: int, cell: Cell, ledger: Ledger, status: str) -> dict[str, Any]:
    figures = ledger.figures(cell)
    assert figures is not None  # called for finished cells only
    return {
        "kind": "cell",
        "step": done,
        "total_cells": total,
        "cell": cell.id,
        "status": status,
        "global_batch": cell.global_batch,
        "optimizer": cell.optimizer,
        "lr_multiplier": cell.lr_multiplier,
        "seed": cell.seed,
        "groups": cell.groups,
        "val_auc": figures["val_auc"],
        "test_auc": figures["test_auc"],
        "oracle_auc": figures.get("oracle_test_auc"),
        "train_seconds": figures.get("wall_s"),
    }


def rewrite_report(out: Path) -> dict[str, Any]:
    """Rewrite a study directory's reports from its finished cells with today's report code
    (``dlrm-vrgd study report DIR``); the cells are read, never rerun. ``result.json`` (the
    study is complete) is rewritten only where it existed."""
    out = Path(out)
    saved = out / "study.json"
    if not saved.exists():
        raise ConfigError(f"{out}: no study.json (not a study directory)")
    try:
        study = StudyConfig.model_validate(json.loads(saved.read_text()))
    except (ValidationError, json.JSONDecodeError) as err:
        raise ConfigError(f"{saved}: not a valid study config: {err}") from None
    results = write_report(study, out)
    if (out / RESULT).exists():
        atomic_write_json(out / RESULT, results)
    progress = out / "metrics.jsonl"
    if results["cells"] and (not progress.exists() or not progress.stat().st_size):
        _rebuild_progress(progress, results)
    return results


def _rebuild_progress(path: Path, results: dict[str, Any]) -> None:
    """The study's progress log, rebuilt from its cells' figures (``status: rebuilt``) where it
    is empty or missing; written to a temporary file and renamed."""
    total = results["cells_total"]
    lines = []
    for i, c in enumerate(results["cells"], start=1):
        record = {
            "kind": "cell",
            "step": i,
            "total_cells": total,
            "cell": c["cell"],
            "status": "rebuilt",
            "global_batch": c["global_batch"],
            "optimizer": c["optimizer"],
            "lr_multiplier": c["lr_multiplier"],
            "seed": c["seed"],
            "groups": c.get("groups"),
            "val_auc": c["val_auc"],
            "test_auc": c["test_auc"],
            "oracle_auc": c.get("oracle_test_auc"),
            "train_seconds": c.get("wall_s"),
        }
        lines.append(json.dumps(record))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
