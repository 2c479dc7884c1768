"""The runner hands out GPUs (``CUDA_VISIBLE_DEVICES``) with stand-in jobs (no torch, no GPU).

Each stand-in job starts a torchrun-like worker in a session of its own and then holds its GPUs
until the test drops a ``release`` file into its directory. What a job was given is read where
it matters: from the environment of the job's live processes (``/proc/PID/environ``). A watcher
samples every running job's processes throughout each test and fails it if one GPU is ever seen
in two jobs at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from service.jobs.backends import process
from service.jobs.backends.local import JOB_ENV
from service.jobs.files import JobFiles
from service.jobs.gpus import GPU_ENV
from service.jobs.notifier import Notifier
from service.jobs.runner import Runner
from service.jobs.states import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, TERMINAL
from service.jobs.store import Job, Store
from service.settings import Settings

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/environ").exists(), reason="reads job environments from /proc"
)

# A job that holds its GPUs until released; its worker (like torchrun's) has its own session.
HOLD = """
import os, pathlib, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                          start_new_session=True)
pathlib.Path("visible").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
while not pathlib.Path("release").exists():
    time.sleep(0.02)
worker.kill()
worker.wait()
run = pathlib.Path("run")
run.mkdir(exist_ok=True)
(run / "result.json").write_text("{}")
"""


def script_command(job: Job, files: JobFiles) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(job.config["script"])]


def make(tmp_path: Path, gpus: str = "0,1,2,3", **settings: Any) -> tuple[Settings, Store]:
    s = Settings(
        data_dir=tmp_path / "data",
        poll_interval_s=0.05,
        cancel_grace_s=2.0,
        max_concurrent_jobs=8,
        job_nice=0,
        gpus=gpus,
        **settings,
    )
    s.jobs_dir.mkdir(parents=True)
    return s, Store(s.db_path)


def submit(store: Store, gpus: int, device: str = "cuda") -> Job:
    """A stand-in job asking for ``gpus`` GPUs (run.nproc_per_node) on ``device``."""
    job_id = os.urandom(8).hex()
    config = {"script": HOLD, "run": {"device": device, "nproc_per_node": max(gpus, 1)}}
    job = store.create_job(job_id, f"{gpus}-gpu", "train", config, None)
    time.sleep(0.002)  # distinct created_at: FIFO order is the submission order
    return job


def release(settings: Settings, job: Job) -> None:
    (settings.jobs_dir / job.id / "release").touch()


def seen_by_processes(job: Job) -> set[str] | None:
    """CUDA_VISIBLE_DEVICES of every live process of the job, as one set of GPUs (all of
    them must agree); None while the job has no live process."""
    assert job.pgid is not None
    values = set()
    for pid in process.job_processes(job.pgid, f"{JOB_ENV}={job.id}"):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        prefix = f"{GPU_ENV}=".encode()
        found = [e[len(prefix) :].decode() for e in environ if e.startswith(prefix)]
        values.add(found[0] if found else "<unset>")
    if not values:
        return None
    assert len(values) == 1, f"processes of job {job.id} disagree: {values}"
    (value,) = values
    return set(value.split(",")) if value else set()


class Watcher:
    """Samples every running job's processes; records any GPU seen in two jobs at once."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.overlaps: list[str] = []
        self.samples = 0
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> None:
        owner: dict[str, str] = {}
        for job in self.store.jobs_in_state(RUNNING):
            if job.pgid is None:
                continue
            for gpu in seen_by_processes(job) or set():
                if gpu in owner:
                    self.overlaps.append(f"GPU {gpu}: jobs {owner[gpu]} and {job.id}")
                owner[gpu] = job.id
        self.samples += 1

    async def _loop(self) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(0.02)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


def run_with(
    settings: Settings, store: Store, body: Callable[[Runner], Awaitable[object]]
) -> object:
    """Run ``body`` against a started runner while a watcher checks that no GPU is shared."""

    async def main() -> object:
        runner = Runner(settings, store, Notifier(), command=script_command)
        watcher = Watcher(store)
        await runner.start()
        watcher.start()
        try:
            return await body(runner)
        finally:
            await watcher.stop()
            for job in store.jobs_in_state(RUNNING):  # leave nothing running behind
                release(settings, job)
            await runner.stop()
            assert watcher.samples > 0
            assert watcher.overlaps == []

    return asyncio.run(main())


