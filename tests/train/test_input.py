"""The trainer's input pipeline with real processes: the rows are those of the serial path,
every step says how long it waited for them, and no input worker outlives the run, whether it
ends, is interrupted (SIGINT to the trainer), stops on a NaN or fails in a worker."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from dlrm_vrgd.data.batch import TrainStream
from dlrm_vrgd.data.pipeline import InputWorkerError
from dlrm_vrgd.rundir import read_jsonl
from dlrm_vrgd.train.loop import Trainer
from dlrm_vrgd.train.run import train

from ..conftest import tiny_config, tiny_config_dict
from ..data.pipeline.helpers import alive, children

PROCESSES = ["run.input.builder=processes", "run.input.workers=2"]
PIDS = re.compile(r"input: \d+ worker process\(es\), pids \[([\d, ]+)\]")


@pytest.mark.parametrize(
    "settings",
    [
        ["run.input.builder=threads", "run.input.depth=3"],
        ["run.input.builder=processes", "run.input.workers=2", "run.input.depth=5"],
    ],
)
def test_the_pipeline_trains_exactly_as_the_serial_path(settings: list[str]) -> None:
    serial = Trainer(tiny_config("run.input.builder=serial", "run.steps=5"))
    ahead = Trainer(tiny_config(*settings, "run.steps=5"))
    try:
        for _ in range(5):
            a, b = serial.train_step(), ahead.train_step()
            assert a["loss"] == b["loss"]
            assert b["data_wait_s"] >= 0.0 and b["data_wait_s"] < b["step_seconds"]
    finally:
        ahead.close_input()
    for (name, x), (_, y) in zip(
        serial.model.named_dense_parameters(), ahead.model.named_dense_parameters(), strict=True
    ):
        assert torch.equal(x, y), name


def test_serial_input_waits_for_every_row_and_says_so() -> None:
    trainer = Trainer(tiny_config("run.input.builder=serial"))
    calls: list[float] = []
    rows = trainer.stream.rows

    def slow(step: int, group: int):  # type: ignore[no-untyped-def]
        time.sleep(0.05)  # each micro-batch takes at least 50 ms to build
        calls.append(1.0)
        return rows(step, group)

    trainer.stream.rows = slow  # type: ignore[method-assign]
    record = trainer.train_step()
    assert len(calls) == 4 and record["data_wait_s"] >= 4 * 0.05


def _cli(tmp_path: Path, *sets: str) -> tuple[list[str], Path]:
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config_dict()))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dlrm_vrgd.cli", "-v", "train", "--config", str(cfg)]
    cmd += ["--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    return cmd, out


def _pids(
    log: Path, proc: subprocess.Popen[bytes] | None = None, timeout: float = 120
) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = PIDS.search(log.read_text(errors="replace"))
        if m:
            return [int(p) for p in m.group(1).split(",")]
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"no worker pids in the log:\n{log.read_text()[-3000:]}")


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_ctrl_c_stops_the_trainer_and_every_input_worker(tmp_path: Path) -> None:
    """SIGINT to the trainer's process group, as a terminal's Ctrl-C sends it: the workers
    ignore it, the trainer stops them and says it was interrupted (exit 130)."""
    cmd, out = _cli(tmp_path, *PROCESSES, "run.steps=100000", "run.log_every=1")
    log = tmp_path / "stderr.txt"
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            pids = _pids(log, proc)
            assert len(pids) == 2 and all(alive(p) and _parent(p) == proc.pid for p in pids)
            deadline = time.monotonic() + 120  # in the loop: a few steps trained
            while (
                not (out / "metrics.jsonl").exists()
                or len([r for r in read_jsonl(out / "metrics.jsonl") if r.get("kind") == "train"])
                < 3
            ):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            os.killpg(proc.pid, signal.SIGINT)  # the trainer and its workers
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert code == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert json.loads((out / "status.json").read_text())["state"] == "interrupted"
    assert not [p for p in pids if alive(p)]


def test_a_nan_stop_leaves_no_input_worker(tmp_path: Path) -> None:
    cmd, out = _cli(
        tmp_path,
        *PROCESSES,
        "run.steps=6",
        "optim.dense.name=sgd",
        "optim.dense.lr=1e6",
        "optim.sparse.name=sgd",
        "optim.sparse.lr=1e6",
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "the loss is nan" in proc.stderr, proc.stderr[-3000:]
    log = tmp_path / "stderr.txt"
    log.write_text(proc.stderr)
    pids = _pids(log)
    assert len(pids) == 2 and not [p for p in pids if alive(p)]


def test_a_failing_worker_fails_the_run_naming_it_and_the_key(tmp_path: Path, monkeypatch) -> None:
    rows = TrainStream.rows

    def bad(self: TrainStream, step: int, group: int):  # type: ignore[no-untyped-def]
        if (step, group) == (2, 1):
            raise ValueError("unreadable rows")
        return rows(self, step, group)

    monkeypatch.setattr(TrainStream, "rows", bad)  # the forked workers inherit it
    before = children()
    cfg = tiny_config(*PROCESSES, "run.steps=4")
    with pytest.raises(InputWorkerError) as err:
        train(cfg, tmp_path / "run")
    text = str(err.value)
    assert re.search(r"input worker \d \(pid \d+\) failed building", text), text
    assert "micro-batch (step 2, group 1): ValueError: unreadable rows" in text
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 2
    assert "unreadable rows" in status["error"]
    assert children() <= before  # no worker left behind
