"""Which failures are retried (service/jobs/retry.py): the infrastructure's (a signal, a lost
rank or node, a collective timeout, Slurm's NODE_FAIL/PREEMPTED), never the job's own (exit
status 2, a NaN loss, its time limit), and from which step a retry resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlrm_vrgd import checkpoint as ckpt
from service.jobs.files import JobFiles
from service.jobs.retry import infrastructure_cause, resume_step

TORCHRUN_SUMMARY = [
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    "[1]:",
    "  rank      : 1 (local_rank: 1)",
    "  exitcode  : -9 (pid: 4242)",
    "  error_file: <N/A>",
    "  traceback : Signal 9 (SIGKILL) received by PID 4242",
]
NODE_FAIL = [
    "srun: error: Node failure on n2",
    "slurmstepd-n1: error: *** JOB 1 ON n1 CANCELLED DUE TO NODE FAILURE ***",
    "srun: error: n1: task 0: Terminated",
]
COLLECTIVE = [
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
]


@pytest.fixture
def files(tmp_path: Path) -> JobFiles:
    f = JobFiles(tmp_path / "job")
    f.run_dir.mkdir(parents=True)
    return f


@pytest.mark.parametrize(
    ("code", "lines", "state", "cause"),
    [
        (-9, [], None, "killed by SIGKILL"),
        (1, TORCHRUN_SUMMARY, None, "a rank was killed by SIGKILL"),
        (0, NODE_FAIL, "NODE_FAIL", "NODE_FAIL on n2"),
        (0, [], "PREEMPTED", "PREEMPTED"),
        (1, ["srun: error: n2: task 1: Killed"], "FAILED", "a task was killed (task 1 on n2)"),
        (1, COLLECTIVE, None, "a collective timed out or lost its peer"),
        (1, ["Watchdog caught collective operation timeout: WorkNCCL(...)"], None,
         "a collective timed out or lost its peer"),
    ],
)  # fmt: skip
def test_infrastructure_failures_are_retried(
    files: JobFiles, code: int, lines: list[str], state: str | None, cause: str
) -> None:
    assert infrastructure_cause(code, lines, files, state) == cause


@pytest.mark.parametrize(
    ("code", "lines", "state"),
    [
        (2, ["error: no such directory: /data/criteo"], None),  # a config / usage error
        (2, TORCHRUN_SUMMARY, None),  # exit 2 wins over any sign of a signal
        (1, ["RuntimeError: something in the model"], None),  # a plain bug: fails again
        (1, ["error: non-finite loss at step 7"], "FAILED"),
        (0, [], "TIMEOUT"),  # its own time limit
        (0, [], "OUT_OF_MEMORY"),
        (1, [], None),
        # the other ranks, ended by srun/torchrun once one failed: a consequence, not a cause
        (1, ["srun: error: n1: task 0: Terminated", "  exitcode  : -15 (pid: 7)"], "FAILED"),
    ],
)
def test_the_jobs_own_failures_are_not(
    files: JobFiles, code: int, lines: list[str], state: str | None
) -> None:
    assert infrastructure_cause(code, lines, files, state) is None


#: A two-node Slurm job whose rank on n2 raised a bug after 12 steps of collectives (lines as
#: tests/service/test_slurm_failures.py's run printed them, tracebacks shortened).
RANK_BUG = [
    "dlrm-vrgd: Slurm job 1 on n[1-2], rendezvous at 127.0.0.1:40899",
    "1: [rank1]: Traceback (most recent call last):",
    '1: [rank1]:   File "/work/main/dlrm_vrgd/train/loop.py", line 626, in train',
    "1: [rank1]: RuntimeError: injected bug in the rank on n2 at step 12",
    "0: [rank0]: Traceback (most recent call last):",
    "0: [rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
    "pair.cc:553] Connection closed by peer [127.0.0.1]:55524. This is typically caused by a "
    "remote worker crashing.",
    "1: torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "1: Root Cause (first observed failure):",
    "1:   exitcode  : 1 (pid: 8098) ",
    "1:   RuntimeError: injected bug in the rank on n2 at step 12",
]
SRUN_AFTER_BUG = [
    "srun: error: n2: task 1: Exited with exit code 1",
    "srun: launch/slurm: _step_signal: Terminating StepId=1.0",
    "0: slurmstepd-n1: error: *** STEP 1.0 ON n1 CANCELLED AT 2026-12-04T17:01:17 ***",
    "0: torch.distributed.elastic.multiprocessing.api.SignalException: Process 8060 got signal: 15",
    "srun: error: n1: task 0: Exited with exit code 1",
]


def test_a_ranks_own_error_is_not_retried_though_its_peer_lost_a_collective(
    files: JobFiles,
) -> None:
    """The failing task's own exit before its peer's symptom (issue 40 (e))."""
    assert infrastructure_cause(1, RANK_BUG + SRUN_AFTER_BUG, files, "FAILED") is None
    # srun may name the peer first (its collective failed before the buggy task's torchrun
    # ended): the bug on task 1 is still the cause
    racing = [*SRUN_AFTER_BUG[-1:], *SRUN_AFTER_BUG[:-1]]
    assert infrastructure_cause(1, RANK_BUG + racing, files, "FAILED") is None
    # local backend (no srun, no labels): torch's [rankN] prefix alone
    local = [ln.split(": ", 1)[1] for ln in RANK_BUG[1:]]
    assert infrastructure_cause(1, local, files) is None
    # the same peer symptom with the other task SIGKILLed (the OOM killer, a lost host) is
    # the infrastructure's, whatever the survivor printed
    killed = [*RANK_BUG[:1], *RANK_BUG[4:6], "srun: error: n2: task 1: Killed",
              "srun: error: n1: task 0: Exited with exit code 1"]  # fmt: skip
    assert infrastructure_cause(1, killed, files, "FAILED") == "a task was killed (task 1 on n2)"
    summary = [*RANK_BUG[:1], *RANK_BUG[4:6], *(f"1: {ln}" for ln in TORCHRUN_SUMMARY),
               "srun: error: n2: task 1: Exited with exit code 1"]  # fmt: skip
    assert infrastructure_cause(1, summary, files, "FAILED") == "a rank was killed by SIGKILL"
    # only the newest attempt counts: a retried job's log holds the earlier one's lines
    second = ["dlrm-vrgd: Slurm job 2 on n[1-2], rendezvous at 127.0.0.1:40899", *killed[1:]]
    assert infrastructure_cause(1, RANK_BUG + SRUN_AFTER_BUG + second, files, "FAILED") == (
        "a task was killed (task 1 on n2)"
    )
    assert infrastructure_cause(1, killed + RANK_BUG + SRUN_AFTER_BUG, files, "FAILED") is None


def test_a_nan_loss_is_never_retried_even_when_a_rank_then_died(files: JobFiles) -> None:
    (files.run_dir / "status.json").write_text(
        json.dumps({"state": "failed", "step": 7, "error": "NonFiniteError: loss is nan"})
    )
    assert infrastructure_cause(1, TORCHRUN_SUMMARY, files) is None
    assert infrastructure_cause(-9, [], files) is None


def test_a_retry_resumes_from_the_newest_checkpoint_that_verifies(files: JobFiles) -> None:
    run = files.run_dir
    assert resume_step(run) == 0  # none yet: from the start
    for step in (10, 20):
        ckpt.write_rank_state(run, step, 0, {"step": step})
        ckpt.publish(run, step, 1, {}, keep=5)
    assert resume_step(run) == 20
    newest = run / "checkpoints" / "step_00000020" / "rank0.pt"
    newest.write_bytes(newest.read_bytes()[:-3])  # truncated: it no longer verifies
    assert resume_step(run) == 10


def test_the_backend_state_line_says_queued_held_running_or_requeued() -> None:
    from service.jobs.backends.base import ENDED, PENDING, RUNNING, AppStatus
    from service.jobs.lifecycle import backend_line

    assert backend_line(AppStatus(PENDING, detail="Resources")) == "queued: Resources"
    assert backend_line(AppStatus(PENDING, detail="PartitionNodeLimit")) == (
        "held: PartitionNodeLimit"
    )
    down = AppStatus(PENDING, detail="ReqNodeNotAvail, UnavailableNodes:n2")
    assert backend_line(down) == "held: ReqNodeNotAvail, UnavailableNodes:n2"
    assert backend_line(
        AppStatus(PENDING, detail="Priority"), "requeued after NODE_FAIL on n2"
    ) == ("requeued after NODE_FAIL on n2; queued: Priority")
    running = AppStatus(RUNNING, nodes="n[1-2]")
    assert backend_line(running, "requeued after NODE_FAIL on n2") == "running on n[1-2]"
    assert backend_line(AppStatus(ENDED, scheduler_state="NODE_FAIL")) == "ended: NODE_FAIL"


@pytest.mark.parametrize("plant", ["fifo", "link", "nested"])
def test_a_planted_status_file_neither_hangs_nor_breaks_the_classification(
    files: JobFiles, tmp_path: Path, plant: str
) -> None:
    """run/status.json is the job's to write: a FIFO there used to block the runner for ever
    (a plain open), deep nesting raised RecursionError, and a link was followed. Each is
    refused and the failure classified from the log alone."""
    import os
    import threading

    status = files.run_dir / "status.json"
    if plant == "fifo":
        os.mkfifo(status)
    elif plant == "link":  # a NaN-looking file outside the job directory
        outside = tmp_path / "outside.json"
        outside.write_text(json.dumps({"error": "NonFiniteError: loss is nan"}))
        status.symlink_to(outside)
    else:
        status.write_text("[" * 100_000 + "]" * 100_000)
    out: list[str | None] = []
    worker = threading.Thread(
        target=lambda: out.append(infrastructure_cause(1, TORCHRUN_SUMMARY, files)), daemon=True
    )
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the classification blocked on the planted file"
    assert out == ["a rank was killed by SIGKILL"]  # the link's NaN was not read
