"""``run.collective_timeout_s``: a rank that freezes (SIGSTOP: alive, never answering) fails a
two-rank job once the timeout passes, instead of hanging it (real CLI, torchrun, gloo)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..dist_utils import rank_pids
from .test_distributed import losses, write_config


def test_a_frozen_rank_fails_the_job_after_the_collective_timeout(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path / "long.yaml", 2, steps=100_000, checkpoint_every=0, collective_timeout_s=10
    )
    out = tmp_path / "long"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlrm_vrgd.cli", "train", "--config", str(cfg), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not losses(out) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        assert losses(out), "training never started"
        workers = rank_pids(proc.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGSTOP)
        t0 = time.monotonic()
        _, stderr = proc.communicate(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in workers:  # torchrun kills its ranks; never leave a stopped one behind
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert 10 <= elapsed < 100, f"the job ended {elapsed:.0f} s after the freeze"
    assert "timed out" in stderr.lower() or "timeout" in stderr.lower(), stderr[-3000:]
    status = (out / "status.json").read_text()
    assert '"state": "failed"' in status
