"""Write a study's ledger (``OUT/cells.jsonl``) from the figures a committed study kept.

Before the ledger existed, a study's finished cells lived only in their run directories
(``cells/``, never committed), so a fresh checkout would train them all again. This script
writes, for each cell the committed files name, a ledger record holding exactly what they
measured, under the digest of the config the study gives the cell today, marked
``"restored": SOURCE``:

- ``--from metrics.jsonl`` (round three's 62 cells whose run directories were lost): validation,
  test and oracle AUC and training seconds; the learning rates, steps and rows come from the
  config; train AUC, GSNR and the curves are left out;
- ``--from results.json`` (a finished study's report): every figure the report kept per cell.

``--skip-optimizer NAME`` leaves that arm's cells out, so that the study trains them again with
today's code (CowClip in ``cpu_cowclip`` after its clip was corrected). The ledger must not
exist yet. Restored cells were checked by training some of them again (docs/study/README.md).
From the repository root:

    python docs/study/restore_ledger.py configs/study_cpu_round3_32k.yaml \\
        docs/study/cpu_round3_32k --from metrics.jsonl
    python docs/study/restore_ledger.py configs/study_cpu_cowclip.yaml \\
        docs/study/cpu_cowclip --from results.json --skip-optimizer cowclip
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dlrm_vrgd.rundir import atomic_write_bytes, read_jsonl
from dlrm_vrgd.study.config import Cell, StudyConfig, load_study
from dlrm_vrgd.study.ledger import LEDGER, cell_config, cell_identity, config_digest


def _from_metrics(study: StudyConfig, rec: dict[str, Any], cell: Cell) -> dict[str, Any]:
    config = cell_config(study, cell)
    steps = study.train_rows // cell.global_batch
    return {
        "groups": rec["groups"],
        **cell_identity(cell),
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
    }


def _cell(rec: dict[str, Any], source: str) -> Cell:
    """The cell a record names: k is part of its id only on a study's groups axis (elsewhere the
    record's ``groups`` is the k the micro-batch rule gave)."""
    args = (rec["global_batch"], rec["optimizer"], rec["lr_multiplier"], rec["seed"])
    for cell in (Cell(*args, rec["groups"]), Cell(*args)):
        if cell.id == rec["cell"]:
            return cell
    raise SystemExit(f"{source}: cell {rec['cell']} is not what its fields say")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--from", dest="source", required=True, choices=["metrics.jsonl", "results.json"]
    )
    ap.add_argument("--skip-optimizer", action="append", default=[])
    args = ap.parse_args()
    study = load_study(args.config)
    ledger = args.out / LEDGER
    if ledger.exists():
        raise SystemExit(f"{ledger} exists: nothing restored")
    if args.source == "metrics.jsonl":
        records = read_jsonl(args.out / "metrics.jsonl")
    else:
        records = json.loads((args.out / "results.json").read_text())["cells"]
    lines = []
    for rec in records:
        if rec["optimizer"] in args.skip_optimizer:
            continue
        cell = _cell(rec, args.source)
        if args.source == "metrics.jsonl":
            figures = _from_metrics(study, rec, cell)
        else:
            figures = {k: v for k, v in rec.items() if k != "restored"}
        digest = config_digest(cell_config(study, cell))
        record = {
            "cell": cell.id,
            "config_sha256": digest,
            "figures": {**figures, "restored": args.source},
        }
        lines.append(json.dumps(record, separators=(",", ":")))
    atomic_write_bytes(ledger, ("\n".join(lines) + "\n").encode())
    print(f"restored {len(lines)} cells into {ledger}")


if __name__ == "__main__":
    main()
