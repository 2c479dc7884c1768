"""Issue 24 through real HTTP against a real service process: no secret leaves in an answer or
a log, MLflow writes only under the service's MLflow directory, archives follow no link and
serve no altered model, request schemas take strict types, bodies are bounded in time, and
errors show paths relative to the data directory."""

from __future__ import annotations

import http.client
import io
import json
import secrets
import shutil
import socket
import sqlite3
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from service.client import ServiceClient
from service.launcher import LocalService

from ...conftest import FAST_ENV, tiny_job
from .test_hostile_input import assert_refused, post_raw, stored

SECRET = "s3cret-Pw-4242"


def with_mlflow(**mlflow: Any) -> dict[str, Any]:
    cfg = tiny_job()
    cfg["run"]["mlflow"] = mlflow
    return {"name": "mlflow", "config": cfg}


def drop(http: httpx.Client, client: ServiceClient, job_id: str) -> None:
    client.cancel(job_id)
    assert http.delete(f"/jobs/{job_id}").status_code == 204


# --------------------------------------------------------------------- item 2: credentials
@pytest.mark.parametrize(
    "uri",
    [
        f"http://user:{SECRET}@127.0.0.1:5000",
        f"https://127.0.0.1:5000/?token={SECRET}",
        f"http://127.0.0.1:5000/api?x=1&access_token={SECRET}",
        f"http://{SECRET}@127.0.0.1:5000",
        f"http://127.0.0.1:5000/?password={SECRET}",
    ],
    ids=["user-password", "token-query", "access-token", "user-only", "password-query"],
)
def test_a_tracking_uri_with_credentials_is_refused_and_not_echoed(
    api: LocalService, http: httpx.Client, uri: str
) -> None:
    issues = assert_refused(
        api, http, with_mlflow(tracking_uri=uri), "config.run.mlflow.tracking_uri"
    )
    text = json.dumps(issues)
    assert SECRET not in text
    assert "MLFLOW_TRACKING_PASSWORD" in text  # where credentials go instead
    assert SECRET not in Path(api.log_path).read_text(errors="replace")


def test_an_artifact_location_with_credentials_is_refused(
    api: LocalService, http: httpx.Client
) -> None:
    body = with_mlflow(
        tracking_uri="http://127.0.0.1:5000", artifact_location=f"s3://key:{SECRET}@bucket/x"
    )
    issues = assert_refused(api, http, body, "config.run.mlflow.artifact_location")
    assert SECRET not in json.dumps(issues)


def test_echoed_uris_are_redacted_in_logs_and_results(
    api: LocalService, client: ServiceClient, http: httpx.Client
) -> None:
    """Defence in depth: whatever a run directory holds, /logs and /result mask it."""
    job = client.submit("echo", tiny_job())
    root = api.data_dir / "jobs" / job["id"]
    (root / "run").mkdir(exist_ok=True)
    (root / "train.log").write_text(
        f"WARNING MLflow at http://me:{SECRET}@127.0.0.1:5000 failed\n"
        f"GET https://127.0.0.1/x?token={SECRET}&limit=3\n"
    )
    (root / "run" / "result.json").write_text(
        json.dumps({"mlflow": {"tracking_uri": f"http://me:{SECRET}@127.0.0.1:5000"}})
    )
    logs = http.get(f"/jobs/{job['id']}/logs").text
    assert SECRET not in logs and "http://***@127.0.0.1:5000" in logs and "limit=3" in logs
    result = http.get(f"/jobs/{job['id']}/result").json()
    assert result["mlflow"]["tracking_uri"] == "http://***@127.0.0.1:5000"
    drop(http, client, job["id"])


# ------------------------------------------------------------- item 3: where MLflow writes
def table_count(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT count(*) FROM sqlite_master WHERE type='table'").fetchone()[0]


@pytest.mark.parametrize(
    "where",
    ["outside", "relative", "service-db", "service-db-3-slashes", "file-outside", "plain",
     "token", "jobs", "link-to-db", "postgres"],
)  # fmt: skip
def test_mlflow_stores_outside_the_mlflow_directory_are_refused(
    api: LocalService, http: httpx.Client, tmp_path: Path, where: str
) -> None:
    data = api.data_dir
    link = data / "mlflow" / f"link-{secrets.token_hex(4)}.db"
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(data / "service.db")
    uri = {
        "outside": f"sqlite:///{tmp_path}/elsewhere/x.db",
        "relative": "sqlite:///elsewhere/x.db",
        "service-db": f"sqlite:///{data}/service.db",
        "service-db-3-slashes": f"sqlite:///{str(data).lstrip('/')}/service.db",
        "file-outside": f"file://{tmp_path}/mlruns",
        "plain": str(tmp_path / "mlruns"),
        "token": f"sqlite:///{data}/token",
        "jobs": f"file://{data}/jobs/mlruns",
        "link-to-db": f"sqlite:///{link}",
        "postgres": "postgresql://127.0.0.1/mlflow",
    }[where]
    tables = table_count(data / "service.db")
    issues = assert_refused(
        api, http, with_mlflow(tracking_uri=uri), "config.run.mlflow.tracking_uri"
    )
    assert str(data) not in json.dumps(issues)  # paths are shown relative
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "mlruns").exists()
    assert table_count(data / "service.db") == tables


