"""Issue 39, item 10, through real HTTP: a study's NaN hidden in a field its cells override
(``base.run.global_batch``, an optimizer's ``dense.lr``) is a 422 naming that field, and a
score input given twice (directly or through a directory that holds it) is a 422 naming the
second one, never scored twice."""

from __future__ import annotations

import copy
import json
import sqlite3
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from service.client import ServiceClient
from service.launcher import LocalService

from ....study.test_study import TINY
from ...conftest import tiny_job
from .test_hostile_input import assert_refused
from .test_security import drop


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (("base", "run", "global_batch"), "config.base.run.global_batch"),
        (("base", "run", "steps"), "config.base.run.steps"),
        (("base", "optim"), "config.base.optim.dense.lr"),
        (("optimizers", 0, "dense", "lr"), "config.optimizers.0.dense.lr"),
        (("optimizers", 1, "dense", "momentum"), "config.optimizers.1.dense.momentum"),
        (("optimizers", 0, "sparse", "weight_decay"), "config.optimizers.0.sparse.weight_decay"),
    ],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_number_anywhere_in_a_study_is_refused_naming_it(
    api: LocalService, http: httpx.Client, path: tuple[Any, ...], field: str, value: float
) -> None:
    study = copy.deepcopy(TINY)
    node: Any = study
    for key in path[:-1]:
        node = node[key] if isinstance(key, int) else node.setdefault(key, {})
    node[path[-1]] = {"dense": {"lr": value}} if path[-1] == "optim" else value
    assert_refused(api, http, {"name": "nan", "kind": "study", "config": study}, field)


@pytest.fixture(scope="module")
def model_job(api: LocalService, client: ServiceClient, http: httpx.Client) -> Iterator[str]:
    """A train job the store calls succeeded, with a model manifest (the score route only
    checks that it has one before the inputs)."""
    job = client.submit("model", tiny_job())
    model = api.data_dir / "jobs" / job["id"] / "run" / "model"
    model.mkdir(parents=True)
    (model / "manifest.json").write_text("{}")
    with sqlite3.connect(api.data_dir / "service.db", timeout=30) as conn:
        conn.execute("UPDATE jobs SET state = 'succeeded' WHERE id = ?", (job["id"],))
    root = api.data_dir / "data" / "dup"
    (root / "dir").mkdir(parents=True, exist_ok=True)
    for name in ("a.tsv", "dir/b.tsv", "dir/c.tsv"):
        (root / name).write_text("0\t1\n")
    (root / "alias.tsv").symlink_to("a.tsv")
    yield job["id"]
    with sqlite3.connect(api.data_dir / "service.db", timeout=30) as conn:
        conn.execute("UPDATE jobs SET state = 'cancelled' WHERE id = ?", (job["id"],))
    assert http.delete(f"/jobs/{job['id']}").status_code == 204


@pytest.mark.parametrize(
    "inputs",
    [
        ["dup/a.tsv", "dup/a.tsv"],
        ["dup/dir", "dup/dir/b.tsv"],
        ["dup/dir/c.tsv", "dup/dir"],
        ["dup/a.tsv", "dup/dir", "dup/alias.tsv"],
    ],
    ids=["same-file", "file-in-dir", "dir-after-file", "through-a-link"],
)
def test_a_score_input_given_twice_is_refused(
    api: LocalService, http: httpx.Client, model_job: str, inputs: list[str]
) -> None:
    body = {"name": "dup", "kind": "score", "config": {"model_job": model_job, "inputs": inputs}}
    issues = assert_refused(api, http, body, f"config.inputs.{len(inputs) - 1}")
    assert "config.inputs." in json.dumps(issues)


def test_distinct_score_inputs_are_taken(
    http: httpx.Client, client: ServiceClient, model_job: str
) -> None:
    inputs = ["dup/a.tsv", "dup/dir/b.tsv", "dup/dir/c.tsv"]
    body = {"name": "ok", "kind": "score", "config": {"model_job": model_job, "inputs": inputs}}
    response = http.post("/jobs", json=body)
    assert response.status_code == 201, response.text
    drop(http, client, response.json()["id"])
