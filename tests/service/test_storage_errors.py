"""POST /jobs when the service cannot write its job directories (a full disk, a read-only
one): 507 with the reason, and nothing half-written — no directory, no temporary file, no row.
The jobs root is a real tmpfs of 256 KiB (mounting needs root; skipped elsewhere)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from service.launcher import LocalService

from .conftest import tiny_job


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "jobs"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def test_a_full_or_read_only_disk_answers_507_and_keeps_nothing(
    small_disk: Path, start_service: Callable[..., LocalService]
) -> None:
    svc = start_service(DLRM_VRGD_JOBS_ROOT=str(small_disk), DLRM_VRGD_MAX_CONCURRENT_JOBS="0")
    headers = {"Authorization": f"Bearer {svc.token}"}
    with httpx.Client(base_url=f"{svc.base_url}/api/v1", headers=headers, timeout=30) as http:
        filler = fill(small_disk)
        response = http.post("/jobs", json={"name": "full", "config": tiny_job()})
        assert response.status_code == 507, response.text
        assert "No space left on device (ENOSPC)" in response.json()["detail"]
        assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]
        assert http.get("/jobs").json()["count"] == 0

        filler.unlink()
        response = http.post("/jobs", json={"name": "room again", "config": tiny_job()})
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]
        assert sorted(p.name for p in small_disk.iterdir()) == [job_id]

        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
        response = http.post("/jobs", json={"name": "read-only", "config": tiny_job()})
        assert response.status_code == 507, response.text
        assert "(EROFS)" in response.json()["detail"]
        assert sorted(p.name for p in small_disk.iterdir()) == [job_id]
        assert http.get("/jobs").json()["count"] == 1
    assert "Traceback" not in svc.log_tail(200)
