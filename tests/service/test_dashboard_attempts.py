"""The job page of a retried job in a real headless Chromium: the process of a one-rank job is
SIGKILLed mid-run; the page lists both attempts, why the first ended and where the second
resumed, and says which attempt ran."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from service.client import ServiceClient
from service.jobs.backends import process
from service.jobs.backends.local import JOB_ENV
from service.launcher import LocalService

from .conftest import tiny_job, wait_for
from .dashboard_browser import BROWSER_MARKS, chromium, shot, signed_in_page

pytestmark = BROWSER_MARKS


def trainer_pid(job_id: str) -> int | None:
    """The job's ``dlrm_vrgd.cli train`` process (the child of its supervisor)."""
    for pid in process.job_processes(-1, f"{JOB_ENV}={job_id}"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dlrm_vrgd.cli" in cmdline and b"service.jobs.supervise" not in cmdline:
            return pid
    return None


@pytest.mark.slow  # a real retried job behind a browser; test_retries covers the retry in CI
def test_the_job_page_lists_the_attempts_of_a_retried_job(
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    svc = start_service()
    client = client_of(svc)
    job = client.submit("retried", tiny_job(steps=60, checkpoint_every=10, log_every=1))
    run = svc.data_dir / "jobs" / job["id"] / "run"
    wait_for(lambda: list((run / "checkpoints").glob("step_*")), timeout=120, every=0.1)
    os.kill(wait_for(lambda: trainer_pid(job["id"]), timeout=30), signal.SIGKILL)
    done = client.wait(job["id"], timeout=180)
    assert done["state"] == "succeeded" and done["attempt"] == 2, done["error"]
    resumed = done["attempts"][1]["resumed_from_step"]

    with chromium() as browser, signed_in_page(browser, svc.token) as w:
        page = w.page
        page.goto(f"{svc.base_url}/ui/jobs/{job['id']}")
        page.wait_for_selector("#job-attempts li[data-attempt='2']")
        items = page.locator("#job-attempts li").all_inner_texts()
        assert len(items) == 2
        assert items[0].startswith("Attempt 1") and "ended: killed by SIGKILL" in items[0]
        assert f"resumed from step {resumed}" in items[1] and "ended: succeeded" in items[1]
        assert page.inner_text("#job-attempt") == "attempt 2 of 2"
        shot(page, "job-retried")
