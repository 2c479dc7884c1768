"""The runner: one asyncio task on the service's event loop that follows the running jobs
(tails their run directories into the store, enforces timeouts and cancels) and starts queued
ones, and recovers the jobs a previous service left running when it starts.

What it ties together, one idea a file:

- ``service/jobs/scheduling.py``: which queued job starts next, and on which GPUs;
- ``service/jobs/lifecycle.py``: one job's launch, observation, end (or retry) and recovery;
- ``service/jobs/ingest.py``: a run directory's records into the store.

Every blocking step (SQLite, files, waiting for a process group, a scheduler's commands) runs in
a worker thread. Ending a job signals the whole group: SIGTERM, then SIGKILL after
``cancel_grace_s``; a job is only reported ended once no process of its group is left. Running
jobs are left running when the service stops (unless ``cancel_on_shutdown``), to be
re-attached by the next start. With a backend that queues jobs itself (Slurm), the scheduler is
asked in a loop of its own (``_watch``): a slow controller never holds back ingestion.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from service.errors import IllegalTransition, JobNotFound
from service.jobs.backends import make_backend
from service.jobs.backends.base import ENDED, AppStatus, Backend
from service.jobs.backends.local import KILL_WAIT_S
from service.jobs.files import JobFiles
from service.jobs.ingest import ingest_job
from service.jobs.lifecycle import ActiveJob, CommandFn, JobLifecycle
from service.jobs.models import utcnow
from service.jobs.notifier import Notifier
from service.jobs.reading import JobFileError
from service.jobs.scheduling import Scheduler
from service.jobs.states import CANCELLED, QUEUED, TERMINAL
from service.jobs.store import Job, Store
from service.settings import Settings

logger = logging.getLogger(__name__)

#: Ticks in a row that may fail to follow one job before it is stopped and fails.
FOLLOW_FAILURES = 20


class Runner:
    """Runs jobs from the store; one per service."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        notifier: Notifier,
        command: CommandFn | None = None,
        backend: Backend | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.notifier = notifier
        #: What runs the jobs' processes (DLRM_VRGD_BACKEND).
        self.backend = backend or make_backend(settings)
        #: The queue and the GPU book.
        self.scheduler = Scheduler(settings, store, self.backend)
        #: The GPUs jobs may use and which job holds which.
        self.gpus = self.scheduler.gpus
        #: Launch, observe, finish, retry, recover (blocking: called in threads).
        self.lifecycle = JobLifecycle(settings, store, self.backend, self.scheduler, command)
        self._active: dict[str, ActiveJob] = {}
        self._launching: set[str] = set()
        self._pending_cancel: set[str] = set()
        self._done: dict[str, asyncio.Event] = {}
        self._wake = asyncio.Event()
        #: Set by stop(): the loop ends even if a cancellation is lost (Python 3.11's
        #: wait_for swallows one that arrives as the awaited event fires).
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: A scheduler's jobs are looked at by a loop of their own (``_watch``), so that a
        #: slow scheduler never holds back metric ingestion: (job id, app id) -> last status.
        self._statuses: dict[tuple[str, str], AppStatus] = {}
        #: Ticks in a row whose following of a job failed (:meth:`_follow_one`).
        self._failures: dict[str, int] = {}
        self._watcher: asyncio.Task[None] | None = None

    # --------------------------------------------------------------------------- public
    def files(self, job_id: str) -> JobFiles:
        return self.lifecycle.files(job_id)

    @property
    def active_pids(self) -> dict[str, int]:
        """job id -> pid of the local jobs being followed."""
        return {job_id: a.pid for job_id, a in self._active.items() if a.pid is not None}

    @property
    def queues_jobs(self) -> bool:
        """The backend queues jobs itself (Slurm): no local concurrency limit or GPUs."""
        return self.backend.queues_jobs

    async def start(self) -> None:
        """Recover jobs left running by a previous service, then start the loop.

        Raises :class:`BackendUnavailable` when the backend cannot run jobs (Slurm missing)."""
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        await asyncio.to_thread(self.backend.check)
        if self.queues_jobs:
            logger.info("jobs run through %s", self.backend.name)
        else:
            logger.info("GPUs for jobs: %s", ",".join(self.gpus.devices) or "none")
        for active in await asyncio.to_thread(self.lifecycle.recover):
            self._active[active.job_id] = active
        self._task = asyncio.create_task(self._run(), name="dlrm-vrgd-runner")
        if self.queues_jobs:
            self._watcher = asyncio.create_task(self._watch(), name="dlrm-vrgd-watcher")

    async def stop(self) -> None:
        """Stop the loop; cancel running jobs if ``cancel_on_shutdown``, else leave them."""
        self._stopping = True
        for task in (self._task, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._watcher = None
        if not self.settings.cancel_on_shutdown:
            if self._active:
                logger.info(
                    "leaving %d running job(s) running; the next start re-attaches them",
                    len(self._active),
                )
            # also a job whose launch finished as the loop was cancelled (the backend has
            # its handle, _active does not yet): let go of its process without a warning
            self.backend.close()
            self._active.clear()
            return
        if not self._active:
            return
        for active in self._active.values():
            await self._begin_stop(active, "shutdown")
        deadline = time.monotonic() + self.settings.cancel_grace_s + KILL_WAIT_S + 5
        while self._active and time.monotonic() < deadline:
            for active in list(self._active.values()):
                await self._follow(active)
            await asyncio.sleep(0.05)

    def wake(self) -> None:
        """Ask the loop to look at the queue now (thread-safe)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def cancel(self, job_id: str) -> Job:
        """Cancel a queued or running job and wait (up to the grace period and a little more)
        until no process of it is left; returns the job as it then stands.

        Raises :class:`JobNotFound`, or :class:`IllegalTransition` for a finished job.
        """
        done = self._done.setdefault(job_id, asyncio.Event())
        job = await asyncio.to_thread(self.store.get_job, job_id)
        if job is None:
            raise JobNotFound(job_id)
        if job.state == QUEUED and job_id not in self._active and job_id not in self._launching:
            cancelled = await asyncio.to_thread(
                self.store.transition,
                job_id,
                [QUEUED],
                CANCELLED,
                "cancelled while queued",
                finished_at=utcnow(),
            )
            if cancelled is not None:
                self._signal_done(job_id)
                return cancelled
            job = await asyncio.to_thread(self.store.get_job, job_id)
            if job is None:
                raise JobNotFound(job_id)
        if job.state in TERMINAL:
            raise IllegalTransition(f"job {job_id} is already {job.state}; nothing to cancel")
        active = self._active.get(job_id)
        if active is not None:
            await self._begin_stop(active, "cancel")
        else:
            self._pending_cancel.add(job_id)
        self.wake()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), self.settings.cancel_grace_s + KILL_WAIT_S + 10)
        final = await asyncio.to_thread(self.store.get_job, job_id)
        if final is None:
            raise JobNotFound(job_id)
        return final

    # ----------------------------------------------------------------------------- loop
    async def _run(self) -> None:
        while not self._stopping:
            try:
                for active in list(self._active.values()):
                    await self._follow_one(active)
                await self._start_queued()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("runner: tick failed; retrying")
            stopping = any(a.stop_reason for a in self._active.values())
            interval = min(0.1, self.settings.poll_interval_s) if stopping else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval or self.settings.poll_interval_s)
            self._wake.clear()

    async def _watch(self) -> None:
        """A scheduler's view of every followed job, refreshed in a loop of its own (its
        commands may take up to their timeout; ingestion goes on meanwhile)."""
        while not self._stopping:
            try:
                for active in list(self._active.values()):
                    status = await asyncio.to_thread(self.backend.describe, active.handle)
                    key = (active.job_id, active.handle.app_id)
                    if self._statuses.get(key) != status:
                        self._statuses[key] = status
                        self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("runner: looking at the scheduler failed; retrying")
            await asyncio.sleep(min(self.settings.poll_interval_s, 1.0))

    async def _status(self, active: ActiveJob) -> AppStatus | None:
        """The backend's view of the job: the watcher's last one for a scheduler (None before
        its first look), a direct look for local processes (cheap)."""
        if not self.backend.queues_jobs:
            return self.backend.describe(active.handle)
        if self._watcher is not None and not self._watcher.done():
            return self._statuses.get((active.job_id, active.handle.app_id))
        return await asyncio.to_thread(self.backend.describe, active.handle)

    async def _follow_one(self, active: ActiveJob) -> None:
        """:meth:`_follow` of one job, whose failures stay its own: after
        :data:`FOLLOW_FAILURES` ticks in a row that fail, the job is stopped and fails; the
        other jobs and the queue go on meanwhile."""
        try:
            await self._follow(active)
            self._failures.pop(active.job_id, None)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            count = self._failures.get(active.job_id, 0) + 1
            self._failures[active.job_id] = count
            logger.exception("job %s: following it failed (%d in a row)", active.job_id, count)
            if count >= FOLLOW_FAILURES and active.damage is None:
                active.damage = f"the service cannot follow it: {type(err).__name__}: {err}"
                await self._begin_stop(active, "damaged")

    async def _follow(self, active: ActiveJob) -> None:
        """Ingest new records; finish the job if its process ended; enforce timeout/grace.
        A file of its directory the service will not read fails the job (stopped, naming the
        file and line)."""
        added = 0
        if active.damage is None:
            try:
                added = await asyncio.to_thread(
                    ingest_job, self.store, active.job_id, self.files(active.job_id)
                )
            except JobFileError as err:
                logger.warning("job %s: %s; stopping it", active.job_id, err.message)
                active.damage = err.message
                self._failures.pop(active.job_id, None)
                await self._begin_stop(active, "damaged")
        if added:
            self.notifier.notify(active.job_id)
        status = await self._status(active)
        if status is None:
            return
        if status.phase == ENDED:
            self._statuses.pop((active.job_id, active.handle.app_id), None)
            retry = await asyncio.to_thread(self.lifecycle.finish, active, status)
            self.notifier.notify(active.job_id)
            if retry is not None:  # the next attempt runs
                self._active[active.job_id] = retry
                if active.stop_reason is not None:  # a cancel came while it was starting
                    await self._begin_stop(retry, active.stop_reason)
                return
            self._active.pop(active.job_id, None)
            self.scheduler.release_gpus(active.job_id)
            self._signal_done(active.job_id)
            return
        if status.phase != active.state or status.reason != active.noted:
            if await asyncio.to_thread(self.lifecycle.observe, active, status):
                self.notifier.notify(active.job_id)
        now = time.monotonic()
        if (
            active.stop_reason is None
            and active.infeasible_since is not None
            and now - active.infeasible_since >= self.settings.slurm_infeasible_after_s
        ):
            logger.warning("job %s: Slurm cannot run it (%s)", active.job_id, active.infeasible)
            await self._begin_stop(active, "infeasible")
        if active.stop_reason is None and active.deadline is not None and now >= active.deadline:
            logger.info("job %s: timed out after %.0f s", active.job_id, active.timeout_s or 0)
            await self._begin_stop(active, "timeout")
        elif (
            active.stop_reason is not None
            and not active.killed
            and now - active.stop_sent >= self.settings.cancel_grace_s
        ):
            logger.warning("job %s: still running after SIGTERM; sending SIGKILL", active.job_id)
            await asyncio.to_thread(self.lifecycle.kill, active)
            active.killed = True

    async def _start_queued(self) -> None:
        while await self.scheduler.may_start_another(len(self._active) + len(self._launching)):
            picked, noted, failed = await asyncio.to_thread(
                self.scheduler.pick, set(self._launching), set(self._active)
            )
            for job_id in noted + failed:
                self.notifier.notify(job_id)
            for job_id in failed:
                self._signal_done(job_id)
            if failed:
                continue  # the queue changed: look again
            if picked is None:
                return
            job, devices = picked
            self._launching.add(job.id)
            try:
                active = await asyncio.to_thread(self.lifecycle.launch, job, devices)
            finally:
                self._launching.discard(job.id)
            self.notifier.notify(job.id)
            if active is None:
                self.scheduler.release_gpus(job.id)
                self._pending_cancel.discard(job.id)
                self._signal_done(job.id)
                continue
            self._active[job.id] = active
            if job.id in self._pending_cancel:
                self._pending_cancel.discard(job.id)
                await self._begin_stop(active, "cancel")

    async def _begin_stop(self, active: ActiveJob, reason: str) -> None:
        if active.stop_reason is not None:
            return
        active.stop_reason = reason
        active.stop_sent = time.monotonic()
        logger.info("job %s: %s", active.job_id, reason)
        if self.backend.queues_jobs:  # a scheduler's command may take a while: not on the loop
            await asyncio.to_thread(self.lifecycle.send_stop, active)
        else:
            self.lifecycle.send_stop(active)

    def _signal_done(self, job_id: str) -> None:
        event = self._done.pop(job_id, None)
        if event is not None:
            event.set()
