"""The runner: starts queued jobs (FIFO, at most ``max_concurrent_jobs`` at once), tails their
run directories into the store, enforces timeouts, cancels, and recovers after a restart.

Lifecycle of a job::

    queued --launch--> running --exit 0 + result.json--> succeeded
       |                  |------exit != 0 / no result--> failed   (reason: exit status + log)
       |                  |------timeout: SIGTERM, SIGKILL--> failed
       |                  `------cancel:  SIGTERM, SIGKILL--> cancelled
       `------cancel-------------------------------------> cancelled

A job runs as one command (``dlrm-vrgd train ...``, which may start torchrun) in its own
session and process group, under a small supervisor (``service/jobs/supervise.py``) that
records its exit status in ``jobs/<id>/exit.json``: how a re-attached job ended is known too.
Ending it signals the whole group: SIGTERM, then SIGKILL after ``cancel_grace_s``; a job is
only reported ended once no process of its group is left.

The runner is one asyncio task on the service's event loop; every blocking step (SQLite,
files, waiting for a process group) runs in a worker thread. State changes are conditional
store transitions, so a cancel racing with a launch or an exit resolves to one outcome.

Restart recovery (``start``): a ``running`` job whose process still runs (same pid *and* same
start time) is re-attached and followed as before; one whose process is gone is finished from
its run directory — succeeded if it wrote result.json, else failed with the reason; queued jobs
simply start. Running jobs are left running when the service stops (unless
``cancel_on_shutdown``), to be re-attached by the next start.

GPUs (``service/jobs/gpus.py``): a job starts only when the GPUs it asks for are free; it gets
them in ``CUDA_VISIBLE_DEVICES`` (a CPU job gets none) and holds them until it ends, however it
ends; a re-attached job keeps the GPUs it had. A queued job that asks for more GPUs than the
host has fails at once instead of blocking the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from service.errors import IllegalTransition, JobNotFound
from service.jobs import process, supervise
from service.jobs.files import JobFiles, read_result, tail_lines
from service.jobs.gpus import (
    GPU_ENV,
    GpuAllocator,
    gpus_needed,
    next_job,
    read_assignment,
    resolve_gpus,
    visible_devices,
    write_assignment,
)
from service.jobs.ingest import read_new_records, update_progress
from service.jobs.kinds import KINDS
from service.jobs.models import utcnow
from service.jobs.notifier import Notifier
from service.jobs.states import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, TERMINAL
from service.jobs.store import Job, Store
from service.settings import Settings

logger = logging.getLogger(__name__)

#: Log lines kept in a failed job's reason.
REASON_LOG_LINES = 20
#: Seconds to wait for a process group to vanish after SIGKILL.
KILL_WAIT_S = 5.0

#: Environment variable naming the job in every process of it (torchrun's workers included,
#: which run in sessions of their own): how the runner finds all of a job's processes.
JOB_ENV = "DLRM_VRGD_JOB_ID"
#: (job, its files) -> argv; the default runs the job kind's command.
CommandFn = Callable[[Job, JobFiles], list[str]]


@dataclass
class ActiveJob:
    """A running job the runner follows."""

    job_id: str
    pid: int
    pgid: int
    proc_start: str | None
    timeout_s: float | None
    #: monotonic time after which the job times out, if it has a timeout.
    deadline: float | None
    #: Our child; None for a job re-attached after a restart (not our child: its exit status
    #: comes from the supervisor's exit.json, if it could write one).
    popen: subprocess.Popen[bytes] | None
    #: "cancel", "timeout" or "shutdown" once the job is being stopped.
    stop_reason: str | None = None
    stop_sent: float = 0.0
    killed: bool = False

    def exit_status(self) -> tuple[bool, int | None]:
        """(exited?, exit status when known)."""
        if self.popen is not None:
            rc = self.popen.poll()
            return rc is not None, rc
        return not process.is_alive(self.pid, self.proc_start), None


class Runner:
    """Runs jobs from the store; one per service."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        notifier: Notifier,
        command: CommandFn | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.notifier = notifier
        self._command = command or self._kind_command
        #: The GPUs jobs may use and which job holds which.
        self.gpus = GpuAllocator(resolve_gpus(settings.gpus, os.environ.get(GPU_ENV)))
        #: Queued jobs already told that they wait for GPUs.
        self._gpu_waiting: set[str] = set()
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

    # --------------------------------------------------------------------------- public
    def files(self, job_id: str) -> JobFiles:
        return JobFiles(self.settings.jobs_dir / job_id)

    @property
    def active_pids(self) -> dict[str, int]:
        """job id -> pid of the jobs being followed."""
        return {job_id: a.pid for job_id, a in self._active.items()}

    async def start(self) -> None:
        """Recover jobs left running by a previous service, then start the loop."""
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        logger.info("GPUs for jobs: %s", ",".join(self.gpus.devices) or "none")
        for active in await asyncio.to_thread(self._recover):
            self._active[active.job_id] = active
        self._task = asyncio.create_task(self._run(), name="dlrm-vrgd-runner")

    async def stop(self) -> None:
        """Stop the loop; cancel running jobs if ``cancel_on_shutdown``, else leave them."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if not self._active:
            return
        if not self.settings.cancel_on_shutdown:
            logger.info(
                "leaving %d running job(s) running; the next start re-attaches them",
                len(self._active),
            )
            for active in self._active.values():
                if active.popen is not None:
                    # Not ours to wait for any more; stops Popen.__del__ warning about it.
                    active.popen.returncode = 0
            self._active.clear()
            return
        for active in self._active.values():
            self._begin_stop(active, "shutdown")
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
        if job.state == QUEUED:
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
            self._begin_stop(active, "cancel")
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
                    await self._follow(active)
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

    async def _follow(self, active: ActiveJob) -> None:
        """Ingest new records; finish the job if its process ended; enforce timeout/grace."""
        added = await asyncio.to_thread(self._ingest, active.job_id)
        if added:
            self.notifier.notify(active.job_id)
        exited, status = active.exit_status()
        if exited:
            await asyncio.to_thread(self._finish, active, status)
            self._active.pop(active.job_id, None)
            self._release_gpus(active.job_id)
            self.notifier.notify(active.job_id)
            self._signal_done(active.job_id)
            return
        now = time.monotonic()
        if active.stop_reason is None and active.deadline is not None and now >= active.deadline:
            logger.info("job %s: timed out after %.0f s", active.job_id, active.timeout_s or 0)
            self._begin_stop(active, "timeout")
        elif (
            active.stop_reason is not None
            and not active.killed
            and now - active.stop_sent >= self.settings.cancel_grace_s
        ):
            logger.warning("job %s: still running after SIGTERM; sending SIGKILL", active.job_id)
            await asyncio.to_thread(self._kill_all, active)
            active.killed = True

    async def _start_queued(self) -> None:
        while len(self._active) + len(self._launching) < self.settings.max_concurrent_jobs:
            picked, noted, failed = await asyncio.to_thread(self._pick_queued)
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
                active = await asyncio.to_thread(self._launch, job, devices)
            finally:
                self._launching.discard(job.id)
            self.notifier.notify(job.id)
            if active is None:
                self._release_gpus(job.id)
                self._pending_cancel.discard(job.id)
                self._signal_done(job.id)
                continue
            self._active[job.id] = active
            if job.id in self._pending_cancel:
                self._pending_cancel.discard(job.id)
                self._begin_stop(active, "cancel")

    def _begin_stop(self, active: ActiveJob, reason: str) -> None:
        if active.stop_reason is not None:
            return
        active.stop_reason = reason
        active.stop_sent = time.monotonic()
        logger.info("job %s: %s: SIGTERM to process group %d", active.job_id, reason, active.pgid)
        process.signal_group(active.pgid, signal.SIGTERM)
        process.signal_processes(self._processes(active), signal.SIGTERM)
        if self.settings.cancel_grace_s <= 0:
            self._kill_all(active)
            active.killed = True

    def _signal_done(self, job_id: str) -> None:
        event = self._done.pop(job_id, None)
        if event is not None:
            event.set()

    def _release_gpus(self, job_id: str) -> None:
        freed = self.gpus.release(job_id)
        self._gpu_waiting.discard(job_id)
        if freed:
            logger.info("job %s: GPUs %s free again", job_id, ",".join(freed))

    # ------------------------------------------------------------- blocking (in threads)
    def _pick_queued(
        self,
    ) -> tuple[tuple[Job, tuple[str, ...]] | None, list[str], list[str]]:
        """The next queued job to start with the GPUs allocated to it (or None), the jobs
        just told that they wait for GPUs, and the jobs failed for asking more than the host
        has. FIFO; see :func:`service.jobs.gpus.next_job` for who may overtake whom."""
        backfill = self.settings.gpu_backfill
        if backfill:
            queue = [j for j in self.store.jobs_in_state(QUEUED) if j.id not in self._launching]
        else:
            head = self.store.next_queued(self._launching)
            queue = [head] if head is not None else []
        needs = [(job, gpus_needed(job.config)) for job in queue]
        failed = []
        for job, need in needs:
            if need > self.gpus.capacity:  # e.g. queued before a restart with fewer GPUs
                message = (
                    f"asks for {need} GPU(s) (run.device cuda, run.nproc_per_node {need}); "
                    f"this host has {self.gpus.capacity} for jobs (DLRM_VRGD_GPUS)"
                )
                self.store.transition(
                    job.id, [QUEUED], FAILED, message, finished_at=utcnow(), error=message
                )
                failed.append(job.id)
        if failed:
            return None, [], failed
        job, waiting = next_job(needs, len(self.gpus.free()), backfill)
        noted = []
        for w in waiting:
            if w.id not in self._gpu_waiting:
                self._gpu_waiting.add(w.id)
                need = gpus_needed(w.config)
                free = len(self.gpus.free())
                self.store.note(w.id, f"waiting for {need} GPU(s); {free} free")
                noted.append(w.id)
        if job is None:
            return None, noted, []
        self._gpu_waiting.discard(job.id)
        return (job, self.gpus.allocate(job.id, gpus_needed(job.config))), noted, []

    def _kind_command(self, job: Job, files: JobFiles) -> list[str]:
        return KINDS[job.kind].command(self.settings.trainer_python, files, False)

    def _child_env(self, job_id: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "DLRM_VRGD_TOKEN"}
        env[JOB_ENV] = job_id
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("TQDM_MININTERVAL", "5")  # a progress line every 5 s in train.log
        return env

    def _launch(self, job: Job, devices: tuple[str, ...] = ()) -> ActiveJob | None:
        """queued -> running, then start the process on ``devices`` (its GPUs); None if the
        job did not start."""
        started = self.store.transition(job.id, [QUEUED], RUNNING, started_at=utcnow())
        if started is None:
            return None  # cancelled or deleted meanwhile
        files = self.files(job.id)
        try:
            cmd = self._command(job, files)
            files.root.mkdir(parents=True, exist_ok=True)
            write_assignment(files.root, devices)
            exit_file = files.root / supervise.EXIT_FILE
            exit_file.unlink(missing_ok=True)
            env = self._child_env(job.id)
            env[GPU_ENV] = visible_devices(devices)
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # indices as nvidia-smi's
            popen = process.spawn(supervise.wrap(cmd, exit_file), files.root, files.log, env)
        except Exception as err:
            logger.exception("job %s: could not start", job.id)
            self.store.transition(
                job.id,
                [RUNNING],
                FAILED,
                "could not start",
                finished_at=utcnow(),
                error=f"could not start the job: {err}",
            )
            return None
        if self.settings.job_nice:
            process.renice(popen.pid, self.settings.job_nice)
        self.store.update_job(
            job.id, pid=popen.pid, pgid=popen.pid, proc_start=process.start_time(popen.pid)
        )
        timeout = job.timeout_s or self.settings.job_timeout_s
        if devices:
            self.store.note(job.id, f"running on GPU(s) {visible_devices(devices)}")
        logger.info(
            "job %s: started, pid %d, GPUs %s: %s",
            job.id,
            popen.pid,
            visible_devices(devices) or "none",
            " ".join(cmd),
        )
        return ActiveJob(
            job_id=job.id,
            pid=popen.pid,
            pgid=popen.pid,
            proc_start=process.start_time(popen.pid),
            timeout_s=timeout,
            deadline=time.monotonic() + timeout if timeout else None,
            popen=popen,
        )

    def _ingest(self, job_id: str) -> int:
        """Tail the job's metrics.jsonl and gsnr.jsonl into the store."""
        job = self.store.get_job(job_id)
        if job is None:
            return 0
        files = self.files(job_id)
        reads = {}
        for stream, path, offset in (
            ("metrics", files.metrics, job.metrics_offset),
            ("gsnr", files.gsnr, job.gsnr_offset),
        ):
            got = read_new_records(path, offset)
            if got is None:
                logger.warning("job %s: %s was rewritten; reading it again", job_id, path.name)
                self.store.reset_stream(job_id, stream)
                got = read_new_records(path, 0) or ([], 0)
            reads[stream] = got
        (metrics, m_off), (gsnr, g_off) = reads["metrics"], reads["gsnr"]
        if not metrics and not gsnr and (m_off, g_off) == (job.metrics_offset, job.gsnr_offset):
            return 0
        progress = update_progress(job.progress, metrics, gsnr)
        progress["updated_at"] = utcnow().isoformat()
        return self.store.ingest(job_id, metrics, m_off, gsnr, g_off, progress)

    def _processes(self, active: ActiveJob) -> list[int]:
        return process.job_processes(active.pgid, f"{JOB_ENV}={active.job_id}")

    def _kill_all(self, active: ActiveJob) -> None:
        """SIGKILL the job's process group and every process carrying its marker."""
        process.signal_group(active.pgid, signal.SIGKILL)
        process.signal_processes(self._processes(active), signal.SIGKILL)

    def _reap_group(self, active: ActiveJob) -> None:
        """SIGKILL whatever is left of the job and wait until no process of it is left."""
        if not self._processes(active):
            return
        logger.info("job %s: killing its remaining processes", active.job_id)
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:
            left = self._processes(active)
            if not left:
                return
            process.signal_group(active.pgid, signal.SIGKILL)
            process.signal_processes(left, signal.SIGKILL)
            time.sleep(0.05)
        logger.error("job %s: processes %s survive SIGKILL", active.job_id, self._processes(active))

    def _finish(self, active: ActiveJob, status: int | None, orphaned: bool = False) -> None:
        """Settle a job whose main process ended: ingest the rest, clean the group, decide."""
        self._ingest(active.job_id)
        self._reap_group(active)
        files = self.files(active.job_id)
        if status is None:  # not our child (re-attached, or ended while we were down)
            status = supervise.read_exit_code(files.root / supervise.EXIT_FILE)
        result = read_result(files)
        finished = result is not None and (status == 0 or status is None)
        now = utcnow()
        fields: dict[str, object] = {"finished_at": now, "exit_code": status}
        if finished and active.stop_reason in (None, "cancel", "timeout", "shutdown"):
            note = None
            if active.stop_reason is not None:
                note = f"finished before the {active.stop_reason} took effect"
            elif orphaned:
                note = "finished while the service was down"
            state, fields["result"] = SUCCEEDED, result
            message = note
        elif active.stop_reason in ("cancel", "shutdown"):
            state = CANCELLED
            message = "cancelled" if active.stop_reason == "cancel" else "the service shut down"
        elif active.stop_reason == "timeout":
            state = FAILED
            message = f"timed out after {active.timeout_s:g} s"
            fields["error"] = self._reason(message, files)
        else:
            state = FAILED
            how = process.describe_exit(status)
            if orphaned:
                message = (
                    f"process {active.pid} was gone when the service restarted ({how}; "
                    "it ended while the service was down)"
                )
            elif active.popen is None:
                message = f"process {active.pid} ended without a result ({how}; re-attached job)"
            elif status == 0:
                message = "exit status 0 but no result.json"
            else:
                message = how
            fields["error"] = self._reason(message, files)
        job = self.store.transition(active.job_id, [RUNNING], state, message, **fields)
        if job is not None:
            logger.info("job %s: %s%s", active.job_id, state, f" ({message})" if message else "")

    @staticmethod
    def _reason(head: str, files: JobFiles) -> str:
        lines = tail_lines(files.log, REASON_LOG_LINES)
        if not lines:
            return head
        return head + "; last log lines:\n" + "\n".join(lines)

    def _recover(self) -> list[ActiveJob]:
        """Settle or re-attach the jobs a previous service left ``running``."""
        reattached = []
        for job in self.store.jobs_in_state(RUNNING):
            if job.pid is None or job.pgid is None:
                self.store.transition(
                    job.id,
                    [RUNNING],
                    FAILED,
                    "the service stopped while starting it",
                    finished_at=utcnow(),
                    error="the service stopped while starting this job; it did not run",
                )
                continue
            timeout = job.timeout_s or self.settings.job_timeout_s
            deadline = None
            if timeout and job.started_at is not None:
                elapsed = (utcnow() - job.started_at).total_seconds()
                deadline = time.monotonic() + max(0.0, timeout - elapsed)
            active = ActiveJob(
                job_id=job.id,
                pid=job.pid,
                pgid=job.pgid,
                proc_start=job.proc_start,
                timeout_s=timeout,
                deadline=deadline,
                popen=None,
            )
            if process.is_alive(job.pid, job.proc_start):
                logger.warning("job %s: re-attached to process %d", job.id, job.pid)
                self.store.note(job.id, f"re-attached to process {job.pid} after a restart")
                self._adopt_gpus(job)
                reattached.append(active)
            else:
                logger.warning("job %s: process %d is gone", job.id, job.pid)
                self._finish(active, None, orphaned=True)
        return reattached

    def _adopt_gpus(self, job: Job) -> None:
        """A re-attached job keeps the GPUs it was given."""
        devices = read_assignment(self.files(job.id).root, job.pid)
        if devices is None:
            if gpus_needed(job.config):
                logger.error(
                    "job %s: re-attached, but which GPUs it uses is unknown; they may be "
                    "given to another job",
                    job.id,
                )
            return
        for problem in self.gpus.adopt(job.id, devices):
            logger.warning("job %s: %s", job.id, problem)
