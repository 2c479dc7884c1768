"""Fixtures of the service tests: a real service process on a free loopback port, tiny jobs."""

from __future__ import annotations

import os
import secrets
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from service.client import ServiceClient
from service.jobs.backends import process
from service.jobs.backends.local import JOB_ENV
from service.launcher import LocalService, free_port

from ..conftest import tiny_config_dict
from ..slurm_cluster import SlurmCluster, missing_reason

#: Fast settings for tests: the runner looks at jobs every 0.1 s; cancel escalates after 5 s.
FAST_ENV = {
    "DLRM_VRGD_POLL_INTERVAL_S": "0.1",
    "DLRM_VRGD_CANCEL_GRACE_S": "5",
    "DLRM_VRGD_SSE_KEEPALIVE_S": "1",
    "DLRM_VRGD_LOG_LEVEL": "warning",
}


def tiny_job(**run: Any) -> dict[str, Any]:
    """A TrainConfig dict that trains 4 steps in a couple of seconds."""
    return tiny_config_dict(run=run) if run else tiny_config_dict()


def long_job() -> dict[str, Any]:
    """A tiny model that trains (slowly enough to catch it running) for a long time."""
    return tiny_config_dict(run={"steps": 100_000, "log_every": 1})


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, every: float = 0.1) -> Any:
    """Poll until ``predicate()`` is truthy; return it (AssertionError after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(every)


def job_pids(job_id: str, pgid: int) -> list[int]:
    """Live processes of a job: its process group and anything carrying its marker."""
    return process.job_processes(pgid, f"{JOB_ENV}={job_id}")


@pytest.fixture
def start_service(tmp_path: Path) -> Iterator[Callable[..., LocalService]]:
    """Start services (real ``dlrm-vrgd serve`` processes); all are stopped afterwards and no
    job process outlives the test."""
    started: list[LocalService] = []

    def start(data_dir: Path | None = None, **env: str) -> LocalService:
        svc = LocalService.start(
            data_dir or tmp_path / "data",
            secrets.token_urlsafe(24),
            env={**FAST_ENV, **env},
        )
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.stop()
    # Jobs left running on purpose (restart tests) must not outlive the test.
    for svc in started:
        jobs_dir = svc.data_dir / "jobs"
        if jobs_dir.is_dir():
            for job_dir in jobs_dir.iterdir():
                for pid in process.job_processes(-1, f"{JOB_ENV}={job_dir.name}"):
                    os.kill(pid, 9)


@pytest.fixture
def client_of() -> Iterator[Callable[[LocalService], ServiceClient]]:
    clients: list[ServiceClient] = []

    def make(svc: LocalService) -> ServiceClient:
        c = svc.client()
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A real two-node Slurm cluster for the whole test run (SLURM_CONF points at it, so the
    services the tests start use it); skipped, saying so, where Slurm is not installed."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = SlurmCluster.start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_CONF", str(cluster.conf))
            yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session's cluster, emptied after each test."""
    yield slurm_cluster
    slurm_cluster.cancel_all()
    slurm_cluster.heal()


@pytest.fixture
def slurm_env() -> dict[str, str]:
    return {
        "DLRM_VRGD_BACKEND": "slurm",
        "DLRM_VRGD_SLURM_POLL_INTERVAL_S": "0.3",
        "DLRM_VRGD_SLURM_RDZV_PORT": str(free_port()),
        # event streams go quiet when nothing happens: state_messages() reads until then
        "DLRM_VRGD_SSE_KEEPALIVE_S": "60",
    }


def python_hook_env(tmp_path: Path, code: str, **env: str) -> dict[str, str]:
    """``env`` plus a PYTHONPATH that makes every Python a job starts run ``code`` first (a
    ``sitecustomize.py`` in a directory of its own under ``tmp_path``)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent(code))
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path}
