"""The ``dlrm-vrgd train`` launcher of a multi-rank run: SIGKILLing it takes torchrun's ranks
with it (no orphaned ranks holding cores and ports)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ..conftest import tiny_config_dict


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry))
    return out


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
            ranks = children(launcher.pid)
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
