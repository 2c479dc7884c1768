"""The Slurm backend against a real two-node Slurm (tests/slurm_cluster.py), through real
``dlrm-vrgd serve`` processes over HTTP: multi-node training equal to the local backend's,
cancel (pending and running), a SIGKILLed service, a rank failing on one node, Slurm's time
limit, more jobs than nodes, and Slurm going away. Skipped, loudly, where Slurm is not
installed (``.ci/run`` installs it)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from service.client import API, ApiError, ServiceClient, parse_sse
from service.jobs.backends import process
from service.jobs.backends.local import JOB_ENV
from service.launcher import LaunchError, LocalService, free_port

from ..dist_utils import final_state
from ..slurm_cluster import SlurmCluster
from .conftest import long_job, python_hook_env, tiny_job, wait_for
from .test_study_jobs import small_study

pytestmark = pytest.mark.slurm

#: Dense VR-Adam and GSNR row-wise Adagrad, as the distributed trainer tests use.
OPTIM = {
    "dense": {"name": "vradam", "lr": 0.01, "gamma": 0.3},
    "sparse": {"name": "gsnr_rowwise_adagrad", "lr": 0.1, "gamma": 0.3},
}


def state_messages(client: ServiceClient, job_id: str, quiet_s: float = 2.0) -> list[str]:
    """The messages of the job's state records so far (its event stream, read until quiet)."""
    messages = []
    try:
        with client.http.stream(
            "GET", f"{API}/jobs/{job_id}/events", timeout=httpx.Timeout(10, read=quiet_s)
        ) as response:
            for event in parse_sse(response.iter_lines()):
                if event.event == "state" and event.data.get("message"):
                    messages.append(event.data["message"])
                if event.event == "end":
                    break
    except httpx.ReadTimeout:
        pass
    return messages


def marked_processes(job_id: str) -> list[int]:
    """Processes of the job on either emulated node (both are this machine)."""
    return process.job_processes(-1, f"{JOB_ENV}={job_id}")


def rank_nodes(job_id: str) -> set[str]:
    """Emulated nodes on which a rank of the job (a torchrun worker) runs now."""
    nodes = set()
    for pid in marked_processes(job_id):
        try:
            env = dict(
                item.split("=", 1)
                for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                if "=" in item
            )
        except OSError:
            continue
        if "LOCAL_RANK" in env and "SLURMD_NODENAME" in env:
            nodes.add(env["SLURMD_NODENAME"])
    return nodes


def running_step(client: ServiceClient, job_id: str, step: int = 1) -> dict[str, Any] | None:
    job = client.job(job_id)
    return job if (job["progress"].get("step") or 0) >= step else None


