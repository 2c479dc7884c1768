"""Tailing JSON-lines files and folding records into a job's progress."""

from __future__ import annotations

from pathlib import Path

from service.jobs.ingest import read_new_records, update_progress


def test_only_complete_lines_are_consumed(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert read_new_records(path, 0) == ([], 0)  # not written yet
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"step"')
    records, offset = read_new_records(path, 0)
    assert records == [{"step": 1}, {"step": 2}] and offset == 24
    with path.open("ab") as f:
        f.write(b': 3, "x": NaN}\n')
    records, offset2 = read_new_records(path, offset)
    assert records == [{"step": 3, "x": None}] and offset2 == path.stat().st_size
    assert read_new_records(path, offset2) == ([], offset2)
    path.write_bytes(b'{"step": 1}\n')  # rewritten shorter (a resumed run truncates)
    assert read_new_records(path, offset2) is None


def test_progress_tracks_the_latest_step_and_the_best_eval() -> None:
    metrics = [
        {"kind": "train", "step": 1, "samples": 256, "loss": 0.7, "rows_per_s": 1000.0,
         "gsnr_ratio": 0.4, "gsnr_frac_clipped": 0.3},
        {"kind": "eval", "split": "val", "step": 1, "auc": 0.7, "oracle_auc": 0.8},
        {"kind": "train", "step": 2, "samples": 512, "loss": 0.6, "rows_per_s": 2000.0},
        {"kind": "eval", "split": "val", "step": 2, "auc": 0.65, "oracle_auc": 0.8},
        {"kind": "eval", "split": "test", "step": 2, "auc": 0.66, "oracle_auc": 0.81},
    ]  # fmt: skip
    gsnr = [{"step": 2, "tables": [{"ratio": 0.5, "frac_clipped": 0.1}, {"ratio": 0.7}]}]
    start = {"total_steps": 4}
    p = update_progress(start, metrics, gsnr)
    assert start == {"total_steps": 4}  # not modified
    assert (p["step"], p["samples"], p["loss"], p["fraction"]) == (2, 512, 0.6, 0.5)
    assert p["gsnr_ratio"] == 0.4  # the last step that reported one
    assert (p["val_auc"], p["best_val_auc"], p["best_val_step"]) == (0.65, 0.7, 1)
    assert (p["test_auc"], p["test_oracle_auc"]) == (0.66, 0.81)
    assert abs(p["table_gsnr_ratio"] - 0.6) < 1e-12 and p["table_frac_clipped"] == 0.1


def test_a_studys_best_auc_is_the_best_validation_over_its_cells() -> None:
    """Issue 31: the last cell's test AUC (0.6473) was shown as the study's best; the best is the
    highest validation AUC of any finished cell (0.6686, cell 2), wherever it comes."""
    cells = [
        {"kind": "cell", "step": 1, "total_cells": 3, "cell": "G128-a", "val_auc": 0.6501,
         "test_auc": 0.6490},
        {"kind": "cell", "step": 2, "total_cells": 3, "cell": "G256-b", "val_auc": 0.6686,
         "test_auc": 0.6652},
        {"kind": "cell", "step": 3, "total_cells": 3, "cell": "G512-c", "val_auc": 0.6480,
         "test_auc": 0.6473},
    ]  # fmt: skip
    p = update_progress({}, cells[:2], [])
    p = update_progress(p, cells[2:], [])  # folded in two batches, as the runner tails the file
    assert (p["best_val_auc"], p["best_cell"], p["best_cell_test_auc"]) == (
        0.6686,
        "G256-b",
        0.6652,
    )
    assert (p["val_auc"], p["test_auc"], p["step"], p["fraction"]) == (0.6480, 0.6473, 3, 1.0)