async def until(predicate: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def running_with_gpus(store: Store, job: Job) -> set[str] | None:
    """The GPUs the job's processes see, once it runs (None before)."""
    now = store.get_job(job.id)
    if now is None or now.state != RUNNING or now.pgid is None:
        return None
    return seen_by_processes(now)


def state(store: Store, job: Job) -> str:
    now = store.get_job(job.id)
    assert now is not None
    return now.state


def messages(store: Store, job: Job) -> list[str]:
    return [
        json.loads(data).get("message") or ""
        for _, stream, data in store.records_after(job.id, 0, 1000)
        if stream == "state"
    ]


# ------------------------------------------------------------------------------ tests
def test_jobs_asking_2_2_1_of_4_gpus_the_third_waits_and_a_cancel_frees_gpus(
    tmp_path: Path,
) -> None:
    settings, store = make(tmp_path, gpus="0,1,2,3")
    a, b, c = submit(store, 2), submit(store, 2), submit(store, 1)

    async def body(runner: Runner) -> None:
        got_a = await until(lambda: running_with_gpus(store, a))
        got_b = await until(lambda: running_with_gpus(store, b))
        assert len(got_a) == len(got_b) == 2 and not got_a & got_b
        assert got_a | got_b == {"0", "1", "2", "3"}
        # The third job waits (and is told why) while no GPU is free.
        await until(lambda: any("waiting for 1 GPU(s); 0 free" in m for m in messages(store, c)))
        await asyncio.sleep(0.4)  # several runner ticks
        assert state(store, c) == QUEUED
        assert runner.gpus.free() == ()
        # Cancelling a running job frees its GPUs: the waiting job gets one of them.
        cancelled = await runner.cancel(a.id)
        assert cancelled.state == CANCELLED
        got_c = await until(lambda: running_with_gpus(store, c))
        assert len(got_c) == 1 and got_c <= got_a and not got_c & got_b
        # The job files record the assignment; the job saw it in its own environment too.
        visible = settings.jobs_dir / c.id / "visible"
        await until(visible.exists)
        assert visible.read_text() == ",".join(sorted(got_c))
        # Jobs that end normally free their GPUs as well.
        release(settings, b)
        release(settings, c)
        for job in (b, c):
            await until(lambda job=job: state(store, job) in TERMINAL)
            assert state(store, job) == SUCCEEDED
        assert runner.gpus.holders() == {}
        assert len(runner.gpus.free()) == 4

    run_with(settings, store, body)


@pytest.mark.parametrize("backfill", [False, True])
def test_a_job_waiting_for_gpus_is_overtaken_only_with_backfill(
    tmp_path: Path, backfill: bool
) -> None:
    """FIFO: with 4 GPUs, a 3-GPU job runs; a 2-GPU job waits; a 1-GPU job behind it waits
    too (head-of-line blocking) unless backfill lets it use the free GPU."""
    settings, store = make(tmp_path, gpus="0,1,2,3", gpu_backfill=backfill)
    big, medium, small = submit(store, 3), submit(store, 2), submit(store, 1)

    async def body(runner: Runner) -> None:
        got_big = await until(lambda: running_with_gpus(store, big))
        assert len(got_big) == 3
        await until(lambda: any("waiting for 2 GPU(s)" in m for m in messages(store, medium)))
        if backfill:
            got_small = await until(lambda: running_with_gpus(store, small))
            assert got_small == {"0", "1", "2", "3"} - got_big
        else:
            await asyncio.sleep(0.4)
            assert state(store, small) == QUEUED
        assert state(store, medium) == QUEUED
        release(settings, big)
        got_medium = await until(lambda: running_with_gpus(store, medium))
        assert len(got_medium) == 2
        if not backfill:  # now both fit: 2 + 1 of 4
            got_small = await until(lambda: running_with_gpus(store, small))
            assert not got_small & got_medium

    run_with(settings, store, body)


def test_cpu_jobs_see_no_gpu_and_take_none(tmp_path: Path) -> None:
    settings, store = make(tmp_path, gpus="0,1")
    cpu, gpu = submit(store, 0, device="cpu"), submit(store, 2)

    async def body(runner: Runner) -> None:
        assert await until(lambda: running_with_gpus(store, gpu)) == {"0", "1"}
        assert await until(lambda: running_with_gpus(store, cpu) is not None)
        assert running_with_gpus(store, cpu) == set()  # CUDA_VISIBLE_DEVICES=""

    run_with(settings, store, body)


def test_a_job_asking_more_gpus_than_the_host_has_fails_instead_of_blocking(
    tmp_path: Path,
) -> None:
    """E.g. queued before the service restarted with fewer GPUs."""
    settings, store = make(tmp_path, gpus="0,1")
    too_big, after = submit(store, 4), submit(store, 1)

    async def body(runner: Runner) -> None:
        assert await until(lambda: running_with_gpus(store, after)) == {"0"}
        failed = store.get_job(too_big.id)
        assert failed is not None and failed.state == FAILED
        assert failed.error is not None and "asks for 4 GPU(s)" in failed.error
        assert "this host has 2" in failed.error

    run_with(settings, store, body)


def test_a_restarted_service_gives_reattached_jobs_their_gpus_back(tmp_path: Path) -> None:
    settings, store = make(tmp_path, gpus="0,1,2,3")
    first = submit(store, 2)
    seen: dict[str, set[str]] = {}

    async def before_restart(runner: Runner) -> None:
        seen["first"] = await until(lambda: running_with_gpus(store, first))

    async def main() -> None:
        # The first service leaves the job running (the default when it stops).
        runner = Runner(settings, store, Notifier(), command=script_command)
        await runner.start()
        try:
            await before_restart(runner)
        finally:
            await runner.stop()
        assert state(store, first) == RUNNING

    asyncio.run(main())
    second, third = submit(store, 2), submit(store, 1)

    async def after_restart(runner: Runner) -> None:
        assert runner.gpus.holders() == {first.id: tuple(sorted(seen["first"]))}
        got_second = await until(lambda: running_with_gpus(store, second))
        assert not got_second & seen["first"]
        await asyncio.sleep(0.3)
        assert state(store, third) == QUEUED  # 2 + 2 of 4 GPUs are taken
        assert running_with_gpus(store, first) == seen["first"]
        release(settings, first)
        got_third = await until(lambda: running_with_gpus(store, third))
        assert got_third <= seen["first"]
        job = store.get_job(first.id)
        assert job is not None and job.state == SUCCEEDED

    run_with(settings, store, after_restart)