def test_two_nodes_train_the_same_model_as_two_local_ranks(
    slurm: SlurmCluster,
    slurm_env: dict[str, str],
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
    tmp_path: Path,
) -> None:
    """2 nodes x 1 rank under srun + torchrun (c10d rendezvous on the first node's NodeAddr)
    and the local backend's 1 node x 2 ranks see the same rows: same parameters."""
    run = {"micro_batch": 32, "steps": 4, "checkpoint_every": 4, "threads": 1}
    local_svc = start_service(tmp_path / "local")
    slurm_svc = start_service(tmp_path / "slurm", **slurm_env)
    local, on_slurm = client_of(local_svc), client_of(slurm_svc)
    two_ranks = local.submit("local-2", tiny_job(nproc_per_node=2, **run) | {"optim": OPTIM})
    two_nodes = on_slurm.submit("slurm-2x1", tiny_job(nnodes=2, **run) | {"optim": OPTIM})

    done = on_slurm.wait(two_nodes["id"], timeout=180)
    assert done["state"] == "succeeded", done["error"]
    assert done["backend"] == "slurm" and done["slurm_job_id"]
    slurm_id = done["slurm_job_id"]
    assert "JobState=COMPLETED" in (slurm.jobcomp(slurm_id) or "")
    assert "NodeCnt=2" in (slurm.jobcomp(slurm_id) or "")
    ref = local.wait(two_ranks["id"], timeout=180)
    assert ref["state"] == "succeeded" and ref["backend"] == "local", ref["error"]

    job_dir = slurm_svc.data_dir / "jobs" / two_nodes["id"]
    script = (job_dir / "slurm.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "--rdzv_backend=c10d" in script
    assert '--rdzv_id="$SLURM_JOB_ID"' in script and "srun --ntasks-per-node=1" in script
    log = on_slurm.logs(two_nodes["id"], tail=400)
    assert f"Slurm job {slurm_id} on n[1-2], rendezvous at 127.0.0.1:" in log
    assert any(
        f"submitted to slurm as job {slurm_id}" in m
        for m in state_messages(on_slurm, two_nodes["id"])
    )

    steps = [r["step"] for r in on_slurm.metrics(two_nodes["id"], kind="train")["data"]]
    assert steps == [1, 2, 3, 4]
    ref_loss = [r["loss"] for r in local.metrics(two_ranks["id"], kind="train")["data"]]
    loss = [r["loss"] for r in on_slurm.metrics(two_nodes["id"], kind="train")["data"]]
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    dense_a, tables_a = final_state(local_svc.data_dir / "jobs" / two_ranks["id"] / "run", 4)
    dense_b, tables_b = final_state(job_dir / "run", 4)
    assert dense_a.keys() == dense_b.keys() and tables_a.keys() == tables_b.keys()
    assert len(list((job_dir / "run" / "checkpoints" / "step_00000004").glob("rank*.pt"))) == 2
    for name in dense_a:
        torch.testing.assert_close(dense_b[name], dense_a[name], rtol=1e-5, atol=1e-6)
    for name in tables_a:
        torch.testing.assert_close(tables_b[name], tables_a[name], rtol=1e-5, atol=1e-6)


def test_cancel_while_pending_and_while_running_ends_it_in_slurm(
    slurm: SlurmCluster,
    slurm_env: dict[str, str],
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    client = client_of(start_service(**slurm_env))
    running = client.submit(
        "long-2-nodes", long_job() | {"run": {**long_job()["run"], "nnodes": 2}}
    )
    pending = client.submit("waits", tiny_job())
    # running: a rank on each node
    wait_for(lambda: rank_nodes(running["id"]) == {"n1", "n2"}, timeout=120)
    job = wait_for(lambda: (j := client.job(pending["id"]))["slurm_job_id"] and j)
    assert job["state"] == "queued"
    assert slurm.squeue_state(job["slurm_job_id"]) == "PENDING"

    cancelled = client.cancel(pending["id"])
    assert cancelled["state"] == "cancelled" and cancelled["finished_at"]
    assert slurm.squeue_state(job["slurm_job_id"]) == "CANCELLED"
    assert cancelled["started_at"] is None

    slurm_id = client.job(running["id"])["slurm_job_id"]
    assert client.job(running["id"])["state"] == "running"
    cancelled = client.cancel(running["id"])
    assert cancelled["state"] == "cancelled", cancelled["error"]
    assert slurm.squeue_state(slurm_id) == "CANCELLED"
    assert not marked_processes(running["id"])  # on neither node
    with pytest.raises(ApiError) as err:
        client.cancel(running["id"])
    assert err.value.status_code == 409


FAIL_ON_NODE = """
import importlib.abc, os, sys
NODE = os.environ.get("FAIL_RANK_ON_NODE")
if NODE and os.environ.get("SLURMD_NODENAME") == NODE and "LOCAL_RANK" in os.environ:
    class _Fail(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "dlrm_vrgd.train.loop":
                raise RuntimeError(f"injected failure of the rank on node {NODE}")
            return None
    sys.meta_path.insert(0, _Fail())
"""


def test_a_rank_failing_on_one_node_fails_the_job_with_that_nodes_error(
    slurm: SlurmCluster,
    slurm_env: dict[str, str],
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
    tmp_path: Path,
) -> None:
    env = python_hook_env(tmp_path, FAIL_ON_NODE, **slurm_env, FAIL_RANK_ON_NODE="n2")
    client = client_of(start_service(**env))
    job = client.submit("one-node-fails", long_job() | {"run": {**long_job()["run"], "nnodes": 2}})
    failed = client.wait(job["id"], timeout=120)
    assert failed["state"] == "failed"
    error = failed["error"]
    assert f"Slurm job {failed['slurm_job_id']} FAILED" in error
    assert "srun: error: n2: task 1: Exited with exit code" in error
    assert "RuntimeError: injected failure of the rank on node n2" in error
    assert "JobState=FAILED" in (slurm.jobcomp(failed["slurm_job_id"]) or "")
    assert not marked_processes(job["id"])


def test_more_jobs_than_nodes_a_sigkilled_service_and_a_time_limit(
    slurm: SlurmCluster,
    slurm_env: dict[str, str],
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    """Three one-node jobs on two nodes (whole nodes each): the third (a study) waits in Slurm
    with its reason (no service concurrency limit applies: DLRM_VRGD_MAX_CONCURRENT_JOBS is 1).
    The service is SIGKILLed while one trains and the study is pending; restarted, it follows
    both again (never submitting one twice): the training succeeds with all its metrics, the
    study runs once a node is free. A job over its Slurm time limit (1 min) fails with
    TIMEOUT."""
    svc = start_service(**slurm_env)
    client = client_of(svc)
    over_time = client.submit("over-time", long_job(), timeout_s=30)  # Slurm: --time=1 (min)
    steps = 60
    first = client.submit("first", tiny_job(steps=steps))
    third = client.submit("study", small_study(), kind="study")  # one node: its cells run there
    wait_for(lambda: client.job(over_time["id"])["state"] == "running", timeout=60)
    wait_for(lambda: running_step(client, first["id"], 2), timeout=60)
    waiting = client.job(third["id"])
    assert waiting["state"] == "queued" and waiting["slurm_job_id"]
    assert slurm.squeue_state(waiting["slurm_job_id"]) == "PENDING"
    wait_for(
        lambda: "queued in Slurm: Resources" in state_messages(client, third["id"]),
        timeout=30,
        every=0.5,
    )

    svc.kill()  # SIGKILL: no shutdown code runs; the jobs live on in Slurm
    client2 = client_of(start_service(svc.data_dir, **slurm_env))
    done = client2.wait(first["id"], timeout=120)
    assert done["state"] == "succeeded", done["error"]
    train = client2.metrics(first["id"], kind="train")["data"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert done["progress"]["step"] == steps and done["progress"]["test_auc"] > 0
    slurm_id = done["slurm_job_id"]
    assert any(
        f"following Slurm job {slurm_id} again" in m for m in state_messages(client2, first["id"])
    )
    later = client2.wait(third["id"], timeout=180)
    assert later["state"] == "succeeded", later["error"]
    assert later["progress"]["step"] == 4 and client2.result(third["id"])["cells_finished"] == 4
    assert "srun --ntasks=1" in (svc.data_dir / "jobs" / third["id"] / "slurm.sbatch").read_text()
    assert later["slurm_job_id"] == waiting["slurm_job_id"]  # the same Slurm job
    assert later["started_at"] > done["started_at"]
    jobcomp = (slurm.root / "jobcomp.txt").read_text()
    for job in (first, third):
        assert jobcomp.count(f"Name=dlrm-vrgd-{job['id']} ") == 1  # submitted once

    script = (svc.data_dir / "jobs" / over_time["id"] / "slurm.sbatch").read_text()
    assert "#SBATCH --time=1" in script
    timed_out = client2.wait(over_time["id"], timeout=150)
    assert timed_out["state"] == "failed"
    assert timed_out["error"].startswith(
        f"Slurm job {timed_out['slurm_job_id']} TIMEOUT: the job reached its Slurm time limit"
    )
    assert "JobState=TIMEOUT" in (slurm.jobcomp(timed_out["slurm_job_id"]) or "")
    assert not marked_processes(over_time["id"])


def test_slurm_unreachable_refuses_to_start_and_answers_503_on_submit(
    slurm: SlurmCluster,
    slurm_env: dict[str, str],
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dead = tmp_path / "dead.conf"  # the same cluster, but a controller port nobody serves
    text = slurm.conf.read_text()
    port = next(ln for ln in text.splitlines() if ln.startswith("SlurmctldPort="))
    dead.write_text(text.replace(port, f"SlurmctldPort={free_port()}"))
    monkeypatch.setenv("SLURM_CONF", str(dead))
    with pytest.raises(LaunchError) as err:
        start_service(tmp_path / "refused", **slurm_env, DLRM_VRGD_SLURM_COMMAND_TIMEOUT_S="3")
    assert "the Slurm controller is unreachable" in str(err.value)
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))

    svc = start_service(**slurm_env, DLRM_VRGD_SLURM_COMMAND_TIMEOUT_S="1.5")
    client = client_of(svc)
    slurm.pause_controller()  # SIGSTOP: slurmctld stops answering
    try:
        time.sleep(2.5)  # the service's last look at Slurm is older than its cache
        with pytest.raises(ApiError) as refused:
            client.submit("refused", tiny_job())
        assert refused.value.status_code == 503
        assert "Slurm did not answer" in str(refused.value.detail)
        assert client.jobs()["count"] == 0  # nothing stored
    finally:
        slurm.resume_controller()
    # Slurm is back; a job on more nodes than the partition has is refused at submit (sinfo)
    too_big = wait_for(lambda: _submits(client), timeout=30, every=0.5)
    assert too_big.status_code == 422, too_big.text
    issue = too_big.json()["detail"][0]
    assert issue["field"] == "config.run.nnodes"
    assert "asks for 4 nodes; Slurm partition debug has 2 (PartitionNodeLimit" in issue["msg"]
    assert client.jobs()["count"] == 0


def _submits(client: ServiceClient) -> httpx.Response | None:
    response = client.http.post(
        f"{API}/jobs", json={"name": "four-nodes", "config": tiny_job(nnodes=4)}
    )
    if response.status_code == 503:
        return None
    return response


def test_a_node_down_mid_job_is_retried_and_resumes_from_its_checkpoint(
    slurm: SlurmCluster,
    slurm_env: dict[str, str],
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    """n2 goes DOWN under a two-node job (as in the outside check): Slurm ends it NODE_FAIL;
    the service says so on the job, submits it again (max_retries 1), and the second attempt
    resumes from the newest checkpoint in the same run directory once the node is back. The
    job succeeds with every train step once; both attempts are on the job and in its events."""
    svc = start_service(**slurm_env)
    client = client_of(svc)
    steps = 80
    config = tiny_job(nnodes=2, steps=steps, checkpoint_every=10, log_every=1, threads=1)
    job = client.submit("node-down", config | {"optim": OPTIM})
    run = svc.data_dir / "jobs" / job["id"] / "run"
    wait_for(lambda: running_step(client, job["id"], 25), timeout=240, every=0.2)
    running = client.job(job["id"])
    assert running["backend_state"] == "running on n[1-2]" and running["nodes"] == "n[1-2]"
    assert (
        running["attempt"] == 1 and running["attempts"][0]["backend_id"] == running["slurm_job_id"]
    )
    first_id = running["slurm_job_id"]
    assert list((run / "checkpoints").glob("step_*"))
    slurm.scontrol("update", "nodename=n2", "state=down", "reason=dlrm-vrgd-test")

    retried = wait_for(lambda: (j := client.job(job["id"]))["attempt"] == 2 and j, timeout=120)
    assert retried["state"] == "running" and retried["slurm_job_id"] != first_id
    ended = retried["attempts"][0]
    assert ended["ended"] == "NODE_FAIL on n2", ended
    assert "JobState=NODE_FAIL" in (slurm.jobcomp(first_id) or "")
    assert retried["backend_state"].startswith("requeued after NODE_FAIL on n2")
    # the newest checkpoint: a periodic one (every 10 steps), or the one the ranks wrote at
    # the step they agreed to stop after when Slurm's SIGTERM reached both (here both nodes
    # share a host, so n2's rank is alive to agree; a truly lost node leaves the periodic one)
    resumed = retried["attempts"][1]["resumed_from_step"]
    assert resumed >= 20
    # (which task hosts rank 0 is the rendezvous's choice, and srun drops a failed node's
    # output: the stop request, which every rank logs, is what the log is sure to show)
    interrupt_saved = "SIGTERM: stopping after this step and checkpointing it"
    slurm.heal()  # the node comes back; the second attempt can run

    done = client.wait(job["id"], timeout=300)
    assert done["state"] == "succeeded", done["error"]
    assert [a["attempt"] for a in done["attempts"]] == [1, 2]
    assert done["attempts"][1]["nodes"] == "n[1-2]" and done["attempts"][1]["ended"]
    train = client.metrics(done["id"], kind="train", limit=10_000)["data"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    messages = state_messages(client, job["id"])
    assert any(
        m.startswith(
            f"attempt 1 ended: NODE_FAIL on n2; attempt 2 of 2 resumes from step {resumed}"
        )
        for m in messages
    ), messages
    log = (svc.data_dir / "jobs" / job["id"] / "train.log").read_text()
    assert "Node failure on n2" in log
    assert resumed % 10 == 0 or interrupt_saved in log, log[-4000:]
    # every line of a rank keeps its label (progress too: plain lines, no redraws). The label
    # is srun's task id; which task hosts torchrun's rank 0 (the one printing progress) is up
    # to the c10d rendezvous, so it may be task 1.
    assert "\r" not in log
    progress = [ln for ln in log.splitlines() if re.search(rf"step \d+/{steps} loss", ln)]
    assert progress and all(re.match(r"[01]: ", ln) for ln in progress), log[-4000:]
    # ?task=T keeps the lines of srun task T, its progress among them: T is the task that
    # printed it (the other task may have printed nothing at all)
    task = progress[0].split(":")[0]
    lines = client.http.get(
        f"{API}/jobs/{job['id']}/logs", params={"task": task, "tail": 10_000}
    ).text.splitlines()
    assert lines and all(ln.startswith(f"{task}: ") for ln in lines), lines[-20:]
    assert {ln for ln in progress if ln.startswith(f"{task}: ")} <= set(lines)
    records = client.metrics(done["id"], limit=10_000)["data"]
    starts = [r for r in records if r["kind"] == "start"]  # one per attempt
    assert [r["start_step"] for r in starts] == [0, resumed]
    script = (svc.data_dir / "jobs" / job["id"] / "slurm.sbatch").read_text()
    assert "#SBATCH --no-requeue" in script and " --resume" in script


def test_infeasible_jobs_fail_with_slurms_reason_and_config_errors_are_not_retried(
    slurm: SlurmCluster,
    slurm_env: dict[str, str],
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
    tmp_path: Path,
) -> None:
    """A limit sinfo does not show (the partition's MaxNodes lowered to 1): Slurm holds the
    two-node job (PartitionNodeLimit); the job says "held: PartitionNodeLimit" and fails
    within DLRM_VRGD_SLURM_INFEASIBLE_AFTER_S with that reason. A config error (an empty
    Criteo directory: exit status 2) fails after one attempt though retries are left."""
    client = client_of(start_service(**slurm_env, DLRM_VRGD_SLURM_INFEASIBLE_AFTER_S="4"))
    assert "MaxNodes=1" in slurm.scontrol("update", "partitionname=debug", "MaxNodes=1") + (
        slurm.scontrol("show", "partition", "debug", "-o")
    )
    held = client.submit("held", tiny_job(nnodes=2))
    seen = wait_for(
        lambda: (j := client.job(held["id"]))["backend_state"] == "held: PartitionNodeLimit" and j,
        timeout=60,
    )
    assert seen["state"] == "queued"
    failed = client.wait(held["id"], timeout=60)
    assert failed["state"] == "failed", failed
    assert "Slurm cannot run this job as asked (PartitionNodeLimit)" in failed["error"]
    slurm.heal()

    empty = tmp_path / "no-criteo-files"
    empty.mkdir()
    config = tiny_job() | {"data": {"source": "criteo", "path": str(empty)}}
    bad = client.submit("bad-data", config, max_retries=2)
    done = client.wait(bad["id"], timeout=120)
    assert done["state"] == "failed" and done["exit_code"] == 2, done["error"]
    assert done["attempt"] == 1 and len(done["attempts"]) == 1
    assert f"Name=dlrm-vrgd-{bad['id']} " in (slurm.root / "jobcomp.txt").read_text()
    assert (slurm.root / "jobcomp.txt").read_text().count(f"Name=dlrm-vrgd-{bad['id']} ") == 1


def test_per_job_options_land_in_the_batch_script_and_one_submission_id_makes_one_job(
    slurm: SlurmCluster,
    slurm_env: dict[str, str],
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    svc = start_service(**slurm_env)
    client = client_of(svc)
    options = {
        "partition": "debug",
        "time": "0:10:00",
        "cpus_per_task": 1,
        "mem": "1G",
        "exclusive": False,
        "comment": "issue 27 check",
        "extra_flags": ["--nice=5"],
    }
    body = {"name": "opts", "config": tiny_job(), "slurm": options, "submission_id": "s-1"}
    first = client.http.post(f"{API}/jobs", json=body)
    again = client.http.post(f"{API}/jobs", json=body)
    assert (first.status_code, again.status_code) == (201, 200), again.text
    job = first.json()
    assert again.json()["id"] == job["id"] and job["slurm"] == options
    log = svc.data_dir / "jobs" / job["id"] / "train.log"
    wait_for(lambda: log.exists() and log.stat().st_size > 0, timeout=60)
    start = log.stat().st_size
    with client.http.stream(
        "GET",
        f"{API}/jobs/{job['id']}/logs",
        params={"offset": start, "follow": "true"},
        timeout=httpx.Timeout(120),
    ) as response:
        followed = b"".join(response.iter_bytes())  # until the job has ended
    shown = log.read_bytes()[start:].replace(f"{svc.data_dir}/jobs/".encode(), b"jobs/")
    assert followed and followed == shown  # new lines only, each once (paths relative)
    assert str(svc.data_dir).encode() not in followed
    done = client.wait(job["id"], timeout=120)
    assert done["state"] == "succeeded", done["error"]
    script = (svc.data_dir / "jobs" / job["id"] / "slurm.sbatch").read_text()
    for line in (
        "#SBATCH --partition=debug",
        "#SBATCH --time=0:10:00",
        "#SBATCH --cpus-per-task=1",
        "#SBATCH --mem=1G",
        '#SBATCH --comment="issue 27 check"',
        "#SBATCH --nice=5",
    ):
        assert line in script.splitlines(), (line, script)
    assert "#SBATCH --exclusive" not in script
    assert (slurm.root / "jobcomp.txt").read_text().count(f"Name=dlrm-vrgd-{job['id']} ") == 1
    assert client.jobs()["count"] == 1

    for bad, field in (
        ({"partition": "nosuch"}, "slurm.partition"),
        ({"cpus_per_task": 64}, "slurm.cpus_per_task"),
        ({"mem": "64G"}, "slurm.mem"),
        ({"extra_flags": ["--output=/etc/passwd"]}, "slurm.extra_flags"),
        ({"comment": "a\nb"}, "slurm.comment"),
        ({"time": "soon"}, "slurm.time"),
    ):
        refused = client.http.post(f"{API}/jobs", json={"name": "bad", "config": tiny_job(),
                                                        "slurm": bad})  # fmt: skip
        assert refused.status_code == 422, (bad, refused.text)
        assert refused.json()["detail"][0]["field"] == field, refused.json()
    assert client.jobs()["count"] == 1
