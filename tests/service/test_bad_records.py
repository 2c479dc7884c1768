"""Issue 39, items 3 and 5, through real services running real jobs: one bad line in a running
job's metrics.jsonl (nested 100,000 levels deep) fails that job alone, naming the file and the
line, while the queue goes on; a metrics.jsonl swapped for a link to a host file is never
ingested; and a service restarted over such a job starts (it used to exit 3)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from service.client import ServiceClient

from .conftest import job_pids, long_job, tiny_job, wait_for

DEEP = b"[" * 100_000 + b"]" * 100_000
OUTSIDE_STEP = 987_654


def running_with_records(client: ServiceClient, root: Path, job_id: str) -> None:
    """Wait until the job runs and its metrics.jsonl holds a few ingested records."""
    wait_for(lambda: client.job(job_id)["state"] == "running", timeout=120)
    wait_for(lambda: (client.job(job_id)["progress"].get("step") or 0) >= 2, timeout=180)
    assert (root / "run" / "metrics.jsonl").is_file()


def append_line(path: Path, line: bytes) -> int:
    """Append ``line`` (the trainer appends too: O_APPEND keeps each write whole) and return
    its 1-based line number."""
    with path.open("ab") as f:
        f.write(line + b"\n")
    return path.read_bytes().split(b"\n").index(line) + 1


def test_a_bad_line_fails_its_job_alone_and_a_linked_file_is_never_read(
    start_service: Any, client_of: Any, tmp_path: Path
) -> None:
    svc = start_service(DLRM_VRGD_MAX_CONCURRENT_JOBS="3")
    client = client_of(svc)
    jobs = svc.data_dir / "jobs"
    deep = client.submit("deep line", long_job())["id"]
    linked = client.submit("linked metrics", long_job())["id"]
    running_with_records(client, jobs / deep, deep)
    running_with_records(client, jobs / linked, linked)

    line = append_line(jobs / deep / "run" / "metrics.jsonl", DEEP)
    outside = tmp_path / "host.jsonl"
    outside.write_text(f'{{"kind": "train", "step": {OUTSIDE_STEP}, "loss": 0.5}}\n')
    metrics = jobs / linked / "run" / "metrics.jsonl"
    metrics.unlink()
    metrics.symlink_to(outside)
    after = client.submit("after", tiny_job())["id"]  # the queue goes on

    failed = client.wait(deep, timeout=120)
    assert failed["state"] == "failed"
    assert f"run/metrics.jsonl:{line}" in failed["error"] and "nested" in failed["error"]
    failed = client.wait(linked, timeout=120)
    assert failed["state"] == "failed"
    assert "run/metrics.jsonl: a symbolic link" in failed["error"], failed["error"]
    steps = [r.get("step") for r in client.metrics(linked)["data"]]
    assert steps and OUTSIDE_STEP not in steps
    assert client.wait(after, timeout=240)["state"] == "succeeded"
    assert client.metrics(deep)["data"]  # what it recorded before the bad line stays


def test_a_service_restarted_over_a_bad_line_starts_and_fails_that_job(
    start_service: Any, client_of: Any
) -> None:
    svc = start_service()
    client = client_of(svc)
    job_id = client.submit("deep line", long_job())["id"]
    root = svc.data_dir / "jobs" / job_id
    running_with_records(client, root, job_id)
    pgid = client.job(job_id)["pid"]
    svc.kill()  # the service dies; the job lives on in its own session...
    for pid in job_pids(job_id, pgid):  # ...until it dies too, while the service is down
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not job_pids(job_id, pgid), timeout=30)
    line = append_line(root / "run" / "metrics.jsonl", DEEP)

    again = start_service(svc.data_dir)  # it starts (old code: exit status 3)
    client = client_of(again)
    failed = client.wait(job_id, timeout=60)
    assert failed["state"] == "failed"
    assert f"run/metrics.jsonl:{line}" in failed["error"], failed["error"]
    assert client.wait(client.submit("after", tiny_job())["id"], timeout=240)["state"] == (
        "succeeded"
    )
