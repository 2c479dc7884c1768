"""Run a study: every cell of the grid, one after another, resumably; then the report.

Layout of the study directory::

    OUT/
      study.json          the resolved StudyConfig
      cells/<cell id>/    one run directory per cell (metrics.jsonl, gsnr.jsonl, result.json)
      results.json        every cell's figures and the per-(batch, optimizer) summary
      results.csv         one line per (batch, optimizer): the summary, flat
      results.md          the summary as a Markdown table, with the regime stated
      auc_vs_batch.png    test AUC (mean ± sd over seeds, best LR on val) against batch size
      auc_vs_rows.png     validation AUC against rows seen, best LR, per batch size
      gsnr_ratio.png      mean GSNR ratio over training, dense and tables, VR optimizers

A cell whose ``result.json`` exists is finished and never rerun; an unfinished cell (no
``result.json``: the study was interrupted) is started again from scratch. All cells run in
this process, so the synthetic rows are generated once (``data.cache_mb``) and shared.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dlrm_vrgd.study.config import Cell, StudyConfig
from dlrm_vrgd.study.report import write_report
from dlrm_vrgd.train.rundir import RESULT, atomic_write_json

logger = logging.getLogger(__name__)

CellCallback = Callable[[int, int, Cell, str], None]


def run_study(
    study: StudyConfig,
    out: Path,
    on_cell: CellCallback | None = None,
    train_callbacks: list[Any] | None = None,
) -> dict[str, Any]:
    """Train every unfinished cell, then write the report; returns the results dict.

    ``on_cell(index, total, cell, status)`` is told ``"skip"`` (finished before), ``"start"``
    and ``"done"`` for each cell; ``train_callbacks`` are passed to each cell's training.
    """
    from dlrm_vrgd.train.loop import train

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "study.json"
    resolved = study.model_dump(mode="json")
    if saved.exists() and json.loads(saved.read_text()) != resolved:
        raise ValueError(
            f"{out} holds a different study (study.json differs): use another output directory"
        )
    atomic_write_json(saved, resolved)
    cells = study.cells()
    for i, cell in enumerate(cells):
        run_dir = out / "cells" / cell.id
        if (run_dir / RESULT).exists():
            if on_cell:
                on_cell(i, len(cells), cell, "skip")
            continue
        if run_dir.exists():  # interrupted: start the cell again
            shutil.rmtree(run_dir)
        if on_cell:
            on_cell(i, len(cells), cell, "start")
        t0 = time.perf_counter()
        train(study.cell_config(cell), run_dir, callbacks=list(train_callbacks or []))
        logger.info("cell %s done in %.1fs", cell.id, time.perf_counter() - t0)
        if on_cell:
            on_cell(i, len(cells), cell, "done")
    return write_report(study, out)