def test_a_local_artifact_location_outside_the_mlflow_directory_is_refused(
    api: LocalService, http: httpx.Client, tmp_path: Path
) -> None:
    body = with_mlflow(
        tracking_uri=f"sqlite:///{api.data_dir}/mlflow/ok.db", artifact_location=str(tmp_path)
    )
    assert_refused(api, http, body, "config.run.mlflow.artifact_location")


def test_a_study_with_an_mlflow_store_outside_is_refused(
    api: LocalService, http: httpx.Client, tmp_path: Path
) -> None:
    from ....study.test_study import TINY

    study = json.loads(json.dumps(TINY))
    study["base"].setdefault("run", {})["mlflow"] = {"tracking_uri": f"sqlite:///{tmp_path}/x.db"}
    body = {"name": "study", "kind": "study", "config": study}
    assert_refused(api, http, body, "config.base.run.mlflow.tracking_uri")


@pytest.mark.parametrize("form", ["sqlite", "file", "http"])
def test_mlflow_stores_the_service_allows_are_taken(
    api: LocalService, client: ServiceClient, http: httpx.Client, form: str
) -> None:
    uri = {
        "sqlite": f"sqlite:///{api.data_dir}/mlflow/runs.db",
        "file": f"file://{api.data_dir}/mlflow/mlruns",
        "http": "http://127.0.0.1:5000",
    }[form]
    before = stored(api, http)
    response = post_raw(http, with_mlflow(tracking_uri=uri))
    assert response.status_code == 201, response.text
    assert response.json()["config"]["run"]["mlflow"]["tracking_uri"] == uri
    drop(http, client, response.json()["id"])
    assert stored(api, http) == before


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")
def test_a_job_exports_to_an_allowed_sqlite_store_and_never_to_the_services_db(
    start_service: Any, client_of: Any, tmp_path: Path
) -> None:
    """The allowed store is used for real: the run is in it, the service's db is untouched."""
    mlflow = pytest.importorskip("mlflow.tracking")
    svc = start_service()
    client = client_of(svc)
    db = svc.data_dir / "mlflow" / "runs.db"
    tables = table_count(svc.data_dir / "service.db")
    cfg = tiny_job()
    cfg["run"]["mlflow"] = {
        "tracking_uri": f"sqlite:///{db}",
        "artifact_location": str(svc.data_dir / "mlflow" / "artifacts"),
    }
    job = client.wait(client.submit("tracked", cfg)["id"], timeout=240)
    assert job["state"] == "succeeded", job["error"]
    run_id = client.result(job["id"])["mlflow"]["run_id"]
    assert mlflow.MlflowClient(f"sqlite:///{db}").get_run(run_id).info.status == "FINISHED"
    assert table_count(svc.data_dir / "service.db") == tables


