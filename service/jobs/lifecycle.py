"""The lifecycle of one job: launch it (or hand it to a scheduler), observe it, finish it (or
start its next attempt), and recover it after a service restart. Every method blocks (SQLite,
files, a scheduler's commands): the runner (``service/jobs/runner.py``) calls them in worker
threads. State changes are conditional store transitions, so a cancel racing with a launch or
an exit resolves to one outcome.

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

Restart recovery (:meth:`JobLifecycle.recover`, at the runner's ``start``): a ``running`` job
whose process still runs (same pid *and* same start time) is re-attached and followed as
before; one whose process is gone is finished from its run directory — succeeded if it wrote
result.json, else failed with the reason; queued jobs simply start. Running jobs are left
running when the service stops (unless ``cancel_on_shutdown``), to be re-attached by the next
start.

Backends (``service/jobs/backends/``, ``DLRM_VRGD_BACKEND``): what starts, observes and stops
a job's processes. The above is the ``local`` backend. With ``slurm``, every queued job is
handed to Slurm at once (no concurrency limit, no GPU allocator: Slurm queues and gives GPUs)
and stays ``queued`` here while Slurm holds it pending (its reason noted: "queued in Slurm:
Resources"); it becomes ``running`` when Slurm starts it, and ends as Slurm says it ended
(TIMEOUT, NODE_FAIL... fail it with that reason). Cancel is ``scancel``; the job is reported
cancelled once Slurm says it ended. After a restart every job with a Slurm job id is asked
about in Slurm and followed again; none is submitted twice. A job Slurm holds with a reason
that says it can never run (:data:`INFEASIBLE`) fails after ``slurm_infeasible_after_s``.

Retries (``service/jobs/retry.py``): an attempt that failed for the infrastructure's reasons
(killed by a signal, a lost rank or node, Slurm NODE_FAIL/PREEMPTED) is followed by the next
one while ``max_retries`` allow: the same command (train: always ``--resume``) in the same run
directory, at once, on the same GPUs (local) or as a new Slurm job; the job stays ``running``
and each attempt is a record on it (``attempts``) and a state event. A resumed run rewrites its
metrics files up to its checkpoint; :func:`service.jobs.ingest.ingest_job` reconciles the
stored records with them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from service.jobs.backends import process
from service.jobs.backends.base import (
    ENDED,
    PENDING,
    UNKNOWN,
    AppStatus,
    Backend,
    BackendUnavailable,
    Handle,
    LaunchRequest,
    ScheduleError,
)
from service.jobs.backends.local import JOB_ENV, LocalHandle
from service.jobs.backends.slurm import time_limit_minutes
from service.jobs.files import JobFiles, read_result, write_config
from service.jobs.gpus import read_assignment, visible_devices
from service.jobs.ingest import ingest_job
from service.jobs.kinds import KINDS
from service.jobs.models import utcnow
from service.jobs.reading import JobFileError
from service.jobs.retry import infrastructure_cause, resume_step
from service.jobs.scheduling import Scheduler
from service.jobs.states import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED
from service.jobs.store import Job, Store
from service.jobs.tracking import job_environment
from service.settings import Settings

logger = logging.getLogger(__name__)

#: Log lines kept in a failed job's reason.
REASON_LOG_LINES = 20
#: (job, its files) -> argv; the default runs the job kind's command.
CommandFn = Callable[[Job, JobFiles], list[str]]
#: Slurm pending reasons of a job that cannot run as asked (not just now: never, or not
#: until an administrator acts): reported as "held", failed after a bounded wait.
INFEASIBLE = frozenset(
    {
        "PartitionNodeLimit", "PartitionConfig", "PartitionTimeLimit", "BadConstraints",
        "InvalidAccount", "InvalidQOS", "QOSMaxNodePerJobLimit", "AssocMaxNodesPerJobLimit",
        "QOSMaxCpuPerJobLimit", "AssocMaxCpuPerJobLimit", "QOSMaxWallDurationPerJobLimit",
    }
)  # fmt: skip
#: Pending reasons said as "held" (someone must act) rather than "queued".
#: (A node or partition that is down may come back: waited out, not failed.)
HELD = INFEASIBLE | {
    "JobHeldUser", "JobHeldAdmin", "BeginTime", "Dependency", "ReqNodeNotAvail", "NodeDown",
    "PartitionDown", "PartitionInactive",
}  # fmt: skip


def new_attempt(attempt: int, backend_id: str, resumed_from_step: int | None) -> dict[str, object]:
    """The record of an attempt as it starts."""
    return {
        "attempt": attempt,
        "started_at": utcnow().isoformat(),
        "ended_at": None,
        "ended": None,
        "exit_code": None,
        "resumed_from_step": resumed_from_step,
        "backend_id": backend_id,
        "nodes": None,
    }


def first_attempt(job: Job, backend_id: str, run_dir: Path) -> dict[str, object]:
    """The attempt fields of a job the runner launches from the queue: attempt 1, or, for a
    job resubmitted after it failed or was cancelled, the next one (it resumes its run)."""
    if not job.attempts:
        return {"attempt": 1, "attempts": [new_attempt(1, backend_id, None)]}
    nxt = max(job.attempt, len(job.attempts)) + 1
    step = resume_step(run_dir) if job.kind == "train" else None
    return {"attempt": nxt, "attempts": [*job.attempts, new_attempt(nxt, backend_id, step)]}


def reason_code(why: str | None) -> str | None:
    """``ReqNodeNotAvail, UnavailableNodes:n2`` -> ``ReqNodeNotAvail``."""
    return why.split(",")[0].strip() if why else None


def backend_line(status: AppStatus, requeued: str | None = None) -> str:
    """The job's backend state in a line: ``queued: Resources``, ``held: PartitionNodeLimit``,
    ``running on n[1-2]``, ``requeued after NODE_FAIL on n2; queued: Resources``."""
    if status.phase == PENDING:
        why = status.detail
        line = f"{'held' if reason_code(why) in HELD else 'queued'}: {why}" if why else "queued"
    elif status.phase == RUNNING:
        line = f"running on {status.nodes}" if status.nodes else "running"
    elif status.phase == UNKNOWN:
        line = f"unknown: {status.reason}"
    else:
        line = f"ended: {status.scheduler_state or status.reason or '?'}"
    return f"{requeued}; {line}" if requeued and status.phase != RUNNING else line


@dataclass
class ActiveJob:
    """A launched job the runner follows."""

    job_id: str
    handle: Handle
    timeout_s: float | None
    #: monotonic time after which the job times out, if the runner enforces its timeout.
    deadline: float | None
    #: The job's state in the store as the runner last set it: ``queued`` while a scheduler
    #: holds it pending, then ``running``.
    state: str = RUNNING
    #: "cancel", "timeout", "shutdown", "infeasible" or "damaged" once the job is being stopped.
    stop_reason: str | None = None
    #: Why the service stopped following the job ("damaged"): a file of its directory it will
    #: not read (a link, a FIFO, a record line too deep), named with its line.
    damage: str | None = None
    stop_sent: float = 0.0
    killed: bool = False
    #: The last reason noted in the job's state records (pending reason, scheduler trouble).
    noted: str | None = None
    #: GPUs the local allocator gave it (a retry keeps them).
    devices: tuple[str, ...] = ()
    #: The backend state last stored on the job (``queued: Resources``, ``running on n1``).
    backend_state: str | None = None
    #: Why this attempt follows another (``requeued after NODE_FAIL on n2``), until it runs.
    requeued: str | None = None
    #: monotonic time since which the scheduler says the job can never run as asked.
    infeasible_since: float | None = None
    #: That reason (``PartitionNodeLimit``...).
    infeasible: str | None = None
    #: The nodes this attempt was seen running on (a scheduler's job).
    ran_on: str | None = None

    @property
    def pid(self) -> int | None:
        return self.handle.pid if isinstance(self.handle, LocalHandle) else None


class JobLifecycle:
    """Launch, observe, finish, retry and recover jobs; one per service (blocking calls)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        backend: Backend,
        scheduler: Scheduler,
        command: CommandFn | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.backend = backend
        #: Its GPU book keeps the GPUs of a job re-attached after a restart.
        self.scheduler = scheduler
        self._command = command or self._kind_command
        #: Queued jobs already told why the scheduler did not take them yet.
        self._handover_noted: dict[str, str] = {}

    def files(self, job_id: str) -> JobFiles:
        return JobFiles(self.settings.jobs_dir / job_id)

    def _kind_command(self, job: Job, files: JobFiles) -> list[str]:
        # the config it runs with is the one stored, whatever the job's directory holds now
        write_config(files.config, job.config)
        # always --resume: a rerun (a retry, a Slurm requeue) of a job whose run directory
        # holds a run resumes it; a fresh directory starts afresh
        return KINDS[job.kind].command(self.settings.trainer_python, files, True)

    def _child_env(self, job: Job) -> dict[str, str]:
        """The service's environment less its token, and less MLflow's credentials unless
        the job's tracking server is allowed them (service/jobs/tracking.py)."""
        env = {k: v for k, v in os.environ.items() if k != "DLRM_VRGD_TOKEN"}
        env = job_environment(env, job.kind, job.config, self.settings)
        env[JOB_ENV] = job.id
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("TQDM_MININTERVAL", "5")  # a progress line every 5 s in train.log
        return env

    def launch(self, job: Job, devices: tuple[str, ...] = ()) -> ActiveJob | None:
        """queued -> running, then start the process on ``devices`` (its GPUs); None if the
        job did not start. A backend that queues jobs gets the job while it stays queued."""
        if self.backend.queues_jobs:
            return self._hand_over(job)
        started = self.store.transition(job.id, [QUEUED], RUNNING, started_at=utcnow())
        if started is None:
            return None  # cancelled or deleted meanwhile
        files = self.files(job.id)
        timeout = job.timeout_s or self.settings.job_timeout_s
        try:
            cmd = self._command(job, files)
            request = LaunchRequest(job, files, cmd, self._child_env(job), devices, timeout)
            handle = self.backend.schedule(request)
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
        assert isinstance(handle, LocalHandle)
        self.store.update_job(
            job.id,
            pid=handle.pid,
            pgid=handle.pgid,
            proc_start=handle.proc_start,
            **first_attempt(job, handle.app_id, files.run_dir),
            backend_state=f"running (pid {handle.pid})",
        )
        if devices:
            self.store.note(job.id, f"running on GPU(s) {visible_devices(devices)}")
        logger.info(
            "job %s: started, pid %d, GPUs %s: %s",
            job.id,
            handle.pid,
            visible_devices(devices) or "none",
            " ".join(cmd),
        )
        return ActiveJob(
            job_id=job.id,
            handle=handle,
            timeout_s=timeout,
            deadline=time.monotonic() + timeout if timeout else None,
            devices=devices,
        )

    def _hand_over(self, job: Job) -> ActiveJob | None:
        """Submit a queued job to the scheduler; it stays queued until the scheduler starts
        it. A job the scheduler refuses fails with its answer; one it cannot take now (its
        controller unreachable) stays queued and is tried again."""
        files = self.files(job.id)
        timeout = job.timeout_s or self.settings.job_timeout_s
        try:
            cmd = self._command(job, files)
            request = LaunchRequest(job, files, cmd, self._child_env(job), (), timeout)
            handle = self.backend.schedule(request)
        except BackendUnavailable as err:
            logger.error("job %s: %s unavailable, trying again: %s", job.id, self.backend.name, err)
            note = f"waiting for {self.backend.name}: {err}"
            if self._handover_noted.get(job.id) != note:  # once per cause, not every tick
                self._handover_noted[job.id] = note
                self.store.note(job.id, note)
                self.store.update_job(job.id, backend_state=f"queued: {note}")
            return None
        except Exception as err:
            logger.warning("job %s: %s refused it: %s", job.id, self.backend.name, err)
            self._handover_noted.pop(job.id, None)
            message = str(err) if isinstance(err, ScheduleError) else f"could not submit: {err}"
            self.store.transition(
                job.id, [QUEUED], FAILED, message, finished_at=utcnow(), error=message
            )
            return None
        self._handover_noted.pop(job.id, None)
        active = ActiveJob(job_id=job.id, handle=handle, timeout_s=timeout, deadline=None)
        active.state = QUEUED
        stored = self.store.set_if_state(
            job.id,
            [QUEUED],
            backend=self.backend.name,
            slurm_job_id=handle.app_id,
            **first_attempt(job, handle.app_id, files.run_dir),
            backend_state=f"submitted as {self.backend.name.capitalize()} job {handle.app_id}",
        )
        if stored is None:  # cancelled (or deleted) while sbatch ran: end it there too
            logger.info("job %s: cancelled while being submitted; cancelling it there", job.id)
            with contextlib.suppress(BackendUnavailable):
                self.backend.cancel(handle)
            self.backend.settle(handle)
            return None
        note = f"submitted to {self.backend.name} as job {handle.app_id}"
        self.store.note(job.id, note)
        logger.info("job %s: %s: %s", job.id, note, " ".join(cmd))
        return active

    def observe(self, active: ActiveJob, status: AppStatus) -> bool:
        """Record what the backend says of a job that has not ended: queued -> running when
        the scheduler starts it; its backend state (``queued: Resources``, ``running on
        n[1-2]``) on the job; its pending reason or trouble as a note. True if recorded."""
        if status.phase == PENDING and active.ran_on is not None:
            self._requeued_by_scheduler(active)
        if status.phase == RUNNING and status.nodes:
            active.requeued, active.ran_on = None, status.nodes
        line = backend_line(status, active.requeued)
        changed = False
        if line != active.backend_state:
            active.backend_state = line
            fields: dict[str, object] = {"backend_state": line}
            if status.nodes:
                fields["nodes"] = status.nodes
                job = self.store.get_job(active.job_id)
                if job is not None and job.attempts and not job.attempts[-1].get("nodes"):
                    attempts = [dict(a) for a in job.attempts]
                    attempts[-1]["nodes"] = status.nodes
                    fields["attempts"] = attempts
            self.store.update_job(active.job_id, **fields)
            changed = True
        if status.phase == PENDING and reason_code(status.detail) in INFEASIBLE:
            if active.infeasible != status.detail:
                active.infeasible, active.infeasible_since = status.detail, time.monotonic()
        else:
            active.infeasible = active.infeasible_since = None
        if status.phase == UNKNOWN:
            if status.reason == active.noted:
                return changed
            active.noted = status.reason
            logger.warning("job %s: %s", active.job_id, status.reason)
            self.store.note(active.job_id, f"cannot follow it now: {status.reason}")
            return True
        if status.phase == PENDING or active.state == RUNNING:
            if status.reason == active.noted or not status.reason:
                return changed
            active.noted = status.reason
            self.store.note(active.job_id, status.reason)
            return True
        on = f" on {status.nodes}" if status.nodes else ""
        message = f"{status.reason or 'running'}{on}"
        moved = self.store.transition(
            active.job_id, [QUEUED], RUNNING, message, started_at=utcnow()
        )
        active.state, active.noted = RUNNING, status.reason
        if moved is not None:
            logger.info("job %s: %s", active.job_id, message)
        return moved is not None or changed

    def send_stop(self, active: ActiveJob) -> None:
        try:
            self.backend.cancel(active.handle)
            if self.settings.cancel_grace_s <= 0:
                self.kill(active)
                active.killed = True
        except BackendUnavailable as err:  # asked again after the grace period
            logger.error("job %s: could not %s it: %s", active.job_id, active.stop_reason, err)

    def kill(self, active: ActiveJob) -> None:
        """The grace period is over: SIGKILL the job's processes (ask the scheduler again)."""
        try:
            self.backend.kill(active.handle)
        except BackendUnavailable as err:
            logger.error("job %s: could not kill it: %s", active.job_id, err)

    def finish(
        self, active: ActiveJob, status: AppStatus, orphaned: bool = False
    ) -> ActiveJob | None:
        """Settle a job whose main process ended: ingest the rest, clean the group, decide.
        Returns the next attempt when the job is retried (see service/jobs/retry.py)."""
        if active.damage is None:
            try:
                ingest_job(self.store, active.job_id, self.files(active.job_id))
            except JobFileError as err:  # the job fails alone, naming the file and line
                active.damage = err.message
        self.backend.settle(active.handle)
        if active.damage is not None:
            return self._fail_damaged(active, status)
        if self.backend.queues_jobs:
            return self._finish_scheduled(active, status)
        assert isinstance(active.handle, LocalHandle)
        pid, exit_code = active.handle.pid, status.exit_code
        files = self.files(active.job_id)
        result = read_result(files)
        finished = result is not None and (exit_code == 0 or exit_code is None)
        now = utcnow()
        fields: dict[str, object] = {"finished_at": now, "exit_code": exit_code}
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
            fields["error"] = self._reason(message, active)
        else:
            state = FAILED
            how = process.describe_exit(exit_code)
            retry, cause = self._retry(active, exit_code, None)
            if retry is not None:
                return retry
            if orphaned:
                message = (
                    f"process {pid} was gone when the service restarted ({how}; "
                    "it ended while the service was down)"
                )
            elif active.handle.popen is None:
                message = f"process {pid} ended without a result ({how}; re-attached job)"
            elif exit_code == 0:
                message = "exit status 0 but no result.json"
            else:
                message = how
            message += cause
            fields["error"] = self._reason(message, active)
        self._end_attempt(active.job_id, message or state, exit_code, fields)
        fields["backend_state"] = f"ended: {message or state}"
        job = self.store.transition(active.job_id, [RUNNING], state, message, **fields)
        if job is not None:
            logger.info("job %s: %s%s", active.job_id, state, f" ({message})" if message else "")
        return None

    def _fail_damaged(self, active: ActiveJob, status: AppStatus) -> None:
        """End a job whose directory holds a file the service will not read: failed, naming
        it (never retried: the next attempt would find the same file)."""
        message = f"the job's files cannot be trusted: {active.damage}"
        fields: dict[str, object] = {"finished_at": utcnow(), "exit_code": status.exit_code}
        fields["error"] = message
        self._end_attempt(active.job_id, message, status.exit_code, fields)
        fields["backend_state"] = f"ended: {message}"
        job = self.store.transition(active.job_id, [QUEUED, RUNNING], FAILED, message, **fields)
        if job is not None:
            logger.warning("job %s: failed (%s)", active.job_id, message)
        return None

    def _finish_scheduled(self, active: ActiveJob, status: AppStatus) -> ActiveJob | None:
        """Settle a job the scheduler says ended, from its verdict (and result.json)."""
        files = self.files(active.job_id)
        result = read_result(files)
        label = f"{self.backend.name.capitalize()} job {active.handle.app_id}"
        code = status.exit_code
        fields: dict[str, object] = {"finished_at": utcnow(), "exit_code": code}
        if status.outcome is None and result is not None:
            state, fields["result"] = SUCCEEDED, result
            message = None
            if active.stop_reason is not None:
                message = f"finished before the {active.stop_reason} took effect"
        elif status.outcome is None:
            state = FAILED
            message = f"{label} {status.reason or 'ended'} but the run wrote no result.json"
            fields["error"] = self._reason(message, active)
        elif status.outcome == "cancelled" and active.stop_reason == "infeasible":
            state = FAILED
            message = (
                f"{label}: Slurm cannot run this job as asked ({active.infeasible}); it "
                f"waited {self.settings.slurm_infeasible_after_s:g} s and was cancelled"
            )
            fields["error"] = message
        elif status.outcome == "cancelled":
            state = CANCELLED
            if active.stop_reason == "cancel":
                message = "cancelled"
            elif active.stop_reason == "shutdown":
                message = "the service shut down"
            else:
                message = f"{label} {status.reason}: cancelled outside the service"
        else:
            state = FAILED
            if active.stop_reason is None:
                retry, cause = self._retry(active, code, status.scheduler_state)
                if retry is not None:
                    return retry
            else:
                cause = ""
            message = f"{label} {status.reason}"
            if status.scheduler_state == "TIMEOUT" and active.timeout_s:
                message += f" ({time_limit_minutes(active.timeout_s)} min)"
            if code:
                message += f", {process.describe_exit(code)}"
            details = self.backend.explain(active.handle, files)
            if details:
                message += "; " + "; ".join(details)
            message += cause
            fields["error"] = self._reason(message, active)
        if state == SUCCEEDED:  # ran between two looks: it was running after all
            self.store.transition(
                active.job_id, [QUEUED], RUNNING, status.reason, started_at=utcnow()
            )
        self._end_attempt(active.job_id, message or status.reason or state, code, fields)
        fields["backend_state"] = f"ended: {status.scheduler_state or state}"
        job = self.store.transition(active.job_id, [QUEUED, RUNNING], state, message, **fields)
        if job is not None:
            logger.info("job %s: %s%s", active.job_id, state, f" ({message})" if message else "")
        return None

    def _requeued_by_scheduler(self, active: ActiveJob) -> None:
        """The scheduler put a running job back in its queue itself (``scontrol requeue``,
        preemption with requeue): the same batch script reruns and resumes (it always passes
        ``--resume``); record the next attempt."""
        job = self.store.get_job(active.job_id)
        if job is None:
            return
        cause = f"requeued by {self.backend.name.capitalize()} (it ran on {active.ran_on})"
        fields: dict[str, object] = {}
        attempts = self._end_attempt(job.id, cause, None, fields)
        step = resume_step(self.files(job.id).run_dir) if job.kind == "train" else None
        attempts.append(new_attempt(max(job.attempt, 1) + 1, active.handle.app_id, step))
        self.store.update_job(job.id, attempt=max(job.attempt, 1) + 1, attempts=attempts)
        self.store.note(job.id, f"attempt {max(job.attempt, 1)} ended: {cause}")
        active.requeued, active.ran_on = cause, None

    def _end_attempt(
        self, job_id: str, ended: str, exit_code: int | None, fields: dict[str, object]
    ) -> list[dict[str, object]]:
        """Close the job's current attempt record (into ``fields["attempts"]``)."""
        job = self.store.get_job(job_id)
        attempts = [dict(a) for a in (job.attempts if job is not None else [])]
        if attempts and attempts[-1].get("ended_at") is None:
            attempts[-1].update(
                ended_at=utcnow().isoformat(), ended=ended.split("; last log lines")[0],
                exit_code=exit_code,
            )  # fmt: skip
            fields["attempts"] = attempts
        return attempts

    def _retry(
        self, active: ActiveJob, exit_code: int | None, scheduler_state: str | None
    ) -> tuple[ActiveJob | None, str]:
        """Start the job's next attempt if this one failed for the infrastructure's reasons
        and retries are left: (the next attempt, "") ; else (None, what to add to the job's
        reason: the cause and "no retries left", or "")."""
        job = self.store.get_job(active.job_id)
        if job is None or job.state not in (QUEUED, RUNNING) or active.stop_reason is not None:
            return None, ""
        files = self.files(job.id)
        lines = list(self.backend.log_iter(active.handle, files, 2000))  # whole tracebacks
        cause = infrastructure_cause(exit_code, lines, files, scheduler_state)
        if cause is None:
            return None, ""
        attempt = max(job.attempt, 1)
        if attempt - 1 >= job.max_retries:
            return None, (
                f" (an infrastructure failure: {cause}; no retries left, max_retries "
                f"{job.max_retries})"
            )
        step = resume_step(files.run_dir) if job.kind == "train" else None
        nxt = attempt + 1
        fields: dict[str, object] = {}
        attempts = self._end_attempt(job.id, cause, exit_code, fields)
        try:
            cmd = self._command(job, files)
            env = self._child_env(job)
            request = LaunchRequest(job, files, cmd, env, active.devices, active.timeout_s)
            handle = self.backend.schedule(request)
        except Exception as err:
            logger.exception("job %s: could not start attempt %d", job.id, nxt)
            return None, f" ({cause}; its retry could not start: {err})"
        attempts.append(new_attempt(nxt, handle.app_id, step))
        what = "a finished cell is skipped" if step is None else f"resumes from step {step}"
        if job.kind == "score":
            what = "starts over"
        total = job.max_retries + 1
        message = f"attempt {attempt} ended: {cause}; attempt {nxt} of {total} {what}"
        requeued = f"requeued after {cause}" if self.backend.queues_jobs else None
        fields.update(
            attempt=nxt, attempts=attempts, backend_state=requeued or f"restarted after {cause}"
        )
        if isinstance(handle, LocalHandle):
            fields.update(pid=handle.pid, pgid=handle.pgid, proc_start=handle.proc_start)
        else:
            fields.update(slurm_job_id=handle.app_id)
            message += f" (Slurm job {handle.app_id})"
        self.store.update_job(job.id, **fields)
        self.store.note(job.id, message)
        logger.warning("job %s: %s", job.id, message)
        return (
            ActiveJob(
                job_id=job.id,
                handle=handle,
                timeout_s=active.timeout_s,
                deadline=active.deadline,
                state=active.state,
                devices=active.devices,
                backend_state=str(fields["backend_state"]),
                requeued=requeued,
            ),
            "",
        )

    def _reason(self, head: str, active: ActiveJob) -> str:
        files = self.files(active.job_id)
        lines = list(self.backend.log_iter(active.handle, files, REASON_LOG_LINES))
        if not lines:
            return head
        return head + "; last log lines:\n" + "\n".join(lines)

    def recover(self) -> list[ActiveJob]:
        """Settle or re-attach the jobs a previous service left ``running`` (and, with a
        scheduler, the ``queued`` ones it had handed over)."""
        reattached = []
        jobs = self.store.jobs_in_state(RUNNING)
        if self.backend.queues_jobs:
            jobs += self.store.jobs_in_state(QUEUED)
        for job in jobs:
            try:
                self._recover_one(job, reattached)
            except Exception as err:  # one job the service cannot settle never stops the start
                logger.exception("job %s: could not be recovered", job.id)
                message = f"could not be followed after a restart: {type(err).__name__}: {err}"
                self.store.transition(
                    job.id, [QUEUED, RUNNING], FAILED, message, finished_at=utcnow(),
                    error=message,
                )  # fmt: skip
        return reattached

    def _recover_one(self, job: Job, reattached: list[ActiveJob]) -> None:
        """Settle or re-attach one job (appended to ``reattached`` when it is followed)."""
        launched_by = job.backend or "local"
        if launched_by != self.backend.name:
            if job.state == QUEUED:
                return  # never handed over: this backend will run it
            message = (
                f"started through the {launched_by} backend; this service runs "
                f"{self.backend.name} (DLRM_VRGD_BACKEND) and cannot follow it"
            )
            logger.error("job %s: %s", job.id, message)
            self.store.transition(
                job.id, [RUNNING], FAILED, message, finished_at=utcnow(), error=message
            )
            return
        handle = self.backend.recover(job)
        if handle is None:
            if job.state == QUEUED:
                return  # never handed over: it starts like any queued job
            self.store.transition(
                job.id,
                [RUNNING],
                FAILED,
                "the service stopped while starting it",
                finished_at=utcnow(),
                error="the service stopped while starting this job; it did not run",
            )
            return
        timeout = job.timeout_s or self.settings.job_timeout_s
        deadline = None
        if timeout and job.started_at is not None and not self.backend.enforces_time_limit:
            elapsed = (utcnow() - job.started_at).total_seconds()
            deadline = time.monotonic() + max(0.0, timeout - elapsed)
        active = ActiveJob(job_id=job.id, handle=handle, timeout_s=timeout, deadline=deadline)
        active.state, active.backend_state = job.state, job.backend_state
        if not self.backend.queues_jobs:
            active.devices = tuple(read_assignment(self.files(job.id).root, job.pid) or ())
        if self.backend.queues_jobs:
            if job.slurm_job_id is None:
                self.store.set_if_state(
                    job.id,
                    [QUEUED, RUNNING],
                    backend=self.backend.name,
                    slurm_job_id=handle.app_id,
                )
            label = f"{self.backend.name.capitalize()} job {handle.app_id}"
            logger.warning("job %s: following %s again", job.id, label)
            self.store.note(job.id, f"following {label} again after a restart")
            reattached.append(active)
            return
        assert isinstance(handle, LocalHandle)
        status = self.backend.describe(handle)
        if status.phase != ENDED:
            logger.warning("job %s: re-attached to process %d", job.id, handle.pid)
            self.store.note(job.id, f"re-attached to process {handle.pid} after a restart")
            self.scheduler.adopt_gpus(job)
            reattached.append(active)
        else:  # its exit status, if its supervisor recorded one
            logger.warning("job %s: process %d is gone", job.id, handle.pid)
            retry = self.finish(active, status, orphaned=True)
            if retry is not None:  # it died while the service was down: retried now
                self.scheduler.adopt_gpus(job)
                reattached.append(retry)
