"""How the Slurm backend classifies a failed job, against a real two-node Slurm
(tests/slurm_cluster.py) through a real ``dlrm-vrgd serve`` over HTTP: a rank's own Python
error raised mid-training, after collectives have run, is the job's failure (never retried as
the lost peer its surviving rank reports)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from service.client import API, ServiceClient
from service.launcher import LocalService

from ..slurm_cluster import SlurmCluster
from .conftest import long_job, python_hook_env, tiny_job, wait_for
from .test_slurm import OPTIM, marked_processes

pytestmark = pytest.mark.slurm

#: sitecustomize for every process: on node FAIL_RANK_ON_NODE, a torchrun worker's
#: ``Trainer.train_step`` raises once the trainer has taken FAIL_RANK_AT_STEP steps (each of
#: them all-reduced the dense statistics with the other node's rank).
FAIL_MID_TRAINING = """
import importlib.abc, importlib.util, os, sys
NODE = os.environ.get("FAIL_RANK_ON_NODE")
AT = int(os.environ.get("FAIL_RANK_AT_STEP", "0"))
if NODE and os.environ.get("SLURMD_NODENAME") == NODE and "LOCAL_RANK" in os.environ:
    class _Patch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "dlrm_vrgd.train.loop":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                step = module.Trainer.train_step

                def train_step(self, *args, **kwargs):
                    if self.step >= AT:
                        raise RuntimeError(f"injected bug in the rank on {NODE} at step {AT}")
                    return step(self, *args, **kwargs)

                module.Trainer.train_step = train_step

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Patch())
"""


def test_a_ranks_error_after_collectives_ran_fails_the_job_without_a_retry(
    slurm: SlurmCluster,
    slurm_env: dict[str, str],
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
    tmp_path: Path,
) -> None:
    """The rank on n2 raises RuntimeError after 12 steps; the rank on n1, inside the next
    step's all-reduce, sees its peer gone ("Connection closed by peer"). That symptom is the
    peer's, not a cause: the job fails once (max_retries 2 left unused), naming n2's error."""
    env = python_hook_env(
        tmp_path, FAIL_MID_TRAINING, **slurm_env, FAIL_RANK_ON_NODE="n2", FAIL_RANK_AT_STEP="12"
    )
    svc = start_service(**env)
    client = client_of(svc)
    run = {**long_job()["run"], "nnodes": 2, "threads": 1}
    job = client.submit("bug-mid-run", long_job() | {"run": run, "optim": OPTIM}, max_retries=2)
    failed = client.wait(job["id"], timeout=180)
    assert failed["state"] == "failed", failed
    log = (svc.data_dir / "jobs" / job["id"] / "train.log").read_text()
    assert "injected bug in the rank on n2 at step 12" in log
    steps = [r["step"] for r in client.metrics(job["id"], kind="train", limit=1000)["data"]]
    assert steps and max(steps) >= 12, steps  # the ranks trained together first
    assert failed["attempt"] == 1 and len(failed["attempts"]) == 1, failed["attempts"]
    assert "RuntimeError: injected bug in the rank on n2 at step 12" in failed["error"]
    assert "infrastructure" not in failed["error"]
    jobcomp = (slurm.root / "jobcomp.txt").read_text()
    assert jobcomp.count(f"Name=dlrm-vrgd-{job['id']} ") == 1  # submitted once
    assert not marked_processes(job["id"])


def test_options_that_raise_a_job_above_others_are_refused_and_lowering_is_kept(
    slurm: SlurmCluster,
    slurm_env: dict[str, str],
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    """The service submits for every token holder, possibly as root, for whom Slurm honours
    ``--priority`` and a negative ``--nice`` (this cluster did: priority 4000000, nice -1000).
    Per job they are refused (422 naming slurm.extra_flags, nothing stored, nothing in Slurm);
    a positive nice, which only lowers the job, reaches Slurm."""
    client = client_of(start_service(**slurm_env))
    before = set(slurm.list_jobs())  # earlier tests' ended jobs stay listed a while
    for flags in (
        ["--priority=4000000"],
        ["--priority=TOP"],
        ["--nice=-1000"],
        ["--nice=-1"],
        ["--nice=1e9"],
        ["--nice=5\n"],  # a newline would end the #SBATCH line
    ):
        refused = client.http.post(
            f"{API}/jobs",
            json={"name": "jump", "config": tiny_job(), "slurm": {"extra_flags": flags}},
        )
        assert refused.status_code == 422, (flags, refused.text)
        issue = refused.json()["detail"][0]
        assert issue["field"] == "slurm.extra_flags", issue
        assert "raise" in issue["msg"] or "not --flag" in issue["msg"], issue
    assert client.jobs()["count"] == 0
    assert set(slurm.list_jobs()) == before  # nothing reached Slurm
    kept = client.http.post(
        f"{API}/jobs",
        json={"name": "polite", "config": long_job(), "slurm": {"extra_flags": ["--nice=10"]}},
    )
    assert kept.status_code == 201, kept.text
    job = wait_for(lambda: (j := client.job(kept.json()["id"]))["slurm_job_id"] and j)
    assert slurm.squeue_field(job["slurm_job_id"], "%y") == "10"  # Slurm's nice
    client.cancel(job["id"])


#: ``scontrol`` for the service: the real one, except that ``ping`` does not answer while
#: FREEZE_PING_FILE exists (as a frozen controller does, up to Slurm's MessageTimeout).
FROZEN_PING = """#!/bin/bash
if [ "$1" = ping ] && [ -e "$FREEZE_PING_FILE" ]; then exec sleep 90; fi
exec {scontrol} "$@"
"""


def test_a_frozen_controller_does_not_hold_back_the_metrics_of_running_jobs(
    slurm: SlurmCluster,
    slurm_env: dict[str, str],
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
    tmp_path: Path,
) -> None:
    """slurmctld SIGSTOPped under a running job, its ``scontrol ping`` unanswered for the
    service's whole 60 s command timeout: the job runs on (slurmd does not need the
    controller) and its metrics keep reaching the API. The old runner asked ``scontrol
    ping`` in the loop that also ingests metrics: nothing came in for a whole timeout."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "scontrol"
    wrapper.write_text(FROZEN_PING.format(scontrol=shutil.which("scontrol")))
    wrapper.chmod(0o755)
    freeze = tmp_path / "freeze"
    env = {
        **slurm_env,
        "DLRM_VRGD_SLURM_COMMAND_TIMEOUT_S": "60",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FREEZE_PING_FILE": str(freeze),
    }
    client = client_of(start_service(**env))
    job = client.submit("frozen-ctld", long_job())

    def step() -> int:
        return client.job(job["id"])["progress"].get("step") or 0

    wait_for(lambda: step() >= 3, timeout=120)
    freeze.touch()
    slurm.pause_controller()
    try:
        time.sleep(2.5)  # the service's last answer from the controller is older than its cache
        frozen_at = step()
        # well inside the 60 s each ping now takes: only an ingestion that does not wait on
        # the controller gets here
        wait_for(lambda: step() >= frozen_at + 20, timeout=40, every=0.5)
        assert client.job(job["id"])["state"] == "running"
    finally:
        freeze.unlink()
        slurm.resume_controller()
    client.cancel(job["id"])
