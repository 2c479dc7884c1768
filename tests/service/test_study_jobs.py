"""Study jobs: submitted, tracked and read back like training jobs (a real service, a real
study)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import httpx
import pytest

from service.client import ServiceClient
from service.launcher import LocalService

from ..study.test_study import TINY
from .conftest import wait_for


def small_study() -> dict:
    study = copy.deepcopy(TINY)
    study.update(batch_sizes=[128, 256], lr_multipliers=[1.0], seeds=[0], steps_at_largest=2)
    return study


def test_a_study_job_runs_and_publishes_its_report(
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    svc = start_service()
    client = client_of(svc)
    job = client.submit("study", small_study(), kind="study")
    assert job["kind"] == "study" and job["progress"]["total_steps"] == 4  # 2 x 2 x 1 x 1 cells
    done = wait_for(
        lambda: (j := client.job(job["id"]))["state"] in ("succeeded", "failed") and j, timeout=240
    )
    assert done["state"] == "succeeded", done["error"]
    assert done["progress"]["step"] == 4 and done["progress"]["fraction"] == 1.0
    cells = [r for r in client.metrics(job["id"])["data"] if r["kind"] == "cell"]
    assert [r["step"] for r in cells] == [1, 2, 3, 4]
    result = client.result(job["id"])
    assert result["cells_finished"] == 4 and len(result["summary"]) == 4
    listed = {a["path"] for a in client.artifacts(job["id"])["data"]}
    assert {"results.md", "results.csv", "auc_vs_batch.png"} <= listed
    assert any(p.startswith("cells/G256-vrsgd-") for p in listed)
    assert "| 256 |" in client.download(job["id"], "results.md").decode()
    assert [j["id"] for j in client.jobs(kind="study")["data"]] == [job["id"]]
    assert client.jobs(kind="train")["count"] == 0


@pytest.mark.parametrize(
    "change,field",
    [
        ({"seedz": [1]}, "config.seedz"),
        ({"batch_sizes": [96, 256]}, "config"),
        ({"lr_multipliers": [-1.0]}, "config.lr_multipliers.0"),
    ],
)
def test_bad_study_configs_answer_422_naming_the_field(
    start_service: Callable[..., LocalService], change: dict, field: str
) -> None:
    svc = start_service()
    body = {"name": "bad", "kind": "study", "config": {**small_study(), **change}}
    headers = {"Authorization": f"Bearer {svc.token}"}
    response = httpx.post(f"{svc.base_url}/api/v1/jobs", json=body, headers=headers, timeout=30)
    assert response.status_code == 422
    assert field in [d["field"] for d in response.json()["detail"]]
    assert httpx.get(f"{svc.base_url}/api/v1/jobs", headers=headers).json()["count"] == 0
