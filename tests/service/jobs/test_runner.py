"""The runner with stand-in commands (no torch): success, failure reasons, timeout, cancel of a
whole process tree (a torchrun-like parent whose child lives in a session of its own), FIFO
order under the concurrency limit, and recovery of jobs a previous service left running."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from service.errors import IllegalTransition
from service.jobs.backends import process
from service.jobs.backends.base import ENDED, AppStatus, Handle
from service.jobs.backends.base import RUNNING as BACKEND_RUNNING
from service.jobs.backends.local import JOB_ENV, LocalBackend
from service.jobs.files import JobFiles
from service.jobs.notifier import Notifier
from service.jobs.runner import Runner
from service.jobs.states import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, TERMINAL
from service.jobs.store import Job, Store
from service.settings import Settings

SUCCEED = """
import json, os, pathlib, time
run = pathlib.Path("run"); run.mkdir(exist_ok=True)
with open(run / "metrics.jsonl", "a") as f:
    for step in (1, 2):
        f.write(json.dumps({"kind": "train", "step": step, "loss": 1.0 / step}) + "\\n")
(run / "result.json").write_text(json.dumps({"steps": 2}))
print("done", flush=True)
"""
FAIL = "import sys\nprint('something went wrong', flush=True)\nsys.exit(3)"
SLEEP = "import time\ntime.sleep(120)"
#: Ignores SIGTERM, and says so (the file ``ready``) once its handler is in place: a cancel
#: that came before would find the default handler and end it with -15, not -9.
IGNORE_TERM = """
import pathlib, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pathlib.Path("ready").write_text("handler installed")
time.sleep(120)
"""
# torchrun-like: the worker runs in a session of its own (start_new_session=True).
TREE = """
import pathlib, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True)
pathlib.Path("child.pid").write_text(str(child.pid))
time.sleep(120)
"""


def script_command(job: Job, files: JobFiles) -> list[str]:
    """The job's config carries the script to run."""
    return [sys.executable, "-c", textwrap.dedent(job.config["script"])]


def make(tmp_path: Path, **settings: object) -> tuple[Settings, Store]:
    s = Settings(
        data_dir=tmp_path / "data",
        poll_interval_s=0.05,
        cancel_grace_s=2.0,
        **settings,  # type: ignore[arg-type]
    )
    s.jobs_dir.mkdir(parents=True)
    return s, Store(s.db_path)


def submit(store: Store, script: str, timeout_s: float | None = None) -> Job:
    job_id = os.urandom(8).hex()
    return store.create_job(job_id, "t", "train", {"script": script}, timeout_s)


def run_with(
    settings: Settings, store: Store, body: Callable[[Runner], Awaitable[object]]
) -> object:
    async def main() -> object:
        runner = Runner(settings, store, Notifier(), command=script_command)
        await runner.start()
        try:
            return await body(runner)
        finally:
            await runner.stop()

    return asyncio.run(main())


async def until_done(store: Store, job_id: str, timeout: float = 30.0) -> Job:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = store.get_job(job_id)
        if job is not None and job.state in TERMINAL:
            return job
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish")


async def until_running(store: Store, job_id: str) -> Job:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        job = store.get_job(job_id)
        if job is not None and job.pid is not None:
            return job
        await asyncio.sleep(0.02)
    raise AssertionError("never started")


async def until_ready(job_dir: Path, timeout: float = 60.0) -> None:
    """Wait until the job's script wrote ``ready`` (after installing its signal handlers)."""
    deadline = time.monotonic() + timeout
    while not (job_dir / "ready").exists():
        assert time.monotonic() < deadline, "the job never said it was ready"
        await asyncio.sleep(0.02)


def test_success_ingests_records_and_stores_the_result(tmp_path: Path) -> None:
    settings, store = make(tmp_path)
    job = submit(store, SUCCEED)
    done = run_with(settings, store, lambda r: until_done(store, job.id))
    assert isinstance(done, Job)
    assert done.state == SUCCEEDED and done.exit_code == 0 and done.result == {"steps": 2}
    assert done.progress["step"] == 2 and done.progress["loss"] == 0.5
    steps = [json.loads(d)["step"] for d in store.series(job.id, "metrics").data]
    assert steps == [1, 2]
    assert (settings.jobs_dir / job.id / "train.log").read_text() == "done\n"


