"""Issue 39, item 10, through real services: a service SIGKILLed between writing a new job's
directory and its row leaves a directory no job owns; the next start removes it, and nothing
stored is lost (the jobs, their files, and a directory that holds more than a submission
writes)."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import yaml

from .conftest import tiny_job


def test_orphans_of_cut_short_submissions_are_removed_at_start(
    start_service: Any, client_of: Any
) -> None:
    svc = start_service(DLRM_VRGD_MAX_CONCURRENT_JOBS="0")
    client = client_of(svc)
    kept = client.submit("kept", tiny_job())["id"]
    svc.kill()
    jobs = svc.data_dir / "jobs"
    # what a SIGKILL between the directory's rename and the row's insert leaves: 5 of them
    orphans = [secrets.token_hex(8) for _ in range(5)]
    for job_id in orphans:
        (jobs / job_id).mkdir()
        (jobs / job_id / "config.yaml").write_text(yaml.safe_dump(tiny_job()))
    # a directory no job owns that holds a run: left alone (and named in the log)
    unknown = secrets.token_hex(8)
    (jobs / unknown / "run").mkdir(parents=True)
    (jobs / unknown / "run" / "result.json").write_text("{}")
    not_a_job = jobs / "notes"  # not a job id: never touched
    not_a_job.mkdir()

    again = start_service(svc.data_dir, DLRM_VRGD_MAX_CONCURRENT_JOBS="0")
    client = client_of(again)
    assert not any((jobs / job_id).exists() for job_id in orphans)
    assert (jobs / unknown / "run" / "result.json").is_file()
    assert not_a_job.is_dir()
    assert [j["id"] for j in client.jobs()["data"]] == [kept]
    assert (jobs / kept / "config.yaml").is_file()
    assert unknown in Path(again.log_path).read_text(errors="replace")
