"""A run whose loss turns NaN is a failed job in the service (real service, real trainer):
the error names the step, the last good checkpoint stays downloadable, no result."""

from __future__ import annotations

from collections.abc import Callable

from service.client import ServiceClient
from service.launcher import LocalService

from ..conftest import tiny_config_dict


def test_a_nan_loss_makes_the_job_fail_naming_the_step(
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    client = client_of(start_service())
    config = tiny_config_dict(
        run={"steps": 6, "checkpoint_every": 2},
        optim={"dense": {"name": "sgd", "lr": 1e6}, "sparse": {"name": "sgd", "lr": 1e6}},
    )
    job = client.wait(client.submit("exploding", config)["id"], timeout=240)
    assert job["state"] == "failed" and job["has_result"] is False
    assert "error: step 3: the loss is nan (not finite)" in job["error"]
    assert job["progress"]["step"] == 2
    paths = [a["path"] for a in client.artifacts(job["id"])["data"]]
    assert "checkpoints/step_00000002/rank0.pt" in paths
    assert not [p for p in paths if p.startswith("checkpoints/step_00000004")]
    assert "status.json" in paths
