"""Issue 39, items 5 and 7, through real HTTP against a real service: a job's directory is
untrusted input. A file planted in it (a link to a host file, a link to /dev/zero, a FIFO, a
link on the way) is refused with a 409 naming it, never followed, read without bound or waited
on; JSON nested 100,000 levels deep is a clear 4xx (or skipped), never a 500; and a
``Last-Event-ID`` the stream never sent is ignored, not a 500."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.client import ServiceClient
from service.launcher import LocalService

from ...conftest import tiny_job
from .test_security import drop

SECRET_LINE = "TOP-SECRET-HOST-FILE"
DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.fixture
def job(api: LocalService, client: ServiceClient, http: httpx.Client) -> Iterator[Path]:
    """A queued job's directory (its run directory made), removed afterwards."""
    made = client.submit("planted", tiny_job())
    root = api.data_dir / "jobs" / made["id"]
    (root / "run").mkdir(exist_ok=True)
    yield root
    for p in (root / "train.log", root / "run" / "result.json", root / "run" / "gsnr.jsonl"):
        if p.is_symlink() or (p.exists() and not p.is_file()):
            p.unlink()
    drop(http, client, made["id"])


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A host file the service's user can read, outside the data directory: one JSON line, so
    that whatever reads it through a link (a log, a result, a record) would show it."""
    path = tmp_path / "host-file"
    path.write_text(json.dumps({"secret": SECRET_LINE, "step": 1, "noise_scale": {}}) + "\n")
    return path


def plant(path: Path, kind: str, outside: Path) -> None:
    path.unlink(missing_ok=True)
    if kind == "link":
        path.symlink_to(outside)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    else:  # "run-link": the run directory itself is a link to a directory holding the file
        run = path.parent
        target = outside.parent / "run-elsewhere"
        target.mkdir(exist_ok=True)
        (target / path.name).write_text(outside.read_text())
        for entry in run.iterdir():
            entry.unlink()
        run.rmdir()
        run.symlink_to(target)


def refused(response: httpx.Response, name: str) -> None:
    assert response.status_code == 409, (response.status_code, response.text[:300])
    assert SECRET_LINE not in response.text
    assert name in response.json()["detail"]


@pytest.mark.parametrize("kind", ["link", "dev-zero", "fifo"])
def test_a_planted_log_is_refused_by_every_log_route(
    http: httpx.Client, job: Path, outside: Path, kind: str
) -> None:
    plant(job / "train.log", kind, outside)
    job_id = job.name
    start = time.monotonic()
    refused(http.get(f"/jobs/{job_id}/logs"), "train.log")
    refused(http.get(f"/jobs/{job_id}/logs", params={"offset": 0}), "train.log")
    refused(http.get(f"/jobs/{job_id}/logs", params={"task": 0}), "train.log")
    assert time.monotonic() - start < 30  # answered, not read to the end of /dev/zero


@pytest.mark.parametrize("kind", ["link", "dev-zero", "fifo", "run-link"])
def test_a_planted_result_is_refused(
    http: httpx.Client, job: Path, outside: Path, kind: str
) -> None:
    plant(job / "run" / "result.json", kind, outside)
    refused(http.get(f"/jobs/{job.name}/result"), "result.json")


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_planted_gsnr_file_is_refused_by_advice(
    http: httpx.Client, job: Path, outside: Path, kind: str
) -> None:
    plant(job / "run" / "gsnr.jsonl", kind, outside)
    refused(http.get(f"/jobs/{job.name}/advice"), "gsnr.jsonl")


def test_fifos_hold_no_request_thread(http: httpx.Client, job: Path, outside: Path) -> None:
    """The attack that hung the API: 45 GET /logs on a FIFO, then every other call. Now each
    answers at once and the rest of the API stays up."""
    plant(job / "train.log", "fifo", outside)
    plant(job / "run" / "result.json", "fifo", outside)
    urls = [f"/jobs/{job.name}/logs", f"/jobs/{job.name}/result"] * 30
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        codes = list(pool.map(lambda u: http.get(u).status_code, urls))
    assert set(codes) == {409}
    assert http.get("/health").status_code == 200
    assert http.get("/jobs").status_code == 200


# ------------------------------------------------------------------------ item 7: depth
def test_a_result_nested_too_deep_is_a_409_not_a_500(http: httpx.Client, job: Path) -> None:
    (job / "run" / "result.json").write_bytes(DEEP)
    response = http.get(f"/jobs/{job.name}/result")
    assert response.status_code == 409, response.text[:300]
    assert "run/result.json" in response.json()["detail"]
    assert "nested" in response.json()["detail"]


def test_a_gsnr_line_nested_too_deep_is_skipped_by_advice(http: httpx.Client, job: Path) -> None:
    record = {"step": 1, "noise_scale": {"model": {"b_simple": 100.0}}}
    (job / "run" / "gsnr.jsonl").write_bytes(DEEP + b"\n" + json.dumps(record).encode() + b"\n")
    response = http.get(f"/jobs/{job.name}/advice")
    assert response.status_code == 200, response.text[:300]


def test_a_model_manifest_nested_too_deep_is_a_409(http: httpx.Client, job: Path) -> None:
    model = job / "run" / "model"
    model.mkdir()
    (model / "manifest.json").write_bytes(DEEP)
    response = http.get(f"/jobs/{job.name}/model")
    assert response.status_code == 409, response.text[:300]
    assert "manifest.json" in response.json()["detail"]


@pytest.mark.parametrize("header", ["\u00b2", "\u00b9\u00b3", "-1", "1e3", "12x"])
def test_a_last_event_id_the_stream_never_sent_is_ignored(
    api: LocalService, http: httpx.Client, client: ServiceClient, header: str
) -> None:
    job = client.submit("events", tiny_job())
    client.cancel(job["id"])
    response = http.get(
        f"/jobs/{job['id']}/events", headers={"Last-Event-ID": header.encode("latin-1")}
    )  # "²" as HTTP carries it: one byte, which the server decodes as Latin-1
    assert response.status_code == 200, response.text[:300]
    assert "event: end" in response.text and "cancelled" in response.text
    assert http.delete(f"/jobs/{job['id']}").status_code == 204
