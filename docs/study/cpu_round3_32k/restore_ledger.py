"""Restore this study's ledger (cells.jsonl) for the 62 cells whose run directories were lost.

The cells ran in a checkout that was not kept; only their progress records (metrics.jsonl:
cell id, validation and test AUC, the oracle's test AUC, training seconds) were committed.
Before the ledger existed a fresh checkout would have trained them all again. This script
writes, for each such cell, a ledger record holding exactly what metrics.jsonl measured, plus
the learning rates, steps and rows its config fixes; what only the run directory held (train
AUC, GSNR means and curves, the validation curve) is left out, and the record says
``"restored": "metrics.jsonl"``. Two restored cells were trained again on another machine to
check the figures (see README.md). Run once, from the repository root:

    python docs/study/cpu_round3_32k/restore_ledger.py
"""

from __future__ import annotations

import json
from pathlib import Path

from dlrm_vrgd.rundir import atomic_write_bytes, read_jsonl
from dlrm_vrgd.study.config import Cell, load_study
from dlrm_vrgd.study.ledger import LEDGER, cell_config, config_digest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def main() -> None:
    study = load_study(ROOT / "configs" / "study_cpu_round3_32k.yaml")
    ledger = HERE / LEDGER
    if ledger.exists():
        raise SystemExit(f"{ledger} exists: nothing restored")
    lines = []
    for rec in read_jsonl(HERE / "metrics.jsonl"):
        cell = Cell(
            rec["global_batch"], rec["optimizer"], rec["lr_multiplier"], rec["seed"], rec["groups"]
        )
        assert cell.id == rec["cell"], (cell.id, rec["cell"])
        config = cell_config(study, cell)
        steps = study.train_rows // cell.global_batch
        figures = {
            "cell": cell.id,
            "global_batch": cell.global_batch,
            "optimizer": cell.optimizer,
            "lr_multiplier": cell.lr_multiplier,
            "seed": cell.seed,
            "groups": cell.groups,
            "dense_lr": config["optim"]["dense"]["lr"],
            "sparse_lr": config["optim"]["sparse"]["lr"],
            "steps": steps,
            "rows": steps * cell.global_batch,
            "val_auc": rec["val_auc"],
            "test_auc": rec["test_auc"],
            "oracle_test_auc": rec["oracle_auc"],
            "oracle_val_auc": None,
            "train_auc": None,
            "wall_s": rec["train_seconds"],
            "rows_to_target": None,
            "steps_to_target": None,
            "gsnr_dense": None,
            "gsnr_dense_clipped": None,
            "gsnr_tables": None,
            "gsnr_tables_clipped": None,
            "restored": "metrics.jsonl",
        }
        record = {"cell": cell.id, "config_sha256": config_digest(config), "figures": figures}
        lines.append(json.dumps(record, separators=(",", ":")))
    atomic_write_bytes(ledger, ("\n".join(lines) + "\n").encode())
    print(f"restored {len(lines)} cells into {ledger}")


if __name__ == "__main__":
    main()
