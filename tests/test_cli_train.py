"""``dlrm-vrgd train`` (dlrm_vrgd/cli/cmd_train.py): a run directory, config errors that
write nothing, resume of a finished run, Ctrl-C and --resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dlrm_vrgd.rundir import read_jsonl

from .test_cli import cli, write_config


def test_train_writes_the_run_directory(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    out = tmp_path / "run"
    proc = cli(
        "train",
        "--config",
        str(cfg),
        "--out",
        str(out),
        "--set",
        "run.eval_every=2",
        "--set",
        "run.checkpoint_every=2",
    )
    assert proc.returncode == 0, proc.stderr
    assert "oracle AUC" in proc.stdout and "test AUC" in proc.stdout
    assert "step" in proc.stderr  # the live progress line
    assert json.loads((out / "config.json").read_text())["run"]["eval_every"] == 2
    records = read_jsonl(out / "metrics.jsonl")
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4]
    want = {"loss", "lr_dense", "rows_per_s", "samples", "data_wait_s"}
    assert all(want <= set(r) for r in train_records)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(r["split"], r["step"]) for r in evals] == [("val", 2), ("val", 4), ("test", 4)]
    assert all(0.5 < r["oracle_auc"] <= 1 for r in evals)
    gsnr = read_jsonl(out / "gsnr.jsonl")
    assert gsnr[0]["tables"][0]["touched_rows"] > 0
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 4 and result["samples"] == 1024
    assert result["versions"]["torch"].startswith("2.")
    assert (out / "checkpoints" / "step_00000004" / "manifest.json").exists()


def test_bad_config_key_names_it_and_writes_nothing(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    out = tmp_path / "run"
    proc = cli("train", "--config", str(cfg), "--out", str(out), "--set", "optim.dense.lrr=1")
    assert proc.returncode == 2
    assert "optim.dense.lrr" in proc.stderr
    assert not out.exists()


def test_bad_config_type_names_it(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    proc = cli(
        "train", "--config", str(cfg), "--out", str(tmp_path / "r"), "--set", "run.micro_batch=many"
    )
    assert proc.returncode == 2 and "run.micro_batch" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_unusable_data_size_writes_nothing(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    out = tmp_path / "run"
    proc = cli("train", "--config", str(cfg), "--out", str(out), "--set", "data.train_rows=100")
    assert proc.returncode == 2 and "fewer than one global batch" in proc.stderr
    assert not out.exists()


def test_resume_of_a_finished_run_is_a_no_op_that_says_so(tmp_path: Path) -> None:
    """--resume on a run that finished: exit 0, a line saying so, and not one byte of the
    run directory changes (no 0 s timings, no nan rows/s, no duplicate evals)."""
    cfg = write_config(tmp_path, run={"eval_every": 2, "checkpoint_every": 2})
    out = tmp_path / "run"
    assert cli("train", "--config", str(cfg), "--out", str(out)).returncode == 0
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    mtimes = {p: p.stat().st_mtime_ns for p in before}
    proc = cli("train", "--config", str(cfg), "--out", str(out), "--resume")
    assert proc.returncode == 0, proc.stderr
    assert "finished all 4 steps before" in proc.stdout and "unchanged" in proc.stdout
    result = json.loads(before[out / "result.json"])
    assert f"test AUC {result['test']['auc']:.4f}" in proc.stdout  # the stored figures
    after = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert after == before  # result.json byte-identical, metrics.jsonl too
    assert {p: p.stat().st_mtime_ns for p in after} == mtimes
    # more steps asked for: the run continues from its last checkpoint instead
    more = cli("train", "--config", str(cfg), "--out", str(out), "--resume", "--set", "run.steps=6")
    assert more.returncode == 0, more.stderr
    assert json.loads((out / "result.json").read_text())["steps"] == 6


def train_until_ctrl_c(
    tmp_path: Path, cfg: Path, out: Path, ready: Callable[[], bool]
) -> tuple[subprocess.Popen, Path]:
    """``dlrm-vrgd train`` in a process of its own, sent SIGINT (what Ctrl-C sends) once
    ``ready()``; returns the finished process and the file its stderr went to (a file: the live
    progress line fills a 64 KiB pipe nobody reads in a minute)."""
    err_path = tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        argv = ["train", "--config", str(cfg), "--out", str(out)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "dlrm_vrgd.cli", *argv], stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            deadline = time.monotonic() + 300  # a few steps; slow only on a loaded machine
            while not ready():
                assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc, err_path


def test_ctrl_c_leaves_an_interrupted_resumable_run(tmp_path: Path) -> None:
    """SIGINT (what Ctrl-C sends): exit 130, a plain message (no traceback), status.json says
    "interrupted" at its step; --resume finishes the run and clears the status."""
    cfg = write_config(tmp_path, run={"steps": 100_000, "checkpoint_every": 2, "log_every": 1})
    out = tmp_path / "run"
    # any checkpoint: only the newest are kept, so step_00000002 may already be pruned
    proc, err_path = train_until_ctrl_c(
        tmp_path, cfg, out, lambda: bool(list((out / "checkpoints").glob("step_*")))
    )
    stderr = err_path.read_text()
    assert proc.returncode == 130
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "interrupted" and status["step"] >= 2
    assert "interrupted (SIGINT)" in stderr and "--resume continues from step_" in stderr
    assert status["message"] in stderr
    assert not (out / "result.json").exists()

    resumed = cli(
        "train", "--config", str(cfg), "--out", str(out), "--resume", "--set", "run.steps=4"
    )
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "result.json").read_text())["steps"] >= 4
    assert not (out / "status.json").exists()


def test_ctrl_c_checkpoints_the_step_it_stops_at_and_resume_continues_there(
    tmp_path: Path,
) -> None:
    """No periodic checkpoint is due (checkpoint_every 1000): Ctrl-C stops the run after the
    step in progress and checkpoints that step, so nothing trained is lost; --resume starts
    from it (its start record says so) and the interrupted steps are not trained twice."""
    cfg = write_config(tmp_path, run={"steps": 100_000, "checkpoint_every": 1000, "log_every": 1})
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    proc, err_path = train_until_ctrl_c(
        tmp_path,
        cfg,
        out,
        lambda: metrics.exists() and metrics.read_text().count('"kind":"train"') >= 3,
    )
    stderr = err_path.read_text()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    status = json.loads((out / "status.json").read_text())
    step = status["step"]
    assert status["state"] == "interrupted" and step >= 3
    names = [p.name for p in (out / "checkpoints").glob("step_*")]
    assert names == [f"step_{step:08d}"], names  # the interrupt's step: no periodic one was due
    assert f"--resume continues from step_{step:08d}" in stderr
    trained = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert max(trained) == step  # every step it trained is in the checkpoint

    resumed = cli(
        "train", "--config", str(cfg), "--out", str(out), "--resume", "--set",
        f"run.steps={step + 2}",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["start_step"] for r in records if r["kind"] == "start"] == [0, step]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, step + 3))
