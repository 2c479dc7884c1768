"""A real service whose runner holds every job in the queue (max_concurrent_jobs=0): the API
is exercised without training anything."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.client import ServiceClient
from service.launcher import LocalService

from ..conftest import FAST_ENV


@pytest.fixture(scope="package")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    svc = LocalService.start(
        tmp_path_factory.mktemp("api") / "data",
        secrets.token_urlsafe(24),
        env={**FAST_ENV, "DLRM_VRGD_MAX_CONCURRENT_JOBS": "0", "DLRM_VRGD_MAX_BODY_BYTES": "65536"},
    )
    yield svc
    svc.stop()


@pytest.fixture(scope="package")
def client(api: LocalService) -> Iterator[ServiceClient]:
    with api.client() as c:
        yield c


@pytest.fixture(scope="package")
def http(api: LocalService) -> Iterator[httpx.Client]:
    """Authenticated raw HTTP (for status codes and bodies the client would hide)."""
    headers = {"Authorization": f"Bearer {api.token}"}
    with httpx.Client(base_url=f"{api.base_url}/api/v1", headers=headers, timeout=30) as c:
        yield c


@pytest.fixture(scope="package")
def anon(api: LocalService) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{api.base_url}/api/v1", timeout=30) as c:
        yield c


def snapshot(http: httpx.Client, data_dir: Path) -> tuple[object, ...]:
    """Everything a bad request must leave unchanged: the jobs, their records, their files."""
    jobs = http.get("/jobs", params={"limit": 1000}).json()
    records = {
        j["id"]: (
            http.get(f"/jobs/{j['id']}/metrics").json(),
            http.get(f"/jobs/{j['id']}/gsnr").json(),
        )
        for j in jobs["data"]
    }
    files = sorted(
        (str(p.relative_to(data_dir)), p.stat().st_size)
        for p in (data_dir / "jobs").rglob("*")
        if p.is_file()
    )
    return jobs, records, files
