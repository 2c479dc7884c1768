"""The interface between the runner and whatever runs a job's processes.

The verbs follow TorchX's scheduler interface (``schedule``, ``describe``, ``log_iter``,
``cancel``, ``list``), plus ``recover`` (find a job again after a service restart) and the
two steps a process-owning backend needs (``kill`` after the grace period, ``settle`` once the
job ended). A backend never touches the store: it starts, observes and stops; the runner
decides what each observation means for the job.

A job's phase as a backend sees it (:class:`AppStatus.phase`):

* ``pending``: handed over, not running yet (Slurm's queue; never for the local backend);
* ``running``: its processes run;
* ``ended``: nothing of it runs any more; ``exit_code`` and, for a scheduler, its verdict
  (``scheduler_state`` and ``reason``) say how it ended;
* ``unknown``: the backend could not tell (a scheduler that does not answer); ask again.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from service.jobs.files import JobFiles, tail_lines
from service.jobs.reading import JobFileError
from service.jobs.store import Job

Phase = Literal["pending", "running", "ended", "unknown"]
PENDING: Phase = "pending"
RUNNING: Phase = "running"
ENDED: Phase = "ended"
UNKNOWN: Phase = "unknown"

#: What the runner makes of a scheduler's verdict on an ended job.
Outcome = Literal["succeeded", "failed", "cancelled"]


class BackendUnavailable(RuntimeError):
    """The backend cannot take jobs now (Slurm missing, its controller unreachable)."""


class ScheduleError(RuntimeError):
    """The backend refused the job (bad partition, too many GPUs...): the job fails."""


@dataclass(frozen=True)
class LaunchRequest:
    """Everything a backend needs to start one job."""

    job: Job
    files: JobFiles
    #: The job kind's command (``python -m dlrm_vrgd.cli train ...``).
    cmd: list[str]
    #: The job's environment (the service's, minus its token, plus the job marker).
    env: Mapping[str, str]
    #: GPUs the local allocator gave the job (``CUDA_VISIBLE_DEVICES`` values).
    devices: tuple[str, ...] = ()
    #: Wall-clock limit in seconds, if any.
    time_limit_s: float | None = None


@dataclass(frozen=True)
class AppStatus:
    phase: Phase
    #: Exit status when known (negative = killed by that signal).
    exit_code: int | None = None
    #: The scheduler's own state name (``RUNNING``, ``CANCELLED by 0``...); None for local.
    scheduler_state: str | None = None
    #: For a scheduler's ended job: what it means for the job; None = decide from the run
    #: directory (result.json) as for a local process.
    outcome: Outcome | None = None
    #: A line for people: why it waits, how it ended.
    reason: str | None = None
    #: Where it runs (Slurm's node list).
    nodes: str | None = None
    #: The scheduler's own reason code of a pending job (``Resources``, ``PartitionNodeLimit``).
    detail: str | None = None


@dataclass
class Handle:
    """One launched job, as its backend knows it (backends subclass it)."""

    job_id: str
    #: The backend's id of the job: the pid (local), the Slurm job id.
    app_id: str


class Backend(abc.ABC):
    """Runs jobs for the runner."""

    name: ClassVar[str]
    #: The backend queues jobs itself (Slurm): the service's concurrency limit and its GPU
    #: allocator do not apply; every queued job is handed over at once.
    queues_jobs: ClassVar[bool] = False
    #: The backend enforces the job's time limit itself (Slurm's ``--time``).
    enforces_time_limit: ClassVar[bool] = False

    def check(self) -> None:  # noqa: B027 (nothing to check by default)
        """Raise :class:`BackendUnavailable` (a message for people) if jobs cannot run."""

    def available(self) -> str | None:
        """Why no job can be handed over right now, or None when it can (cached; may wait for
        one look at the scheduler: for the submit path)."""
        return None

    def health(self) -> str | None:
        """:meth:`available` as last seen, never waiting (the runner's loop asks it on every
        pass, between ingesting metrics)."""
        return self.available()

    def check_request(
        self, kind: str, config: Mapping[str, Any], options: Mapping[str, Any]
    ) -> tuple[str, str] | None:
        """(field, why) when the job can never run here as asked (checked at submit), else
        None; ``options``: the job's own scheduler options."""
        return None

    @abc.abstractmethod
    def schedule(self, request: LaunchRequest) -> Handle:
        """Start (or hand over) the job; raise :class:`ScheduleError` if it is refused and
        :class:`BackendUnavailable` if it should be tried again later."""

    @abc.abstractmethod
    def describe(self, handle: Handle) -> AppStatus:
        """The job's phase now."""

    def log_iter(self, handle: Handle, files: JobFiles, lines: int) -> Iterator[str]:
        """The last ``lines`` lines of the job's log (stdout and stderr of every process); a
        log the service will not read (a link, a FIFO) is one line saying so."""
        try:
            found = tail_lines(files.log, lines, files.root)
        except JobFileError as err:
            found = [f"({err.message})"]
        yield from found

    def explain(self, handle: Handle, files: JobFiles) -> list[str]:
        """Lines that say why a failed job failed (which node, which error), for its reason."""
        return []

    @abc.abstractmethod
    def cancel(self, handle: Handle) -> None:
        """Begin to end the job (SIGTERM, scancel); the job is over once ``describe`` says
        ``ended``."""

    def kill(self, handle: Handle) -> None:
        """The grace period is over: end it by force."""
        self.cancel(handle)

    def settle(self, handle: Handle) -> None:  # noqa: B027
        """The job ended: make sure no process of it is left."""

    @abc.abstractmethod
    def recover(self, job: Job) -> Handle | None:
        """The handle of a job a previous service launched, from what the store kept (None
        when it was never handed over)."""

    @abc.abstractmethod
    def list(self) -> Sequence[str]:
        """App ids of the jobs this backend runs for the service now."""

    def close(self) -> None:  # noqa: B027
        """The service stops."""
