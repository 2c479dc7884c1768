"""The CLI's progress off a terminal (a job's log): whole plain lines at most every
DLRM_VRGD_PROGRESS_EVERY_S seconds, and the last step always; no carriage returns."""

from __future__ import annotations

import io

import pytest

from dlrm_vrgd.cli.common import ProgressLine


def test_off_a_terminal_progress_is_periodic_plain_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLRM_VRGD_PROGRESS_EVERY_S", "3600")  # one line, then only the last
    out = io.StringIO()
    bar = ProgressLine(out)
    bar.on_start({"total_steps": 5, "start_step": 0, "global_batch": 8, "accumulation": 1,
                  "micro_batch": 8})  # fmt: skip
    for step in range(1, 6):
        bar.on_step({"step": step, "loss": 0.5, "rows_per_s": 2000.0})
        if step == 3:
            bar.on_eval({"split": "val", "auc": 0.75, "oracle_auc": 0.8})
    bar.on_end(None)
    assert "\r" not in out.getvalue()
    assert out.getvalue().splitlines() == [
        "step 1/5 loss 0.5000 auc - 2.0k rows/s",
        "val auc 0.7500/0.8000",
        "step 5/5 loss 0.5000 auc 0.7500/0.8000 2.0k rows/s",
    ]


def test_the_line_says_when_the_step_waited_for_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """data_wait_s / step_seconds as a share, shown from 0.5% of the step (12% of 2 s here);
    a step that hardly waited says nothing about it."""
    monkeypatch.setenv("DLRM_VRGD_PROGRESS_EVERY_S", "0")
    out = io.StringIO()
    bar = ProgressLine(out)
    bar.on_start({"total_steps": 3, "start_step": 0, "global_batch": 8, "accumulation": 1,
                  "micro_batch": 8})  # fmt: skip
    bar.on_step({"step": 1, "loss": 0.5, "rows_per_s": 2000.0, "step_seconds": 2.0,
                 "data_wait_s": 0.24})  # fmt: skip
    bar.on_step({"step": 2, "loss": 0.5, "rows_per_s": 2000.0, "step_seconds": 2.0,
                 "data_wait_s": 0.001})  # fmt: skip
    bar.on_step({"step": 3, "loss": 0.5, "rows_per_s": 2000.0, "step_seconds": 2.0,
                 "data_wait_s": 2.0})  # fmt: skip
    assert out.getvalue().splitlines() == [
        "step 1/3 loss 0.5000 auc - 2.0k rows/s input wait 12%",
        "step 2/3 loss 0.5000 auc - 2.0k rows/s",
        "step 3/3 loss 0.5000 auc - 2.0k rows/s input wait 100%",
    ]