# --------------------------------------------------------- item 5: links and altered models
@pytest.fixture(scope="module")
def exported_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real model directory (a 2-step tiny run, `export_model`)."""
    from dlrm_vrgd.serve.export import export_model
    from dlrm_vrgd.train.loop import Trainer

    from ....conftest import tiny_config

    root = tmp_path_factory.mktemp("model")
    trainer = Trainer(tiny_config())
    for _ in range(2):
        trainer.train_step()
    trainer.save_checkpoint(root / "run")
    export_model(root / "run", root / "model")
    return root / "model"


@pytest.fixture
def model_job(api: LocalService, client: ServiceClient, http: httpx.Client, exported_model: Path):
    """A (queued) train job whose run directory holds a copy of the real model."""
    job = client.submit("model", tiny_job())
    run = api.data_dir / "jobs" / job["id"] / "run"
    run.mkdir(exist_ok=True)
    shutil.copytree(exported_model, run / "model")
    yield job["id"], run / "model"
    drop(http, client, job["id"])


def tar_names(content: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(content)) as archive:
        return sorted(archive.getnames())


def test_an_intact_model_is_served(
    http: httpx.Client, model_job: tuple[str, Path], exported_model: Path
) -> None:
    job_id, _ = model_job
    response = http.get(f"/jobs/{job_id}/model")
    assert response.status_code == 200, response.text
    want = sorted(f"model-{job_id}/{p.name}" for p in exported_model.iterdir())
    assert tar_names(response.content) == want


def test_a_link_planted_in_the_model_is_never_followed(
    http: httpx.Client, model_job: tuple[str, Path], tmp_path: Path
) -> None:
    job_id, model = model_job
    outside = tmp_path / "outside.txt"
    outside.write_text("TOP-SECRET-LINE\n")
    (model / "leak.txt").symlink_to(outside)
    response = http.get(f"/jobs/{job_id}/model")
    assert b"TOP-SECRET-LINE" not in response.content
    if response.status_code == 200:  # skipped (a manifest that lists it all is refused: 409)
        assert f"model-{job_id}/leak.txt" not in tar_names(response.content)
    else:
        assert response.status_code == 409, response.text


@pytest.mark.parametrize("damage", ["altered", "linked-weights", "truncated", "model-dir-link"])
def test_a_model_altered_on_disk_is_not_served(
    api: LocalService,
    http: httpx.Client,
    model_job: tuple[str, Path],
    tmp_path: Path,
    damage: str,
) -> None:
    job_id, model = model_job
    weights = model / "weights.pt"
    if damage == "altered":
        data = bytearray(weights.read_bytes())
        data[-100] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "linked-weights":  # the same bytes, but through a link out of the run
        copy = tmp_path / "weights.pt"
        shutil.copy(weights, copy)
        weights.unlink()
        weights.symlink_to(copy)
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        shutil.move(model, tmp_path / "model")
        model.symlink_to(tmp_path / "model")
    response = http.get(f"/jobs/{job_id}/model")
    assert response.status_code == 409, response.text
    detail = response.json()["detail"]
    assert (
        "not served" in detail and str(api.data_dir) not in detail and str(tmp_path) not in detail
    )
    if damage != "model-dir-link":
        assert f"jobs/{job_id}/run/model/weights.pt" in detail  # relative to the data directory


def test_an_artifact_reached_through_a_link_is_not_served(
    api: LocalService, client: ServiceClient, http: httpx.Client
) -> None:
    job = client.submit("link", tiny_job())
    run = api.data_dir / "jobs" / job["id"] / "run"
    run.mkdir(exist_ok=True)
    (run / "real.txt").write_text("ok")
    (run / "alias.txt").symlink_to("real.txt")  # even inside the run: a link is not served
    assert http.get(f"/jobs/{job['id']}/artifacts/real.txt").text == "ok"
    assert http.get(f"/jobs/{job['id']}/artifacts/alias.txt").status_code == 404
    drop(http, client, job["id"])


# ----------------------------------------------------------- item 7: strict request schemas
def score_body(**config: Any) -> dict[str, Any]:
    return {
        "name": "score",
        "kind": "score",
        "config": {"model_job": "0123456789abcdef", "inputs": ["x.tsv"], **config},
    }


def same_connection(api: LocalService, first: bytes) -> tuple[int, str, int]:
    """POST ``first`` as a job body, then GET /health on the same connection: the first
    status and body, and the second status (the connection must survive the first)."""
    parts = urlsplit(api.base_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    headers = {"Authorization": f"Bearer {api.token}", "Content-Type": "application/json"}
    try:
        conn.request("POST", "/api/v1/jobs", body=first, headers=headers)
        response = conn.getresponse()
        status, text = response.status, response.read().decode()
        assert not response.will_close, "the service closed the connection"
        sock = conn.sock
        conn.request("GET", "/api/v1/health")
        second = conn.getresponse()
        second.read()
        assert conn.sock is sock  # the same connection answered
        return status, text, second.status
    finally:
        conn.close()


def test_a_nul_byte_in_a_score_input_is_a_422_and_the_connection_lives(
    api: LocalService,
) -> None:
    status, text, then = same_connection(
        api, json.dumps(score_body(inputs=["a\x00b.tsv"])).encode()
    )
    assert status == 422, text
    assert json.loads(text)["detail"][0]["field"] == "config.inputs.0"
    assert then == 200


@pytest.mark.parametrize("name", ["x" * 256, "dir/" + "y" * 300 + "/z.tsv"])
def test_a_score_input_name_too_long_for_the_os_is_a_422(
    api: LocalService, http: httpx.Client, name: str
) -> None:
    assert_refused(api, http, score_body(inputs=[name]), "config.inputs.0", "255 bytes")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "x", "config": tiny_job(), "timeout_s": True}, "timeout_s"),
        ({"name": "x", "config": tiny_job(), "timeout_s": "5"}, "timeout_s"),
        (score_body(skip_bad_rows="yes"), "config.skip_bad_rows"),
        (score_body(skip_bad_rows=1), "config.skip_bad_rows"),
        (score_body(timeout_s=True), "config.timeout_s"),
        ({**score_body(), "timeout_s": True}, "timeout_s"),
        (score_body(model_job=1234), "config.model_job"),
        ({"name": 5, "config": tiny_job()}, "name"),
        ({"name": "x", "config": {**tiny_job(), "run": {"tensorboard": "yes"}}},
         "config.run.tensorboard"),
        ({"name": "x", "config": {**tiny_job(), "run": {"tensorboard": 1}}},
         "config.run.tensorboard"),
        ({"name": "x", "config": tiny_job(), "max_retries": True}, "max_retries"),
        ({"name": "x", "config": tiny_job(), "max_retries": "2"}, "max_retries"),
        ({"name": "x", "config": tiny_job(), "slurm": {"exclusive": "yes"}}, "slurm.exclusive"),
        ({"name": "x", "config": tiny_job(), "slurm": {"cpus_per_task": "8"}},
         "slurm.cpus_per_task"),
    ],
    ids=["timeout-true", "timeout-text", "skip-yes", "skip-1", "score-extra", "score-timeout",
         "model-job-int", "name-int", "tensorboard-yes", "tensorboard-1", "retries-true",
         "retries-text", "exclusive-yes", "cpus-text"],
)  # fmt: skip
def test_request_schemas_take_strict_types(
    api: LocalService, http: httpx.Client, body: dict[str, Any], field: str
) -> None:
    assert_refused(api, http, body, field)


@pytest.mark.parametrize(
    ("codec", "text"),
    [("utf-16", "caf\u00e9"), ("utf-16-le", "caf\u00e9"), ("utf-16-be", "caf\u00e9"),
     ("utf-32", "caf\u00e9"), ("latin-1", "caf\u00e9"),
     ("utf-16-le", "plain"), ("utf-32-be", "plain")],  # ASCII only: valid UTF-8, but NULs
    ids=["utf-16", "utf-16-le", "utf-16-be", "utf-32", "latin-1", "utf-16-le-ascii",
         "utf-32-be-ascii"],
)  # fmt: skip
def test_a_body_that_is_not_utf8_is_refused(
    api: LocalService, http: httpx.Client, codec: str, text: str
) -> None:
    body = json.dumps({"name": text, "config": tiny_job()}, ensure_ascii=False)
    issues = assert_refused(api, http, body.encode(codec), "body")
    assert issues[0]["type"] == "json_invalid"
    assert "UTF-8" in issues[0]["msg"]


def test_a_utf8_body_is_still_taken(
    api: LocalService, client: ServiceClient, http: httpx.Client
) -> None:
    body = json.dumps({"name": "caf\u00e9 \u2603", "config": tiny_job()}, ensure_ascii=False)
    response = post_raw(http, body.encode())
    assert response.status_code == 201, response.text
    assert response.json()["name"] == "caf\u00e9 \u2603"
    drop(http, client, response.json()["id"])


# ------------------------------------------------ item 10: access log, slow bodies, paths
@pytest.fixture(scope="module")
def chatty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    """A service that writes uvicorn's access log and allows a body 1 s to arrive."""
    env = {**FAST_ENV, "DLRM_VRGD_LOG_LEVEL": "info", "DLRM_VRGD_BODY_TIMEOUT_S": "1",
           "DLRM_VRGD_MAX_CONCURRENT_JOBS": "0"}  # fmt: skip
    svc = LocalService.start(
        tmp_path_factory.mktemp("chatty") / "data", secrets.token_urlsafe(24), env=env
    )
    yield svc
    svc.stop()