def test_failure_keeps_exit_status_and_last_log_lines(tmp_path: Path) -> None:
    settings, store = make(tmp_path)
    job = submit(store, FAIL)
    done = run_with(settings, store, lambda r: until_done(store, job.id))
    assert isinstance(done, Job) and done.state == FAILED and done.exit_code == 3
    assert done.error is not None
    assert done.error.startswith("exit status 3") and "something went wrong" in done.error


def test_timeout_fails_the_job(tmp_path: Path) -> None:
    settings, store = make(tmp_path)
    job = submit(store, SLEEP, timeout_s=0.5)
    done = run_with(settings, store, lambda r: until_done(store, job.id))
    assert isinstance(done, Job) and done.state == FAILED
    assert done.error is not None and done.error.startswith("timed out after 0.5 s")
    assert not process.is_alive(done.pid or 0)


def test_cancel_ends_the_whole_process_tree(tmp_path: Path) -> None:
    settings, store = make(tmp_path)
    job = submit(store, TREE)
    child_file = settings.jobs_dir / job.id / "child.pid"

    async def body(runner: Runner) -> tuple[Job, int, int]:
        running = await until_running(store, job.id)
        while not child_file.exists():
            await asyncio.sleep(0.02)
        child = int(child_file.read_text())
        assert process.is_alive(child) and process.is_alive(running.pid or 0)
        cancelled = await runner.cancel(job.id)
        return cancelled, running.pid or 0, child

    cancelled, parent, child = run_with(settings, store, body)  # type: ignore[misc]
    assert cancelled.state == CANCELLED
    assert not process.is_alive(parent) and not process.is_alive(child)
    assert process.job_processes(parent, f"{JOB_ENV}={job.id}") == []


def test_sigkill_after_the_grace_period(tmp_path: Path) -> None:
    settings, store = make(tmp_path)
    job = submit(store, IGNORE_TERM)

    async def body(runner: Runner) -> tuple[Job, float]:
        running = await until_running(store, job.id)
        await until_ready(settings.jobs_dir / job.id)  # its SIGTERM handler is in place
        t0 = time.monotonic()
        cancelled = await runner.cancel(job.id)
        assert not process.is_alive(running.pid or 0)
        return cancelled, time.monotonic() - t0

    cancelled, took = run_with(settings, store, body)  # type: ignore[misc]
    assert cancelled.state == CANCELLED and cancelled.exit_code == -9
    assert settings.cancel_grace_s <= took < settings.cancel_grace_s + 3


def test_cancel_of_a_finished_job_is_illegal(tmp_path: Path) -> None:
    settings, store = make(tmp_path)
    job = submit(store, SUCCEED)

    async def body(runner: Runner) -> None:
        await until_done(store, job.id)
        with pytest.raises(IllegalTransition):
            await runner.cancel(job.id)

    run_with(settings, store, body)
    assert store.get_job(job.id).state == SUCCEEDED  # type: ignore[union-attr]


def test_fifo_under_the_concurrency_limit(tmp_path: Path) -> None:
    settings, store = make(tmp_path, max_concurrent_jobs=1)
    jobs = [submit(store, SUCCEED) for _ in range(3)]
    queued_cancel = submit(store, SUCCEED)

    async def body(runner: Runner) -> list[Job]:
        assert (await runner.cancel(queued_cancel.id)).state == CANCELLED
        return [await until_done(store, j.id) for j in jobs]

    done = run_with(settings, store, body)
    assert isinstance(done, list) and all(j.state == SUCCEEDED for j in done)
    for earlier, later in zip(done, done[1:], strict=False):
        assert earlier.finished_at is not None and later.started_at is not None
        assert earlier.finished_at <= later.started_at  # one at a time, in order
    assert store.get_job(queued_cancel.id).started_at is None  # type: ignore[union-attr]


