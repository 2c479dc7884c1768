"""What the commands share (dlrm_vrgd/cli/common.py): a finished run's result as printed, and
the warnings a user should not miss. The progress line: tests/test_progress_line.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlrm_vrgd.rundir import read_jsonl

from .test_cli import cli, write_config


def test_a_final_model_worse_than_its_best_or_than_the_base_rate_is_said(tmp_path: Path) -> None:
    """A learning rate so high that validation AUC peaks early: the summary says the final
    model is worse than the best checkpoint (naming both AUCs and `export --best`), and an NE
    above 1 (worse than predicting the click rate) is said too."""
    cfg = write_config(
        tmp_path,
        optim={"dense": {"name": "adamw", "lr": 0.3}, "sparse": {"name": "rowwise_adagrad",
                                                                  "lr": 3.0}},
        run={"steps": 12, "eval_every": 1, "eval_rows": 256},
    )  # fmt: skip
    out = tmp_path / "run"
    proc = cli("train", "--config", str(cfg), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "result.json").read_text())
    best, final = result["best_val"], result["val"]
    evals = [
        r for r in read_jsonl(out / "metrics.jsonl")
        if r["kind"] == "eval" and r["split"] == "val" and r["step"] < 12
    ]  # fmt: skip
    assert best["auc"] == max(r["auc"] for r in evals)
    assert best["auc"] > final["auc"], "the test needs a run that ends below its best"
    said = proc.stderr
    assert (
        f"warning: the final model's validation AUC {final['auc']:.4f} is below the best "
        f"checkpoint's {best['auc']:.4f} (step {best['step']})" in said
    ), said
    assert f"dlrm-vrgd export --run {out} --best" in said
    for split in ("val", "test"):
        ne = result[split]["ne"]
        assert (f"warning: {split} NE {ne:.4f} > 1" in said) == (ne > 1), (split, ne, said)


def test_a_run_whose_steps_wait_for_input_is_told_so(tmp_path: Path) -> None:
    """A tiny model on 4,096-row micro-batches of live synthetic rows built by the step itself
    (run.input.builder: serial): generating the rows costs about as much as the step. result.json
    keeps the steps' whole wait and the share after the first step (from the train records),
    and the summary warns exactly when that share is 10% or more."""
    b = 4096
    cfg = write_config(
        tmp_path,
        data={"train_rows": 8 * b, "chunk_rows": b},
        run={"steps": 6, "log_every": 1, "global_batch": b, "micro_batch": b,
             "input": {"builder": "serial"}},
    )  # fmt: skip
    out = tmp_path / "run"
    proc = cli("train", "--config", str(cfg), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    timings = json.loads((out / "result.json").read_text())["timings"]
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert timings["input_wait_seconds"] == pytest.approx(sum(r["data_wait_s"] for r in steps))
    later = steps[1:]
    share = sum(r["data_wait_s"] for r in later) / sum(r["step_seconds"] for r in later)
    assert timings["input_wait_share"] == pytest.approx(share)
    assert share > 0.0
    warned = "warning: the steps waited for their input" in proc.stderr
    assert warned == (share >= 0.10), (share, proc.stderr)
    if warned:
        assert f"{share:.0%} of their time (after the first step)" in proc.stderr
        assert "run.input.workers" in proc.stderr


def test_the_input_wait_warning_reads_the_share_after_the_first_step() -> None:
    from dlrm_vrgd.cli.common import result_warnings
    from dlrm_vrgd.train.run import RunResult

    def warnings(share: float | None) -> list[str]:
        figures = {"auc": 0.7, "ne": 0.9}
        result = RunResult(
            steps=3, samples=30, losses=[0.5], val=figures, test=figures, best_val=None,
            train_seconds=2.0, eval_seconds=0.1, input_wait_seconds=1.5,
            input_wait_share=share,
        )  # fmt: skip
        return [w for w in result_warnings(result) if "input" in w]

    assert warnings(None) == []  # one step: no share (its wait is the input's start)
    assert warnings(0.0999) == []
    (said,) = warnings(0.10)
    assert said.startswith("the steps waited for their input 10% of their time")
    (said,) = warnings(0.254)
    assert "25% of their time" in said


def test_the_printed_result_says_where_the_target_was_reached(capsys) -> None:
    from dlrm_vrgd.cli.common import print_result
    from dlrm_vrgd.train.run import RunResult

    figures = {"auc": 0.8, "logloss": 0.45, "ne": 0.9}
    reached = {"target_auc": 0.8, "reached": True, "step": 40, "samples": 40 * 4096,
               "epochs": 0.25, "wall_seconds": 12.34, "evals": 4}  # fmt: skip
    run = RunResult(40, 40 * 4096, [0.5], figures, figures, None, 10.0, 2.0, target=reached)
    print_result(run)
    said = capsys.readouterr().out
    assert "target AUC 0.8 reached at step 40 (163,840 rows, 0.25 epochs, 12.3 s wall" in said
    missed = {"target_auc": 0.81, "reached": False, "evals": 7}
    print_result(RunResult(40, 1, [0.5], figures, figures, None, 10.0, 2.0, target=missed))
    assert "target AUC 0.81 not reached in 7 evals" in capsys.readouterr().out
