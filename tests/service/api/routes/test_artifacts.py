"""/jobs/{id}/artifacts, /result, /logs: files of a job, and no way out of its run directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.client import ServiceClient
from service.launcher import LocalService

from ...conftest import tiny_job
from ..conftest import snapshot


@pytest.fixture(scope="module")
def with_files(api: LocalService, client: ServiceClient) -> dict[str, Any]:
    """A (queued) job whose run directory holds files, a hidden staging entry and symlinks
    pointing out of it."""
    job = client.submit("files", tiny_job())
    job_dir = api.data_dir / "jobs" / job["id"]
    run = job_dir / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002" / "manifest.json").write_text('{"step": 2}')
    (run / "checkpoints" / ".staging_step_00000004").mkdir()
    (run / "checkpoints" / ".staging_step_00000004" / "rank0.pt").write_bytes(b"partial")
    (run / "result.json").write_text(json.dumps({"steps": 2}))
    os.symlink(job_dir / "config.yaml", run / "outside.yaml")
    os.symlink("/etc", run / "etc")
    (job_dir / "train.log").write_text("line 1\nstep 1\rstep 2\rstep 3\nlast line\n")
    return job


def test_artifacts_list_regular_files_of_the_run_directory(
    client: ServiceClient, with_files: dict
) -> None:
    listed = {a["path"]: a["bytes"] for a in client.artifacts(with_files["id"])["data"]}
    assert listed == {"checkpoints/step_00000002/manifest.json": 11, "result.json": 12}
    assert client.download(with_files["id"], "checkpoints/step_00000002/manifest.json") == (
        b'{"step": 2}'
    )
    assert client.result(with_files["id"]) == {"steps": 2}  # read from the file until stored


@pytest.mark.parametrize(
    ("name", "status"),
    [
        ("..%2Fconfig.yaml", 422),
        ("..%2F..%2F..%2Fservice.db", 422),
        ("checkpoints%2F..%2F..%2Fconfig.yaml", 422),
        ("%2Fetc%2Fpasswd", 422),
        ("checkpoints%5C..%5Cresult.json", 422),
        ("result.json%00.txt", 422),
        ("outside.yaml", 404),
        ("etc/passwd", 404),
        ("checkpoints/.staging_step_00000004/rank0.pt", 404),
        ("checkpoints", 404),
        ("nothing-here", 404),
    ],
)
def test_artifact_names_cannot_escape_the_run_directory(
    api: LocalService, http: httpx.Client, with_files: dict, name: str, status: int
) -> None:
    before = snapshot(http, api.data_dir)
    response = http.get(f"/jobs/{with_files['id']}/artifacts/{name}")
    assert response.status_code == status, response.text
    if status == 422:
        assert response.json()["detail"][0]["field"] == "path"
    assert "root:" not in response.text
    assert snapshot(http, api.data_dir) == before


def test_logs_tail_collapses_progress_redraws(client: ServiceClient, with_files: dict) -> None:
    assert client.logs(with_files["id"], tail=2) == "step 3\nlast line\n"
    assert client.logs(with_files["id"], tail=100) == "line 1\nstep 3\nlast line\n"


def test_a_job_without_result_answers_404(client: ServiceClient, http: httpx.Client) -> None:
    job = client.submit("no result", tiny_job())
    response = http.get(f"/jobs/{job['id']}/result")
    assert response.status_code == 404 and "queued" in response.json()["detail"]


def test_the_listing_takes_a_prefix_a_script_can_pick_the_newest_checkpoint_from(
    client: ServiceClient, http: httpx.Client, with_files: dict
) -> None:
    got = http.get(f"/jobs/{with_files['id']}/artifacts", params={"prefix": "checkpoints/"})
    assert got.status_code == 200
    assert got.json()["count"] == 1
    assert [a["path"] for a in got.json()["data"]] == ["checkpoints/step_00000002/manifest.json"]
    none = http.get(f"/jobs/{with_files['id']}/artifacts", params={"prefix": "nope/"}).json()
    assert none == {"data": [], "count": 0}


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_curl_f_fails_on_a_missing_artifact_and_saves_nothing(
    api: LocalService, with_files: dict, tmp_path: Path
) -> None:
    """The README downloads with ``curl -f``: a pruned checkpoint is an error, not a 404 body
    saved under the checkpoint's name (what plain ``curl -s -O`` does, exiting 0)."""
    url = f"{api.base_url}/api/v1/jobs/{with_files['id']}/artifacts"
    auth = f"Authorization: Bearer {api.token}"
    missing = f"{url}/checkpoints/step_00000050/rank0.pt"
    plain = subprocess.run(["curl", "-s", "-H", auth, "-O", missing], cwd=tmp_path, check=False)
    assert (
        plain.returncode == 0 and b"no artifact" in (tmp_path / "rank0.pt").read_bytes()
    )  # the trap
    (tmp_path / "rank0.pt").unlink()
    failed = subprocess.run(
        ["curl", "-sf", "-H", auth, "-O", missing], cwd=tmp_path, capture_output=True, check=False
    )
    assert failed.returncode == 22  # curl: HTTP error (>= 400) with --fail
    assert not (tmp_path / "rank0.pt").exists()
    present = f"{url}/checkpoints/step_00000002/manifest.json"
    ok = subprocess.run(["curl", "-sf", "-H", auth, "-O", present], cwd=tmp_path, check=False)
    assert ok.returncode == 0 and (tmp_path / "manifest.json").read_bytes() == b'{"step": 2}'
