"""Retries on the local backend, through a real ``dlrm-vrgd serve`` over HTTP: a rank of a
two-rank job SIGKILLed mid-run (as a lost node would take it) is retried: the job resumes from
its newest checkpoint in the same run directory and succeeds, with every train step once; a
config error is never retried; a retried POST with one ``submission_id`` makes one job."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

from service.client import API, ServiceClient
from service.jobs.backends import process
from service.jobs.backends.local import JOB_ENV
from service.launcher import LocalService

from .conftest import tiny_job, wait_for
from .test_slurm import state_messages
from .test_study_jobs import small_study


def rank_pid(job_id: str, rank: int) -> int | None:
    """The pid of the job's torchrun worker of ``rank``, if it runs."""
    for pid in process.job_processes(-1, f"{JOB_ENV}={job_id}"):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    return None


def checkpoints(run: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))


def test_a_sigkilled_rank_is_retried_from_the_newest_checkpoint(
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    svc = start_service()
    client = client_of(svc)
    steps = 120
    job = client.submit(
        "two-ranks",
        tiny_job(nproc_per_node=2, steps=steps, checkpoint_every=10, log_every=1, threads=1),
    )
    assert job["max_retries"] == 1 and job["attempt"] == 0  # the service default; not started
    run = svc.data_dir / "jobs" / job["id"] / "run"
    wait_for(lambda: checkpoints(run) and (client.job(job["id"])["progress"].get("step") or 0) > 12,
             timeout=300, every=0.2)  # fmt: skip
    victim = wait_for(lambda: rank_pid(job["id"], 1), timeout=30)
    before = client.job(job["id"])
    assert before["attempt"] == 1 and before["attempts"][0]["ended"] is None
    os.kill(victim, signal.SIGKILL)

    done = client.wait(job["id"], timeout=400)
    assert done["state"] == "succeeded", done["error"]
    assert done["attempt"] == 2 and len(done["attempts"]) == 2
    first, second = done["attempts"]
    assert first["ended"] == "a rank was killed by SIGKILL", first
    assert second["resumed_from_step"] >= 10 and second["resumed_from_step"] % 10 == 0
    assert second["ended"] == "succeeded" and second["backend_id"] != first["backend_id"]
    # the metrics continue across the attempts: every step once, none missing
    train = client.metrics(job["id"], kind="train", limit=10_000)["data"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert done["progress"]["step"] == steps
    resumed = second["resumed_from_step"]
    assert any(
        m.startswith("attempt 1 ended: a rank was killed by SIGKILL; attempt 2 of 2 resumes "
                     f"from step {resumed}") for m in state_messages(client, job["id"])
    )  # fmt: skip


def test_a_config_error_is_not_retried(
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
    tmp_path: Path,
) -> None:
    """An empty Criteo directory passes the submit check (it exists) and fails in the CLI with
    exit status 2 (a usage error): with retries to spare it still fails after one attempt."""
    empty = tmp_path / "no-criteo-files"
    empty.mkdir()
    client = client_of(start_service())
    config = tiny_job() | {"data": {"source": "criteo", "path": str(empty)}}
    job = client.submit("bad-data", config, max_retries=3)
    done = client.wait(job["id"], timeout=120)
    assert done["state"] == "failed" and done["exit_code"] == 2, done["error"]
    assert done["attempt"] == 1 and [a["attempt"] for a in done["attempts"]] == [1]
    assert done["attempts"][0]["ended"].startswith("exit status 2")
    assert not any("attempt 2" in m for m in state_messages(client, job["id"]))


def test_a_retried_post_with_one_submission_id_makes_one_job(
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    # the service's default retries (DLRM_VRGD_MAX_RETRIES) for train and study jobs
    client = client_of(start_service(DLRM_VRGD_MAX_CONCURRENT_JOBS="0", DLRM_VRGD_MAX_RETRIES="3"))
    body = {"name": "once", "config": tiny_job(), "submission_id": "client-42:a"}
    first = client.http.post(f"{API}/jobs", json=body)
    again = client.http.post(f"{API}/jobs", json=body)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["max_retries"] == 3
    study = client.submit("study", small_study(), kind="study")
    assert study["max_retries"] == 3 and client.job(study["id"])["max_retries"] == 3
    client.cancel(study["id"])
    client.delete(study["id"])
    assert (
        again.json()["id"] == first.json()["id"] and again.json()["submission_id"] == "client-42:a"
    )
    assert client.jobs()["count"] == 1
    other = client.http.post(f"{API}/jobs", json=body | {"submission_id": "client-42:b"})
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
    bad = client.http.post(f"{API}/jobs", json=body | {"submission_id": "no spaces"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "submission_id"
    # scheduler options on the local backend: refused, naming the field
    local = body | {"submission_id": None, "slurm": {"partition": "gpu"}}
    slurm = client.http.post(f"{API}/jobs", json=local)
    assert slurm.status_code == 422 and slurm.json()["detail"][0]["field"] == "slurm"
    # every option is typed and checked at submit, whatever the backend: 422 naming it
    for options, field in (
        ({"account": "a b"}, "slurm.account"),
        ({"qos": "high;rm"}, "slurm.qos"),
        ({"constraint": "a100 ib"}, "slurm.constraint"),
        ({"gpus_per_node": "a100:0"}, "slurm.gpus_per_node"),
        ({"gpus_per_node": 4}, "slurm.gpus_per_node"),
        ({"exclusive": "yes"}, "slurm.exclusive"),
        ({"cpus_per_task": 0}, "slurm.cpus_per_task"),
        ({"cpus_per_task": "8"}, "slurm.cpus_per_task"),
        ({"mem": "64 GB"}, "slurm.mem"),
        ({"extra_flags": ["--job-name=x"]}, "slurm.extra_flags"),
        ({"nodes": 2}, "slurm.nodes"),
    ):
        refused = client.http.post(f"{API}/jobs", json=local | {"slurm": options})
        assert refused.status_code == 422, (options, refused.text)
        assert refused.json()["detail"][0]["field"] == field, (options, refused.json())
    assert client.jobs()["count"] == 2


def test_a_submission_id_reused_with_another_body_is_refused_naming_the_id(
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    """Ray Jobs' rule: one id, one body. The same body again (even with a default spelled
    out) is the same job (200); another body under the id answers 409 naming it, and nothing
    of it is stored, whichever request reaches the service first."""
    client = client_of(start_service(DLRM_VRGD_MAX_CONCURRENT_JOBS="0"))
    body = {"name": "once", "config": tiny_job(), "submission_id": "sweep-7"}
    first = client.http.post(f"{API}/jobs", json=body)
    assert first.status_code == 201, first.text
    spelled = body | {"config": tiny_job(seed=0), "tags": []}  # run.seed's default, no tags
    same = client.http.post(f"{API}/jobs", json=spelled)
    assert same.status_code == 200 and same.json()["id"] == first.json()["id"], same.text
    for changed in (
        body | {"config": tiny_job(steps=7)},
        body | {"name": "twice"},
        body | {"max_retries": 3},
        body | {"tags": ["other"]},
    ):
        refused = client.http.post(f"{API}/jobs", json=changed)
        assert refused.status_code == 409, (changed, refused.text)
        detail = refused.json()["detail"]
        assert "submission_id 'sweep-7'" in detail and first.json()["id"] in detail, detail
    assert client.jobs()["count"] == 1
    assert client.job(first.json()["id"])["name"] == "once"
