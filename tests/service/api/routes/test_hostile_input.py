"""POST /jobs and the artifact routes against hostile input, through real HTTP: non-finite
numbers, bools for numbers, lengths that overflow, paths too long for the OS, bodies that cannot
be decoded, jobs too big for the host — each a 422 naming the field, never a 500, nothing stored.
A hypothesis property sends generated hostile configs."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from dlrm_vrgd.config import MAX_TABLE_ROWS
from service.client import ServiceClient
from service.launcher import LocalService

from ....hostile import hostile_configs, with_value
from ....study.test_study import TINY
from ...conftest import tiny_job


def stored(api: LocalService, http: httpx.Client) -> tuple[int, list[str]]:
    """What a refused request must leave alone: the number of jobs and every file and
    directory under jobs/ (hidden staging entries included)."""
    count = http.get("/jobs", params={"limit": 1}).json()["count"]
    root = api.data_dir / "jobs"
    return count, sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def post_raw(http: httpx.Client, body: dict[str, Any] | bytes) -> httpx.Response:
    """POST /jobs with the body as Python's json writes it (Infinity, NaN allowed)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post("/jobs", content=content, headers={"content-type": "application/json"})


def assert_refused(
    api: LocalService, http: httpx.Client, body: dict[str, Any] | bytes, field: str, words: str = ""
) -> list[dict[str, Any]]:
    before = stored(api, http)
    response = post_raw(http, body)
    assert response.status_code == 422, response.text
    issues = response.json()["detail"]
    assert field in [i["field"] for i in issues], issues
    assert words in " ".join(i["msg"] for i in issues if i["field"] == field)
    assert stored(api, http) == before
    return issues


@pytest.mark.parametrize(
    "field",
    ["optim.dense.lr", "optim.sparse.lr", "optim.dense.weight_decay", "optim.dense.eps",
     "optim.sparse.eps", "optim.dense.trust_coefficient", "data.signal_scale"],
)  # fmt: skip
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_numbers_are_refused(
    api: LocalService, http: httpx.Client, field: str, value: float
) -> None:
    assert_refused(api, http, {"name": "x", "config": with_value(field, value)}, f"config.{field}")


def test_a_bool_for_a_number_is_refused(api: LocalService, http: httpx.Client) -> None:
    body = {"name": "x", "config": with_value("optim.dense.lr", True)}
    assert_refused(api, http, body, "config.optim.dense.lr", "not a boolean")
    body = {"name": "x", "config": with_value("model.dense_arch", [16, True])}
    assert_refused(api, http, body, "config.model.dense_arch.1", "not a boolean")


@pytest.mark.parametrize("epochs", [float("inf"), 1e308, 1e6])
def test_a_training_length_that_overflows_is_refused(
    api: LocalService, http: httpx.Client, epochs: float
) -> None:
    cfg = with_value("run.epochs", epochs)
    cfg["run"].update(steps=None, global_batch=64, micro_batch=64)
    cfg["data"]["train_rows"] = 2**40
    assert_refused(api, http, {"name": "x", "config": cfg}, "config.run.epochs")


@pytest.mark.parametrize(
    "path", ["/" + "a" * 5000, "/" + "/".join(["b" * 255] * 20), "/tmp/" + "c" * 256]
)
def test_a_data_path_too_long_for_the_os_is_refused(
    api: LocalService, http: httpx.Client, path: str
) -> None:
    cfg = with_value("data", {"source": "criteo", "path": path})
    assert_refused(api, http, {"name": "x", "config": cfg}, "config.data.path", "longer than")


@pytest.mark.parametrize(
    "body",
    [
        b'{"name": "x", "config": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # nesting
        b'{"name": "x", "config": {}, "timeout_s": ' + b"7" * 5000 + b"}",  # 5,000 digits
        b'{"name": "\xff\xfe", "config": {}}',  # not UTF-8
        b"\xff" * 10,
    ],
    ids=["deep", "long number", "not utf-8 in a string", "not utf-8"],
)
def test_undecodable_bodies_answer_422_naming_body(
    api: LocalService, http: httpx.Client, body: bytes
) -> None:
    issues = assert_refused(api, http, body, "body")
    assert issues[0]["type"] == "json_invalid"


def test_a_job_bigger_than_the_host_is_refused_naming_the_fields(
    api: LocalService, http: httpx.Client
) -> None:
    cfg = with_value("data.cardinalities", [MAX_TABLE_ROWS] * 26)
    issues = assert_refused(
        api, http, {"name": "x", "config": cfg}, "config.data.cardinalities", "the job needs about"
    )
    assert [i["field"] for i in issues] == [
        "config.data.cardinalities",
        "config.model.embedding_dim",
    ]
    assert issues[1]["loc"] == ["body", "config", "model", "embedding_dim"]

    study = copy.deepcopy(TINY)
    study["base"]["data"]["cardinalities"] = [MAX_TABLE_ROWS] * 26
    body = {"name": "x", "kind": "study", "config": study}
    issues = assert_refused(api, http, body, "config.base.data.cardinalities", "study cell")
    assert "config.base.model.embedding_dim" in [i["field"] for i in issues]


def test_a_link_to_a_hidden_file_is_not_served(
    api: LocalService, client: ServiceClient, http: httpx.Client
) -> None:
    job = client.submit("links", tiny_job())
    run = api.data_dir / "jobs" / job["id"] / "run"
    (run / "checkpoints" / ".staging_step_00000002").mkdir(parents=True)
    (run / "checkpoints" / ".staging_step_00000002" / "rank0.pt").write_bytes(b"partial")
    (run / ".secret").write_text("hidden")
    os.symlink(".secret", run / "visible.txt")
    os.symlink("checkpoints/.staging_step_00000002/rank0.pt", run / "rank0.pt")
    (run / "plain.txt").write_text("ok")
    for name in ("visible.txt", "rank0.pt"):
        response = http.get(f"/jobs/{job['id']}/artifacts/{name}")
        assert response.status_code == 404, response.text
        assert "hidden" not in response.text and "partial" not in response.text
    assert http.get(f"/jobs/{job['id']}/artifacts/plain.txt").text == "ok"
    assert [a["path"] for a in client.artifacts(job["id"])["data"]] == ["plain.txt"]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(config=hostile_configs)
def test_hostile_configs_never_give_a_500_or_leave_a_file(
    api: LocalService, http: httpx.Client, client: ServiceClient, config: dict[str, Any]
) -> None:
    before = stored(api, http)
    response = post_raw(http, {"name": "hostile", "config": config})
    assert response.status_code in (201, 422), response.text
    if response.status_code == 422:
        issues = response.json()["detail"]
        assert issues and all(i["field"] and i["msg"] for i in issues)
        assert "Traceback" not in response.text
        assert stored(api, http) == before
    else:  # a hostile value that is still valid: the job is stored whole; remove it
        job = response.json()
        assert (api.data_dir / "jobs" / job["id"] / "config.yaml").is_file()
        client.cancel(job["id"])
        assert http.delete(f"/jobs/{job['id']}").status_code == 204
        assert stored(api, http) == before


def test_the_service_log_holds_no_traceback(api: LocalService) -> None:
    assert "Traceback" not in Path(api.log_path).read_text(errors="replace")
