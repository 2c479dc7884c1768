"""/jobs: submit, list, get, cancel, delete; validation (422 naming the field), auth (401),
unknown ids (404), illegal transitions (409) — and bad requests change nothing."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from service.client import ApiError, ServiceClient
from service.launcher import LocalService

from ...conftest import tiny_job
from ..conftest import snapshot

JOB_ROUTES = [
    ("GET", "/jobs/{id}"),
    ("POST", "/jobs/{id}/cancel"),
    ("DELETE", "/jobs/{id}"),
    ("GET", "/jobs/{id}/metrics"),
    ("GET", "/jobs/{id}/gsnr"),
    ("GET", "/jobs/{id}/events"),
    ("GET", "/jobs/{id}/logs"),
    ("GET", "/jobs/{id}/result"),
    ("GET", "/jobs/{id}/artifacts"),
    ("GET", "/jobs/{id}/artifacts/result.json"),
]


def _with(path: str, value: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(tiny_job())
    node = cfg
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value
    return cfg


@pytest.fixture(scope="module")
def queued(client: ServiceClient) -> Iterator[dict[str, Any]]:
    yield client.submit("queued one", tiny_job())


def test_submit_answers_201_with_the_resolved_config(http: httpx.Client) -> None:
    response = http.post("/jobs", json={"name": "  spaced  ", "config": tiny_job()})
    assert response.status_code == 201
    job = response.json()
    assert response.headers["location"] == f"/api/v1/jobs/{job['id']}"
    assert job["name"] == "spaced" and job["kind"] == "train" and job["state"] == "queued"
    assert job["config"]["optim"]["dense"]["gamma"] == 0.1  # defaults filled in
    assert job["progress"]["total_steps"] == 4 and job["has_result"] is False
    assert http.get(f"/jobs/{job['id']}").json() == job


def test_list_filters_and_pages(client: ServiceClient) -> None:
    ids = [client.submit(f"paging-{i}", tiny_job())["id"] for i in range(3)]
    page = client.jobs(name="paging-", limit=2)
    assert page["count"] == 3 and [j["id"] for j in page["data"]] == ids[::-1][:2]
    rest = client.jobs(name="paging-", limit=2, offset=2)
    assert [j["id"] for j in rest["data"]] == ids[:1]
    assert client.jobs(name="paging-", state="succeeded")["count"] == 0
    assert client.jobs(name="paging-", state=["queued", "running"])["count"] == 3
    assert client.jobs(name="100%_")["count"] == 0  # LIKE wildcards are literal


BAD_BODIES = [
    ("unknown config key", {"name": "x", "config": _with("optim.dense.lrr", 1)},
     "config.optim.dense.lrr", ""),
    ("negative lr", {"name": "x", "config": _with("optim.dense.lr", -0.1)},
     "config.optim.dense.lr", "greater than 0"),
    ("batch not divisible", {"name": "x", "config": _with("run.micro_batch", 100)},
     "config.run", "micro_batch"),
    ("bad data field", {"name": "x", "config": _with("data.train_rows", 0)},
     "config.data.train_rows", ""),
    ("unknown top-level key", {"name": "x", "config": tiny_job(), "colour": "red"}, "colour", ""),
    ("missing name", {"config": tiny_job()}, "name", ""),
    ("blank name", {"name": "  ", "config": tiny_job()}, "name", ""),
    ("long name", {"name": "n" * 201, "config": tiny_job()}, "name", ""),
    ("bad timeout", {"name": "x", "config": tiny_job(), "timeout_s": -1}, "timeout_s", ""),
    ("unknown kind", {"name": "x", "kind": "dance", "config": tiny_job()}, "kind", ""),
    ("criteo path missing", {"name": "x", "config": _with("data", {"source": "criteo",
     "path": "/nonexistent/criteo"})}, "config.data.path", "no such directory"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "body", "field", "words"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES]
)
def test_bad_input_answers_422_naming_the_field_and_stores_nothing(
    api: LocalService, http: httpx.Client, case: str, body: dict, field: str, words: str
) -> None:
    before = snapshot(http, api.data_dir)
    response = http.post("/jobs", json=body)
    assert response.status_code == 422, response.text
    issues = response.json()["detail"]
    assert field in [i["field"] for i in issues], issues
    assert words in " ".join(i["msg"] for i in issues if i["field"] == field)
    assert snapshot(http, api.data_dir) == before


def test_oversize_and_malformed_bodies_answer_422_on_body(
    api: LocalService, http: httpx.Client
) -> None:
    before = snapshot(http, api.data_dir)
    big = {"name": "x", "config": tiny_job(), "pad": "x" * 70_000}
    response = http.post("/jobs", json=big)
    assert response.status_code == 422
    assert response.json()["detail"][0]["field"] == "body"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts streamed bytes
        yield b'{"name": "x", "pad": "'
        for _ in range(20):
            yield b"y" * 4096
        yield b'"}'

    response = http.post("/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["detail"][0]["field"] == "body"
    response = http.post(
        "/jobs", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422 and response.json()["detail"][0]["field"] == "body"
    assert snapshot(http, api.data_dir) == before


def test_bad_query_parameters_answer_422_naming_them(http: httpx.Client, queued: dict) -> None:
    assert http.get("/jobs", params={"limit": 0}).json()["detail"][0]["field"] == "limit"
    assert http.get("/jobs", params={"state": "sleeping"}).json()["detail"][0]["field"] == "state"
    r = http.get(f"/jobs/{queued['id']}/metrics", params={"max_points": -1})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "max_points"


@pytest.mark.parametrize(("method", "route"), JOB_ROUTES + [("GET", "/jobs"), ("POST", "/jobs")])
def test_every_route_but_health_needs_the_token(
    api: LocalService,
    anon: httpx.Client,
    http: httpx.Client,
    queued: dict,
    method: str,
    route: str,
) -> None:
    before = snapshot(http, api.data_dir)
    url = route.format(id=queued["id"])
    body = {"name": "x", "config": tiny_job()} if method == "POST" and route == "/jobs" else None
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {api.token}"}):
        response = anon.request(method, url, json=body, headers=headers)
        assert response.status_code == 401, (url, headers, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
    assert snapshot(http, api.data_dir) == before


@pytest.mark.parametrize(("method", "route"), JOB_ROUTES)
def test_unknown_ids_answer_404(http: httpx.Client, method: str, route: str) -> None:
    response = http.request(method, route.format(id="0123456789abcdef"))
    assert response.status_code == 404
    assert "0123456789abcdef" in response.json()["detail"]


def test_cancel_and_delete_follow_the_state_machine(
    api: LocalService, client: ServiceClient, http: httpx.Client
) -> None:
    job = client.submit("to cancel", tiny_job())
    response = http.delete(f"/jobs/{job['id']}")
    assert response.status_code == 409 and "queued" in response.json()["detail"]
    cancelled = client.cancel(job["id"])
    assert cancelled["state"] == "cancelled" and cancelled["finished_at"]

    before = snapshot(http, api.data_dir)
    response = http.post(f"/jobs/{job['id']}/cancel")
    assert response.status_code == 409 and "already cancelled" in response.json()["detail"]
    assert snapshot(http, api.data_dir) == before

    job_dir = api.data_dir / "jobs" / job["id"]
    assert (job_dir / "config.yaml").is_file()
    assert http.delete(f"/jobs/{job['id']}").status_code == 204
    assert not job_dir.exists()
    with pytest.raises(ApiError) as err:
        client.job(job["id"])
    assert err.value.status_code == 404
