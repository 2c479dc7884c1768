"""The CLI as a user runs it: real processes, real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from dlrm_vrgd.rundir import read_jsonl

from .conftest import tiny_config_dict


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def write_config(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(**sections)))
    return path


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


def test_generate_writes_npy_splits(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    proc = cli("generate", "--config", str(cfg), "--split", "val", "--out", str(tmp_path / "d"))
    assert proc.returncode == 0, proc.stderr
    dense = np.load(tmp_path / "d" / "val_dense.npy")
    sparse = np.load(tmp_path / "d" / "val_sparse.npy")
    labels = np.load(tmp_path / "d" / "val_labels.npy")
    assert dense.shape == (1024, 13) and sparse.shape == (1024, 6) and labels.shape == (1024, 1)
    from dlrm_vrgd.config import parse_config
    from dlrm_vrgd.data.synthetic import SyntheticCriteo

    rows = SyntheticCriteo(parse_config(tiny_config_dict()).data).source("val").read(0, 1024)
    np.testing.assert_array_equal(sparse, rows.sparse)
    np.testing.assert_array_equal(labels[:, 0], rows.labels)
    assert not list((tmp_path / "d").glob("*.tmp"))


def test_config_command_prints_resolved_config(tmp_path: Path) -> None:
    proc = cli("config", "--config", str(write_config(tmp_path)), "--set", "optim.dense.lr=0.5")
    assert proc.returncode == 0
    assert yaml.safe_load(proc.stdout)["optim"]["dense"]["lr"] == 0.5


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


def test_ctrl_c_leaves_an_interrupted_resumable_run(tmp_path: Path) -> None:
    """SIGINT (what Ctrl-C sends): exit 130, a plain message (no traceback), status.json says
    "interrupted" at its step; --resume finishes the run and clears the status."""
    import signal
    import time

    cfg = write_config(tmp_path, run={"steps": 100_000, "checkpoint_every": 2, "log_every": 1})
    out = tmp_path / "run"
    # stderr goes to a file: the live progress line fills a 64 KiB pipe nobody reads in a minute
    err_path = tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        argv = ["train", "--config", str(cfg), "--out", str(out)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "dlrm_vrgd.cli", *argv],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            # any checkpoint: only the newest are kept, so step_00000002 may already be pruned
            deadline = time.monotonic() + 300  # two steps; slow only on a loaded machine
            while not list((out / "checkpoints").glob("step_*")):
                assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
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


def test_service_commands_resolve_and_run_in_a_real_process() -> None:
    """``serve``, ``demo`` and ``jobs`` are registered by name (the trainer package imports no
    service module): every name resolves to a function of the service, and ``dlrm-vrgd jobs``
    reaches the service's own parser through the dispatcher."""
    import importlib
    import inspect

    from dlrm_vrgd.cli import SERVICE_COMMANDS

    assert set(SERVICE_COMMANDS) == {"serve", "demo", "jobs"}
    for command, target in SERVICE_COMMANDS.items():
        module, _, name = target.partition(":")
        assert module.startswith("service."), command
        assert inspect.isfunction(getattr(importlib.import_module(module), name)), target
    out = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "jobs", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "usage: dlrm-vrgd jobs" in out.stdout and "submit" in out.stdout


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
    from dlrm_vrgd.cli import result_warnings
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


def test_ctrl_c_checkpoints_the_step_it_stops_at_and_resume_continues_there(
    tmp_path: Path,
) -> None:
    """No periodic checkpoint is due (checkpoint_every 1000): Ctrl-C stops the run after the
    step in progress and checkpoints that step, so nothing trained is lost; --resume starts
    from it (its start record says so) and the interrupted steps are not trained twice."""
    import signal
    import time

    cfg = write_config(tmp_path, run={"steps": 100_000, "checkpoint_every": 1000, "log_every": 1})
    out = tmp_path / "run"
    err_path = tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dlrm_vrgd.cli", "train", "--config", str(cfg), "--out",
             str(out)],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            metrics = out / "metrics.jsonl"
            while not (metrics.exists() and metrics.read_text().count('"kind":"train"') >= 3):
                assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
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


def test_set_steps_over_a_files_epochs_and_a_misspelt_set_through_the_cli(
    tmp_path: Path,
) -> None:
    cfg = write_config(tmp_path, run={"epochs": 3, "steps": None})
    done = cli("config", "--config", str(cfg), "--set", "run.steps=30")
    assert done.returncode == 0, done.stderr
    run = yaml.safe_load(done.stdout)["run"]
    assert run["steps"] == 30 and run["epochs"] is None
    bad = cli("train", "--config", str(cfg), "--set", "run.stepz=30", "--out", str(tmp_path / "r"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "--set run.stepz=30: run.stepz:" in bad.stderr and "did you mean run.steps?" in (
        bad.stderr
    )
    assert not (tmp_path / "r").exists()


def test_every_option_says_what_it_does_and_the_main_commands_show_examples() -> None:
    import argparse

    from dlrm_vrgd.cli import EXAMPLES, build_parser
    from service.jobs_cli import build_parser as jobs_parser

    def parsers(p: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
        found = [(p.prog, p)]
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    found += parsers(child)
        return found

    missing = [
        f"{prog} {'/'.join(a.option_strings) or a.dest}"
        for prog, p in parsers(build_parser()) + parsers(jobs_parser())
        for a in p._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction) and a.help is None
    ]
    assert not missing, missing
    for name in ("train", "export", "score", "preprocess"):
        assert name in EXAMPLES
        shown = cli(name, "-h")
        assert shown.returncode == 0 and "examples:" in shown.stdout
        assert f"dlrm-vrgd {name} " in shown.stdout.split("examples:")[1]
    labels = cli("score", "-h").stdout
    assert "do raw rows start with a label" in " ".join(labels.split())
    states = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "jobs", "list", "-h"],
        capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert "queued, running, succeeded, failed, cancelled" in " ".join(states.split())