def test_recovery_reattaches_live_jobs_and_settles_dead_ones(tmp_path: Path) -> None:
    settings, store = make(tmp_path, max_concurrent_jobs=0)
    # A job "left running" by a previous service whose process still runs...
    alive = submit(store, SLEEP)
    proc = subprocess.Popen(
        [sys.executable, "-c", SLEEP],
        start_new_session=True,
        env={**os.environ, JOB_ENV: alive.id},
    )
    store.transition(alive.id, [QUEUED], RUNNING, pid=proc.pid, pgid=proc.pid,
                     proc_start=process.start_time(proc.pid))  # fmt: skip
    # ...one whose process is gone, with a result on disk...
    finished = submit(store, SLEEP)
    (settings.jobs_dir / finished.id / "run").mkdir(parents=True)
    (settings.jobs_dir / finished.id / "run" / "result.json").write_text('{"steps": 1}')
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store.transition(finished.id, [QUEUED], RUNNING, pid=dead.pid, pgid=dead.pid, proc_start="1")
    # ...one without, and one that never got a process.
    lost = submit(store, SLEEP)
    store.transition(lost.id, [QUEUED], RUNNING, pid=dead.pid, pgid=dead.pid, proc_start="1")
    unborn = submit(store, SLEEP)
    store.transition(unborn.id, [QUEUED], RUNNING)

    async def body(runner: Runner) -> Job:
        assert runner.active_pids == {alive.id: proc.pid}
        proc.kill()
        proc.wait()  # it was our child here; for the runner it is a stranger
        return await until_done(store, alive.id)

    ended = run_with(settings, store, body)
    assert isinstance(ended, Job) and ended.state == FAILED
    assert ended.error is not None and "re-attached" in ended.error
    notes = [json.loads(d)["message"] for _, s, d in store.records_after(alive.id, 0, 100)]
    assert any(n and n.startswith(f"re-attached to process {proc.pid}") for n in notes)
    got = {j: store.get_job(j) for j in (finished.id, lost.id, unborn.id)}
    assert got[finished.id].state == SUCCEEDED and got[finished.id].result == {"steps": 1}  # type: ignore[union-attr]
    assert got[lost.id].state == FAILED  # type: ignore[union-attr]
    assert "gone when the service restarted" in (got[lost.id].error or "")  # type: ignore[union-attr]
    assert got[unborn.id].state == FAILED  # type: ignore[union-attr]
    assert "while starting" in (got[unborn.id].error or "")  # type: ignore[union-attr]


SLOW_FAIL = "import sys, time\ntime.sleep(3)\nprint('late failure', flush=True)\nsys.exit(3)"


def test_a_job_that_ends_after_a_restart_keeps_its_real_exit_status(tmp_path: Path) -> None:
    """The service stops while the job runs (it is left running), a new service re-attaches
    it; the job then fails with status 3: the new service is not its parent, yet records 3
    (from the supervisor's exit.json), and says it in the reason."""
    settings, store = make(tmp_path)
    job = submit(store, SLOW_FAIL)
    started = run_with(settings, store, lambda r: until_running(store, job.id))
    assert isinstance(started, Job) and store.get_job(job.id).state == RUNNING  # type: ignore[union-attr]
    done = run_with(settings, store, lambda r: until_done(store, job.id))
    assert isinstance(done, Job) and done.state == FAILED
    assert done.exit_code == 3
    assert done.error is not None and "exit status 3" in done.error and "late failure" in done.error
    exit_file = settings.jobs_dir / job.id / "exit.json"
    assert json.loads(exit_file.read_text()) == {"exit_code": 3}


def test_an_exit_status_that_cannot_be_known_is_said_to_be_unknown(tmp_path: Path) -> None:
    """Re-attached, then the whole job (its supervisor too) is SIGKILLed by someone else:
    nothing recorded how it ended. exit_code stays null and the reason says "unknown"."""
    settings, store = make(tmp_path)
    job = submit(store, SLEEP)
    started = run_with(settings, store, lambda r: until_running(store, job.id))
    assert isinstance(started, Job) and started.pgid is not None

    async def body(runner: Runner) -> Job:
        assert job.id in runner.active_pids  # re-attached
        os.killpg(started.pgid or 0, 9)
        return await until_done(store, job.id)

    done = run_with(settings, store, body)
    assert isinstance(done, Job) and done.state == FAILED and done.exit_code is None
    assert done.error is not None and "exit status unknown" in done.error
    assert not (settings.jobs_dir / job.id / "exit.json").exists()


