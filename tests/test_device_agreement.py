"""bench/device_agreement.py (run by bench/gpu_check.py on a GPU) on the CPU: a trainer compared
with itself from identical weights agrees exactly, and a table row moved on one side beyond
what its step may differ by is reported with its bound."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from device_agreement import compare  # noqa: E402


def test_the_cpu_agrees_with_itself_row_by_row() -> None:
    tables, problems = compare("cpu", 1)
    assert problems == []
    assert len(tables) == 26 and all(t["max_diff"] == 0.0 for t in tables)


def test_a_row_moved_beyond_its_bound_is_reported() -> None:
    def tamper(trainer) -> None:  # one row of table 0, a little off before the step
        with torch.no_grad():
            trainer.lookups[0].table_weights()[0][0] += 1e-2

    _, problems = compare("cpu", 1, tamper=tamper)
    assert any("t_cat_0: a row moved" in p for p in problems), problems