def test_a_token_in_the_query_string_is_not_in_the_access_log(chatty: LocalService) -> None:
    token = f"tok-{secrets.token_hex(8)}"
    url = f"{chatty.base_url}/api/v1/jobs?limit=3&token={token}"
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(f"{chatty.base_url}/api/v1/health?access_token={token}").status_code == 200
    log = ""
    deadline = time.monotonic() + 10
    while "health?access_token=***" not in log and time.monotonic() < deadline:
        time.sleep(0.1)
        log = chatty.log_path.read_text(errors="replace")
    assert "/api/v1/jobs?limit=3&token=*** HTTP/1.1" in log, log[-2000:]
    assert "health?access_token=***" in log
    assert token not in log


def raw_post(
    svc: LocalService, declared: int, sent: bytes, trickle_s: float = 0.0
) -> tuple[bytes, float]:
    """POST /jobs declaring ``declared`` body bytes but sending ``sent`` (one byte per
    ``trickle_s`` when set); what came back until the service closed, and how long it took."""
    parts = urlsplit(svc.base_url)
    head = (
        f"POST /api/v1/jobs HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Authorization: Bearer {svc.token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        start = time.monotonic()
        sock.sendall(head)
        if trickle_s:
            for byte in sent:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    break
                time.sleep(trickle_s)
        else:
            sock.sendall(sent)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        return got, time.monotonic() - start


def test_a_body_shorter_than_its_content_length_does_not_hold_the_connection(
    chatty: LocalService,
) -> None:
    got, took = raw_post(chatty, 1000, b'{"name": "x", ')
    assert got.startswith(b"HTTP/1.1 408"), got
    assert b"body_timeout" in got
    assert 0.9 < took < 4.0, took  # DLRM_VRGD_BODY_TIMEOUT_S=1, then the service closes


def test_a_body_trickled_byte_by_byte_is_bounded_too(chatty: LocalService) -> None:
    got, took = raw_post(chatty, 200, b"x" * 200, trickle_s=0.1)
    assert got.startswith(b"HTTP/1.1 408"), got
    assert took < 4.0, took


def test_a_whole_body_is_still_taken(chatty: LocalService) -> None:
    body = json.dumps({"name": "whole", "config": tiny_job()}).encode()
    got, _ = raw_post(chatty, len(body), body)
    assert got.startswith(b"HTTP/1.1 201"), got[:300]


def test_a_failed_jobs_error_shows_paths_relative_to_the_data_directory(
    start_service: Any, client_of: Any
) -> None:
    svc = start_service()
    client = client_of(svc)
    empty = svc.data_dir / "data" / "empty"
    empty.mkdir(parents=True)
    cfg = tiny_job()
    cfg["data"] = {"source": "criteo", "path": str(empty)}
    job = client.wait(client.submit("no data", cfg)["id"], timeout=240)
    assert job["state"] == "failed"
    assert "data/empty" in job["error"], job["error"]
    assert str(svc.data_dir) not in job["error"]


def test_the_archive_is_cut_short_when_a_file_differs_from_the_manifest(tmp_path: Path) -> None:
    """What the model route relies on when a file changes after the check."""
    import hashlib

    from service.jobs.files import tar_stream

    (tmp_path / "a.bin").write_bytes(b"abc")
    good = {"a.bin": {"bytes": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}}
    names = tar_names(b"".join(tar_stream(tmp_path, "m", good)))
    assert names == ["m/a.bin"]
    bad = {"a.bin": {"bytes": 3, "sha256": hashlib.sha256(b"abd").hexdigest()}}
    with pytest.raises(OSError, match="differs from the model's manifest"):
        b"".join(tar_stream(tmp_path, "m", bad))


def test_secrets_in_stored_jobs_are_masked_in_answers_and_events(
    api: LocalService, client: ServiceClient, http: httpx.Client
) -> None:
    """Defence in depth: a job row holding a credential (as an older release stored it) is
    masked in GET /jobs, GET /jobs/{id} and every event of its stream."""
    job = client.submit("stored secret", tiny_job())
    uri = f"http://me:{SECRET}@127.0.0.1:5000"
    config = {**job["config"]}
    config["run"] = {**config["run"], "mlflow": {"tracking_uri": uri, "experiment": "e"}}
    with sqlite3.connect(api.data_dir / "service.db", timeout=30) as conn:
        conn.execute(
            "UPDATE jobs SET config = ?, error = ? WHERE id = ?",
            (json.dumps(config), f"MLflow at {uri} failed", job["id"]),
        )
        conn.execute(
            "INSERT INTO records (job_id, seq, stream, data) VALUES (?, 1000000, 'state', ?)",
            (job["id"], json.dumps({"message": f"exporting to {uri}?token={SECRET}"})),
        )
    one = http.get(f"/jobs/{job['id']}")
    assert one.status_code == 200 and SECRET not in one.text
    assert one.json()["config"]["run"]["mlflow"]["tracking_uri"] == "http://***@127.0.0.1:5000"
    assert SECRET not in http.get("/jobs", params={"limit": 1000}).text
    client.cancel(job["id"])
    events = http.get(f"/jobs/{job['id']}/events", timeout=30).text
    assert "exporting to http://***@127.0.0.1:5000?token=***" in events
    assert SECRET not in events and "event: end" in events
    assert http.delete(f"/jobs/{job['id']}").status_code == 204
