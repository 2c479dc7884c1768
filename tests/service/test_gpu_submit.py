"""Submitting a job that asks for more GPUs than the host has: 422 naming the field, nothing
stored (a real service told it has two GPUs; its runner holds every job in the queue)."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from service.launcher import LocalService

from .conftest import tiny_job


def test_a_job_asking_more_gpus_than_the_host_has_is_refused(
    start_service: Callable[..., LocalService],
) -> None:
    svc = start_service(DLRM_VRGD_GPUS="0,1", DLRM_VRGD_MAX_CONCURRENT_JOBS="0")
    headers = {"Authorization": f"Bearer {svc.token}"}
    with httpx.Client(base_url=f"{svc.base_url}/api/v1", headers=headers, timeout=30) as http:
        too_many = {"name": "4 gpus", "config": tiny_job(device="cuda", nproc_per_node=4)}
        r = http.post("/jobs", json=too_many)
        assert r.status_code == 422, r.text
        (issue,) = r.json()["detail"]
        assert issue["field"] == "config.run.nproc_per_node"
        assert issue["loc"] == ["body", "config", "run", "nproc_per_node"]
        assert "asks for 4 GPU(s)" in issue["msg"] and "has 2 for jobs (0,1" in issue["msg"]
        assert http.get("/jobs").json()["count"] == 0
        assert not any((svc.data_dir / "jobs").iterdir())

        fits = {"name": "2 gpus", "config": tiny_job(device="cuda", nproc_per_node=2)}
        assert http.post("/jobs", json=fits).status_code == 201
        cpu = {"name": "cpu", "config": tiny_job(nproc_per_node=4)}  # CPU ranks need no GPU
        assert http.post("/jobs", json=cpu).status_code == 201
        assert http.get("/jobs").json()["count"] == 2
