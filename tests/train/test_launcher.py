"""The ``dlrm-vrgd train`` launcher of a multi-rank run: SIGKILLing it takes torchrun's ranks
with it (no orphaned ranks holding cores and ports); Ctrl-C and SIGTERM end a run as they end
a single-process one: one message, exit 130, ``status.json`` interrupted, resumable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dlrm_vrgd.rundir import read_jsonl

from ..conftest import tiny_config_dict
from ..dist_utils import rank_pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigkill_of_the_launcher_kills_its_ranks(tmp_path: Path) -> None:
    raw = tiny_config_dict(run={"nproc_per_node": 2, "micro_batch": 32, "steps": 100_000})
    config = tmp_path / "long.yaml"
    config.write_text(yaml.safe_dump(raw))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dlrm_vrgd.cli", "train", "--config", str(config),
         "--out", str(tmp_path / "run")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # the ranks train once metrics.jsonl has a step
            ranks = rank_pids(launcher.pid)
            metrics = tmp_path / "run" / "metrics.jsonl"
            if len(ranks) == 2 and metrics.exists() and '"train"' in metrics.read_text():
                break
            assert launcher.poll() is None, "the launcher exited early"
            time.sleep(0.5)
        else:
            raise AssertionError(f"2 training ranks did not start (children: {ranks})")
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 15
        while any(alive(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [r for r in ranks if alive(r)], "ranks outlived the SIGKILLed launcher"
    finally:
        launcher.kill()
        for r in ranks:
            if alive(r):
                os.kill(r, signal.SIGKILL)


def _steps(run: Path) -> list[int]:
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [r["step"] for r in read_jsonl(metrics) if r.get("kind") == "train"]


# SIGTERM (what the service and Slurm send) in CI; Ctrl-C too in make test-slow (test_cli has a
# one-rank Ctrl-C in CI)
@pytest.mark.parametrize(
    "sig", [pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGTERM]
)
def test_ctrl_c_or_sigterm_of_a_multi_rank_run_ends_it_resumably(
    tmp_path: Path, sig: signal.Signals
) -> None:
    raw = tiny_config_dict(
        run={"nproc_per_node": 2, "micro_batch": 32, "steps": 100_000, "checkpoint_every": 2}
    )
    config = tmp_path / "long.yaml"
    config.write_text(yaml.safe_dump(raw))
    run = tmp_path / "run"
    err_path = tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        # its own session, as a shell puts a foreground job: the terminal's Ctrl-C goes to the
        # launcher's process group alone (torchrun runs in a session of its own)
        launcher = subprocess.Popen(
            [sys.executable, "-m", "dlrm_vrgd.cli", "train", "--config", str(config),
             "--out", str(run)],
            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        )  # fmt: skip
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 300
        # a checkpoint (older ones are pruned as fast steps go by) and 3 steps trained
        while not any((run / "checkpoints").glob("step_*")) or len(_steps(run)) < 3:
            assert launcher.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the ranks did not train 3 steps"
            time.sleep(0.2)
        ranks = rank_pids(launcher.pid)
        assert len(ranks) == 2
        os.killpg(launcher.pid, sig)
        code = launcher.wait(120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        for r in ranks:
            if alive(r):
                os.kill(r, signal.SIGKILL)
    stderr = err_path.read_text()
    name = signal.Signals(sig).name
    assert code == 130, stderr[-3000:]
    assert stderr.count("interrupted (") == 1, stderr[-3000:]  # rank 0's message, once
    assert f"interrupted ({name}) at step" in stderr and "--resume continues from" in stderr
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-3000:]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "interrupted" and f"({name})" in status["message"]
    stopped = status["step"]
    assert _steps(run)[-1] == stopped  # both ranks stopped after the same, recorded step
    # ... and checkpointed it at the interrupt: nothing trained is lost
    assert (run / "checkpoints" / f"step_{stopped:08d}" / "rank1.pt").is_file()
    assert f"--resume continues from step_{stopped:08d}" in stderr
    assert not [r for r in ranks if alive(r)]

    # and it resumes: a short run to the end from its newest checkpoint
    done = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "train", "--config", str(config), "--out",
         str(run), "--resume", "--set", f"run.steps={stopped + 2}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert _steps(run)[-1] == stopped + 2