SELF_KILL = "import os, signal\nprint('dying', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)"


def test_a_job_killed_by_a_signal_is_retried_until_its_retries_run_out(tmp_path: Path) -> None:
    """SIGKILLed by nobody in the service, twice, with max_retries 1: two attempts, then the
    job fails saying why and that no retry was left; a plain failure is never retried."""
    settings, store = make(tmp_path)
    job = store.create_job(os.urandom(8).hex(), "t", "train", {"script": SELF_KILL}, None,
                           max_retries=1)  # fmt: skip
    plain = store.create_job(os.urandom(8).hex(), "t", "train", {"script": FAIL}, None,
                             max_retries=3)  # fmt: skip

    async def body(runner: Runner) -> tuple[Job, Job]:
        return await until_done(store, job.id), await until_done(store, plain.id)

    done, failed = run_with(settings, store, body)  # type: ignore[misc]
    assert done.state == FAILED and done.exit_code == -9 and done.attempt == 2
    assert [a["ended"] for a in done.attempts] == [
        "killed by SIGKILL",
        "killed by SIGKILL (9) (an infrastructure failure: killed by SIGKILL; no retries "
        "left, max_retries 1)",
    ]
    assert done.attempts[1]["resumed_from_step"] == 0  # no checkpoint: from the start
    assert done.error is not None and "no retries left, max_retries 1" in done.error
    notes = [json.loads(d)["message"] for _, s, d in store.records_after(job.id, 0, 100)]
    assert "attempt 1 ended: killed by SIGKILL; attempt 2 of 2 resumes from step 0" in notes
    assert (settings.jobs_dir / job.id / "train.log").read_text() == "dying\ndying\n"
    assert failed.state == FAILED and failed.attempt == 1 and len(failed.attempts) == 1


TICKER = """
import json, pathlib, time
run = pathlib.Path("run"); run.mkdir(exist_ok=True)
with open(run / "metrics.jsonl", "a") as f:
    for step in range(1, 61):
        f.write(json.dumps({"kind": "train", "step": step, "loss": 1.0}) + "\\n"); f.flush()
        time.sleep(0.05)
(run / "result.json").write_text(json.dumps({"steps": 60}))
"""


class SlowScheduler(LocalBackend):
    """A scheduler whose every answer takes 1.5 s (a controller at the end of its timeout)."""

    queues_jobs = True

    def describe(self, handle: Handle) -> AppStatus:
        time.sleep(1.5)
        status = super().describe(handle)
        if status.phase != ENDED:
            return AppStatus(BACKEND_RUNNING, scheduler_state="RUNNING", nodes="n1")
        return AppStatus(ENDED, status.exit_code, scheduler_state="COMPLETED")


def test_a_slow_scheduler_never_holds_back_metric_ingestion(tmp_path: Path) -> None:
    """Records are ingested as they are written (every poll) although each look at the
    scheduler takes 1.5 s: the scheduler is asked in a loop of its own."""
    settings, store = make(tmp_path)
    job = submit(store, TICKER)
    counts: list[int] = []

    async def main() -> Job:
        runner = Runner(settings, store, Notifier(), script_command, SlowScheduler(settings))
        await runner.start()
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                counts.append(len(store.series(job.id, "metrics").data))
                done = store.get_job(job.id)
                if done is not None and done.state in TERMINAL:
                    return done
                await asyncio.sleep(0.05)
            raise AssertionError("the job did not finish")
        finally:
            await runner.stop()

    done = asyncio.run(main())
    assert done.state == SUCCEEDED and done.backend_state == "ended: COMPLETED"
    growing = sorted(set(counts) - {0, 60})
    assert len(growing) >= 10, growing  # not bursts every 1.5 s: ~2 distinct counts in 3 s
