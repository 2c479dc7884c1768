"""Issue 39, item 2, through real HTTP: ``run.mlflow.artifact_location`` is read as MLflow will
use it. ``c:/../../outside`` is a local path to MLflow on Linux (relative to the job's working
directory), so it is held to the MLflow directory like any local path; any other scheme must
lie at or below one of the operator's roots (DLRM_VRGD_MLFLOW_ARTIFACT_ROOTS)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from service.client import ServiceClient
from service.launcher import LocalService

from ...conftest import FAST_ENV, tiny_job
from .test_hostile_input import assert_refused, post_raw
from .test_security import drop

FIELD = "config.run.mlflow.artifact_location"


def with_location(location: str) -> dict[str, Any]:
    cfg = tiny_job()
    cfg["run"]["mlflow"] = {"tracking_uri": "http://127.0.0.1:5000", "artifact_location": location}
    return {"name": "artifacts", "config": cfg}


@pytest.mark.parametrize(
    "location",
    [
        "c:/../../../../../../../tmp/outside/art_escape",  # the attack: a local path to MLflow
        "C:/tmp/x",
        "d:relative/dir",
        "z:",
        "s3://bucket/x",  # no root set: nothing remote
        "mlflow-artifacts://attacker.example/x",
        "mlflow-artifacts:/x",
        "gs://b/x",
        "hdfs://namenode/x",
        "relative/dir",
        "./mlruns",
    ],
)
def test_locations_outside_the_mlflow_directory_and_the_roots_are_refused(
    api: LocalService, http: httpx.Client, location: str
) -> None:
    issues = assert_refused(api, http, with_location(location), FIELD)
    assert str(api.data_dir) not in str(issues)


def test_a_local_location_under_the_mlflow_directory_is_taken(
    api: LocalService, client: ServiceClient, http: httpx.Client
) -> None:
    for location in (f"{api.data_dir}/mlflow/art", f"file://{api.data_dir}/mlflow/art2"):
        response = post_raw(http, with_location(location))
        assert response.status_code == 201, response.text
        drop(http, client, response.json()["id"])


ROOTS = "s3://bucket/mlflow, mlflow-artifacts:/"


@pytest.fixture(scope="module")
def roots_http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A service (no runner) whose operator set artifact roots; raw HTTP to it."""
    env = {**FAST_ENV, "DLRM_VRGD_MAX_CONCURRENT_JOBS": "0",
           "DLRM_VRGD_MLFLOW_ARTIFACT_ROOTS": ROOTS}  # fmt: skip
    svc = LocalService.start(
        tmp_path_factory.mktemp("roots") / "data", secrets.token_urlsafe(24), env=env
    )
    headers = {"Authorization": f"Bearer {svc.token}"}
    with httpx.Client(base_url=f"{svc.base_url}/api/v1", headers=headers, timeout=30) as http:
        yield http
    svc.stop()


@pytest.mark.parametrize(
    ("location", "taken"),
    [
        ("s3://bucket/mlflow", True),
        ("s3://bucket/mlflow/exp/1", True),
        ("S3://bucket/mlflow/exp", True),
        ("mlflow-artifacts:/exp/1", True),
        ("s3://bucket/mlflow-other/x", False),  # a sibling of the root, not below it
        ("s3://bucket/other", False),
        ("s3://bucket/mlflow/../other", False),
        ("s3://bucket/mlflow/./x", False),
        ("s3://bucket/mlflow//x", False),
        ("s3://bucket.attacker/mlflow/x", False),
        ("s3://other-bucket/mlflow", False),
        ("s3://bucket/mlflow/%2e%2e/x", False),
        ("s3://bucket/mlflow/x\\..\\y", False),
        ("mlflow-artifacts://attacker.example/x", False),  # a host: MLflow would go there
        ("gs://bucket/mlflow", False),
        ("c:/../../outside", False),
    ],
)
def test_the_operators_roots_widen_it_exactly(
    roots_http: httpx.Client, location: str, taken: bool
) -> None:
    response = post_raw(roots_http, with_location(location))
    if taken:
        assert response.status_code == 201, response.text
    else:
        assert response.status_code == 422, response.text
        assert FIELD in [i["field"] for i in response.json()["detail"]]


def test_mlflow_reads_these_schemes_as_the_service_does() -> None:
    """The scheme the service checks is the one MLflow dispatches on (its own function)."""
    uri = pytest.importorskip("mlflow.utils.uri")
    from service.jobs.tracking import mlflow_scheme

    for location in ["c:/../x", "C:/x", "z:", "s3://b/x", "S3://b/x", "/abs", "rel/x",
                     "file:///x", "mlflow-artifacts:/x", "mlflow-artifacts://h/x", "gs://b",
                     "hdfs://n/x", "dbfs:/x", "runs:/r/x", "ab:/x"]:  # fmt: skip
        assert mlflow_scheme(location) == uri.get_uri_scheme(location).lower(), location
