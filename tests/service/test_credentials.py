"""Issue 39, items 1 and 6, through a real service whose jobs export to real HTTP listeners on
127.0.0.1: the service's MLflow credentials reach only the tracking servers the operator
allowed (DLRM_VRGD_MLFLOW_CREDENTIAL_SERVERS), and a server that echoes them back in its error
puts them in no output: not train.log on disk, not /logs, /result or result.json."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.launcher import LocalService

from .conftest import tiny_job

pytest.importorskip("mlflow")

USER = "alice-tracker"
SECRET = "s3cret-Pw-4242"
TOKEN = "tok-9f8e7d6c5b4a"


class Listener:
    """An HTTP server on 127.0.0.1 that records every request's Authorization header and
    answers 403 with an error that repeats it (what a careless tracking server does)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                auth = self.headers.get("Authorization")
                owner.seen.append({"path": self.path, "auth": auth, "body": body,
                                   "headers": str(self.headers)})  # fmt: skip
                decoded = ""
                if auth and auth.startswith("Basic "):
                    decoded = base64.b64decode(auth[6:]).decode(errors="replace")
                message = f"denied for {auth!r} ({decoded}) token={auth}"
                echo = json.dumps({"error_code": "PERMISSION_DENIED", "message": message}).encode()
                self.send_response(403)  # not retried by MLflow: its message reaches the job
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(echo)))
                self.end_headers()
                self.wfile.write(echo)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listeners() -> Iterator[Callable[[], Listener]]:
    made: list[Listener] = []

    def make() -> Listener:
        made.append(Listener())
        return made[-1]

    yield make
    for listener in made:
        listener.close()


def tracked_job(uri: str) -> dict[str, Any]:
    cfg = tiny_job()
    cfg["run"]["mlflow"] = {"tracking_uri": uri, "experiment": "e"}
    return cfg


def everything_about(svc: LocalService, job_id: str) -> dict[str, str]:
    """Every output of a finished job: its log on disk, its result on disk, and the API's
    job, /logs, /result and event stream."""
    root = svc.data_dir / "jobs" / job_id
    headers = {"Authorization": f"Bearer {svc.token}"}
    with httpx.Client(base_url=f"{svc.base_url}/api/v1", headers=headers, timeout=30) as http:
        out = {
            "train.log": (root / "train.log").read_text(errors="replace"),
            "result.json": (root / "run" / "result.json").read_text(errors="replace"),
            "/jobs/ID": http.get(f"/jobs/{job_id}").text,
            "/logs": http.get(f"/jobs/{job_id}/logs", params={"tail": 10_000}).text,
            "/logs?offset": http.get(f"/jobs/{job_id}/logs", params={"offset": 0}).text,
            "/result": http.get(f"/jobs/{job_id}/result").text,
            "/events": http.get(f"/jobs/{job_id}/events").text,
        }
    return out


def credentials(kind: str) -> tuple[dict[str, str], str, list[str]]:
    """(the service's environment, the Authorization header MLflow sends, the secrets)."""
    if kind == "basic":
        env = {"MLFLOW_TRACKING_USERNAME": USER, "MLFLOW_TRACKING_PASSWORD": SECRET}
        sent = "Basic " + base64.b64encode(f"{USER}:{SECRET}".encode()).decode()
        return env, sent, [SECRET, sent[6:]]
    return {"MLFLOW_TRACKING_TOKEN": TOKEN}, f"Bearer {TOKEN}", [TOKEN]


@pytest.mark.parametrize("kind", ["basic", "bearer"])
def test_credentials_go_only_to_the_servers_the_operator_allowed(
    start_service: Any, client_of: Any, listeners: Any, kind: str
) -> None:
    """One service with credentials in its environment, two tracking servers: the one on its
    allow-list gets them, the other (a token holder's) never sees them, and its job is told
    why."""
    allowed, other = listeners(), listeners()
    env, sent, secrets = credentials(kind)
    svc = start_service(
        DLRM_VRGD_MLFLOW_CREDENTIAL_SERVERS=f"https://mlflow.example.com,{allowed.url}",
        DLRM_VRGD_MAX_CONCURRENT_JOBS="2",
        **env,
    )
    client = client_of(svc)
    ok = client.submit("allowed", tracked_job(allowed.url))["id"]
    stolen = client.submit("elsewhere", tracked_job(other.url + "/"))["id"]
    for job_id in (ok, stolen):
        job = client.wait(job_id, timeout=300)
        assert job["state"] == "succeeded", job["error"]  # training goes on without MLflow

    # the token holder's listener was asked, but never with the service's credentials
    assert other.seen, "the job never reached the listener: the test proves nothing"
    for request in other.seen:
        assert request["auth"] is None, request
        assert not any(s in request["headers"] or s.encode() in request["body"] for s in secrets)
    # the allowed one got them (the control: the credentials were there to steal)
    assert allowed.seen and {r["auth"] for r in allowed.seen} == {sent}
    # the job that exported elsewhere was told why (its log and its events)
    outputs = everything_about(svc, stolen)
    assert "MLflow credentials withheld" in outputs["train.log"]
    assert "DLRM_VRGD_MLFLOW_CREDENTIAL_SERVERS" in outputs["/events"]
    assert "MLflow credentials withheld" not in everything_about(svc, ok)["train.log"]


def test_credentials_a_server_echoes_back_are_masked_in_every_output(
    start_service: Any, client_of: Any, listeners: Any
) -> None:
    """The allowed server answers with an error that repeats the password and the Basic
    header: train.log on disk, result.json on disk, /logs, /result, the job and its events
    hold the error, with the secrets masked."""
    server = listeners()
    env, _, secrets = credentials("basic")
    svc = start_service(DLRM_VRGD_MLFLOW_CREDENTIAL_SERVERS=server.url, **env)
    client = client_of(svc)
    job = client.wait(client.submit("echo", tracked_job(server.url))["id"], timeout=300)
    assert job["state"] == "succeeded", job["error"]
    assert server.seen, "the job never reached the server"
    outputs = everything_about(svc, job["id"])
    assert "denied for" in outputs["train.log"], outputs["train.log"][-3000:]
    assert "denied for" in json.loads(outputs["result.json"])["mlflow"]["error"]
    for where, text in outputs.items():
        for secret in secrets:
            assert secret not in text, f"{secret!r} in {where}"
    assert "***" in outputs["train.log"] and "***" in outputs["/result"]


def test_an_operator_origin_list_that_is_not_origins_stops_the_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {"DLRM_VRGD_MLFLOW_CREDENTIAL_SERVERS": "https://h/path?x=1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "serve", "--data-dir", str(tmp_path / "d"),
         "--port", "0"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "mlflow_credential_servers" in proc.stderr.lower() or "origin" in proc.stderr
    assert "Traceback" not in proc.stderr
