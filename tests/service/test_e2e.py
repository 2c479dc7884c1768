"""End to end against real ``dlrm-vrgd serve`` processes and real trainer jobs: submit, watch,
read series and results, download artifacts; cancel; SIGKILL the service mid-job and restart."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable

from service.client import ServiceClient
from service.jobs.backends import process
from service.launcher import LocalService

from .conftest import job_pids, long_job, tiny_job, wait_for


def test_a_tiny_job_runs_to_success_and_leaves_its_results(
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    svc = start_service()
    client = client_of(svc)
    job = client.submit("tiny", tiny_job(eval_every=2, checkpoint_every=2))
    assert job["state"] == "queued" and job["progress"]["total_steps"] == 4

    events = list(client.events(job["id"]))
    names = [e.event for e in events]
    assert names[0] == "job" and names[-1] == "end"
    states = [e.data["state"] for e in events if e.event == "state"]
    assert states == ["queued", "running", "succeeded"]
    steps = [e.data["step"] for e in events if e.event == "metrics" and e.data["kind"] == "train"]
    assert steps == [1, 2, 3, 4]
    ids = [e.id for e in events if e.id is not None]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)

    done = client.job(job["id"])
    assert done["state"] == "succeeded" and done["exit_code"] == 0 and done["has_result"]
    progress = done["progress"]
    assert progress["step"] == 4 and progress["fraction"] == 1.0
    assert 0.5 < progress["test_oracle_auc"] <= 1 and 0 < progress["test_auc"] <= 1

    metrics = client.metrics(job["id"])
    train = [r for r in metrics["data"] if r["kind"] == "train"]
    evals = [(r["split"], r["step"]) for r in metrics["data"] if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert evals == [("val", 2), ("val", 4), ("test", 4)]
    sampled = client.metrics(job["id"], kind="train", max_points=2)["data"]
    assert [r["step"] for r in sampled] == [1, 4]
    every = client.metrics(job["id"], kind="train", every=2)["data"]
    assert [r["step"] for r in every] == [1, 3]
    page = client.metrics(job["id"], limit=2)
    rest = client.metrics(job["id"], after=page["next_after"])
    assert [r["seq"] for r in page["data"] + rest["data"]] == [r["seq"] for r in metrics["data"]]

    gsnr = client.gsnr(job["id"])["data"]
    assert [r["step"] for r in gsnr] == [1, 2, 3, 4]
    assert gsnr[0]["tables"][0]["touched_rows"] > 0

    result = client.result(job["id"])
    assert result["steps"] == 4 and result["samples"] == 1024
    assert result["test"]["auc"] == progress["test_auc"]

    listed = {a["path"]: a["bytes"] for a in client.artifacts(job["id"])["data"]}
    assert {"result.json", "metrics.jsonl", "gsnr.jsonl", "config.json"} <= set(listed)
    manifest = "checkpoints/step_00000004/manifest.json"
    assert manifest in listed and "checkpoints/step_00000004/rank0.pt" in listed
    assert json.loads(client.download(job["id"], "result.json")) == result
    assert json.loads(client.download(job["id"], manifest))["step"] == 4
    blob = client.download(job["id"], "checkpoints/step_00000004/rank0.pt")
    assert len(blob) == listed["checkpoints/step_00000004/rank0.pt"]
    assert "test AUC" in client.logs(job["id"], tail=10)
    assert not job_pids(job["id"], done["pid"])


def test_cancel_ends_every_process_of_a_running_job(
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    svc = start_service()
    client = client_of(svc)
    job = client.submit("long", long_job())
    running = wait_for(lambda: (j := client.job(job["id"]))["progress"].get("step") and j)
    pid = running["pid"]
    assert running["state"] == "running" and process.is_alive(pid)
    assert pid in job_pids(job["id"], pid)

    cancelled = client.cancel(job["id"])
    assert cancelled["state"] == "cancelled" and cancelled["finished_at"]
    assert not process.is_alive(pid)
    assert not job_pids(job["id"], pid)
    assert client.metrics(job["id"], kind="train")["count"] >= 1  # what it did is kept


def test_a_job_outliving_a_sigkilled_service_is_reattached(
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    svc = start_service()  # one job at a time: the second one waits in the queue
    client = client_of(svc)
    attached = client.submit("keeps-running", long_job())
    queued = client.submit("queued", tiny_job())
    wait_for(lambda: (client.job(attached["id"])["progress"].get("step") or 0) >= 2)
    before = client.metrics(attached["id"])["count"]
    pid = client.job(attached["id"])["pid"]
    assert client.job(queued["id"])["state"] == "queued"

    svc.kill()  # SIGKILL: no shutdown code runs
    assert process.is_alive(pid)  # the job lives on in its own session

    svc2 = start_service(svc.data_dir, DLRM_VRGD_MAX_CONCURRENT_JOBS="2")
    client2 = client_of(svc2)
    job = client2.job(attached["id"])
    assert job["state"] == "running" and job["pid"] == pid
    note = _find_state_message(client2, attached["id"], "re-attached")
    assert f"process {pid}" in note
    wait_for(lambda: client2.metrics(attached["id"])["count"] > before + 2)  # still followed
    started = wait_for(lambda: (j := client2.job(queued["id"]))["pid"] and j)  # queue resumed
    assert started["state"] in ("running", "succeeded")
    assert client2.cancel(attached["id"])["state"] == "cancelled"
    assert not job_pids(attached["id"], pid)


def test_a_job_whose_process_died_with_the_service_is_reported_failed(
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    svc = start_service(DLRM_VRGD_MAX_CONCURRENT_JOBS="2")
    client = client_of(svc)
    done = client.submit("finished", tiny_job())
    orphan = client.submit("orphan", long_job())
    assert client.wait(done["id"], timeout=120)["state"] == "succeeded"
    wait_for(lambda: (client.job(orphan["id"])["progress"].get("step") or 0) >= 2)
    stored = client.metrics(orphan["id"])["data"]
    pid = client.job(orphan["id"])["pid"]

    svc.kill()
    os.killpg(pid, signal.SIGKILL)  # as if the machine had rebooted
    wait_for(lambda: not process.is_alive(pid))

    svc2 = start_service(svc.data_dir)
    client2 = client_of(svc2)
    failed = client2.job(orphan["id"])
    assert failed["state"] == "failed"
    assert "gone when the service restarted" in failed["error"]
    assert client2.metrics(orphan["id"])["data"][: len(stored)] == stored
    assert client2.result(done["id"])["steps"] == 4
    assert client2.job(done["id"])["progress"]["test_auc"] > 0
    listed = {j["id"]: j["state"] for j in client2.jobs()["data"]}
    assert listed == {done["id"]: "succeeded", orphan["id"]: "failed"}


def _find_state_message(client: ServiceClient, job_id: str, text: str) -> str:
    """The first state record message containing ``text`` on the job's event stream."""
    for n, event in enumerate(client.events(job_id)):
        message = event.data.get("message") if event.event == "state" else None
        if message and text in message:
            return message
        assert n < 10_000 and event.event != "end", f"no state message with {text!r}"
    raise AssertionError("event stream ended")
