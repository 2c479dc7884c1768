"""``dlrm-vrgd demo`` goes through the service and leaves nothing running (a tiny demo)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from service.jobs.backends import process
from service.jobs.backends.local import JOB_ENV
from service.main import DataDirLock

TINY = [
    "data.train_rows=4096",
    "data.val_rows=1024",
    "data.test_rows=1024",
    "run.global_batch=512",
    "run.micro_batch=128",
    "run.eval_every=4",
    "run.checkpoint_every=0",
]


def test_demo_trains_through_the_service_and_stops_it(tmp_path: Path) -> None:
    data = tmp_path / "service"
    args = [sys.executable, "-m", "dlrm_vrgd.cli", "demo", "--data-dir", str(data)]
    for item in TINY:
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "dense vradam, tables gsnr_rowwise_adagrad" in out
    assert "trained 8 steps, 4,096 rows" in out
    assert "test AUC" in out and "oracle AUC" in out and "(gap " in out
    assert "mean GSNR ratio: dense 0." in out
    assert "/api/v1/jobs/" in out and "/metrics?max_points=200" in out and "/docs" in out
    assert "loss" in proc.stderr and "GSNR" in proc.stderr  # the live line
    (job_dir,) = (data / "jobs").iterdir()
    assert (job_dir / "run" / "result.json").is_file()
    # nothing left running: neither the service (its lock is free) nor the job
    assert process.job_processes(-1, f"{JOB_ENV}={job_dir.name}") == []
    lock = DataDirLock(data / "service.lock")
    lock.acquire()
    lock.release()
