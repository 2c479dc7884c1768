"""Scheduling: which queued job starts next, and on which GPUs.

The queue is FIFO; at most ``max_concurrent_jobs`` run at once (0 holds every job queued).
GPUs (``service/jobs/gpus.py``): a job starts only when the GPUs it asks for are free; it gets
them in ``CUDA_VISIBLE_DEVICES`` (a CPU job gets none) and holds them until it ends, however it
ends; a re-attached job keeps the GPUs it had (:meth:`Scheduler.adopt_gpus`). A queued job that
asks for more GPUs than the host has fails at once instead of blocking the queue. With
``gpu_backfill`` a smaller job may overtake one that waits for GPUs
(:func:`service.jobs.gpus.next_job`).

A backend that queues jobs itself (Slurm) gets every queued job at once, in FIFO order: no
concurrency limit and no GPUs from here (Slurm queues and gives GPUs).
"""

from __future__ import annotations

import logging
import os

from service.jobs.backends.base import Backend
from service.jobs.files import JobFiles
from service.jobs.gpus import (
    GPU_ENV,
    GpuAllocator,
    gpus_needed,
    next_job,
    read_assignment,
    resolve_gpus,
)
from service.jobs.models import utcnow
from service.jobs.states import FAILED, QUEUED
from service.jobs.store import Job, Store
from service.settings import Settings

logger = logging.getLogger(__name__)


class Scheduler:
    """The queue and the GPU book of one service; the runner asks it what to start."""

    def __init__(self, settings: Settings, store: Store, backend: Backend) -> None:
        self.settings = settings
        self.store = store
        self.backend = backend
        #: The GPUs jobs may use and which job holds which.
        self.gpus = GpuAllocator(resolve_gpus(settings.gpus, os.environ.get(GPU_ENV)))
        #: Queued jobs already told that they wait for GPUs.
        self._gpu_waiting: set[str] = set()

    async def may_start_another(self, running: int) -> bool:
        """Whether another job may start now, ``running`` being followed or launching."""
        if self.settings.max_concurrent_jobs == 0:
            return False  # every job held in the queue
        if self.backend.queues_jobs:  # no limit here; the scheduler's last answer (never waits)
            return self.backend.health() is None
        return running < self.settings.max_concurrent_jobs

    def pick(
        self, launching: set[str], active: set[str]
    ) -> tuple[tuple[Job, tuple[str, ...]] | None, list[str], list[str]]:
        """The next queued job to start with the GPUs allocated to it (or None), the jobs
        just told that they wait for GPUs, and the jobs failed for asking more than the host
        has. FIFO; see :func:`service.jobs.gpus.next_job` for who may overtake whom. A backend
        that queues jobs itself gets them in FIFO order, with no GPUs from here."""
        if self.backend.queues_jobs:
            busy = launching | active
            head = self.store.next_queued(busy)
            return ((head, ()) if head is not None else None), [], []
        backfill = self.settings.gpu_backfill
        if backfill:
            queue = [j for j in self.store.jobs_in_state(QUEUED) if j.id not in launching]
        else:
            head = self.store.next_queued(launching)
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
                self.store.update_job(w.id, backend_state=f"queued: waiting for {need} GPU(s)")
                noted.append(w.id)
        if job is None:
            return None, noted, []
        self._gpu_waiting.discard(job.id)
        return (job, self.gpus.allocate(job.id, gpus_needed(job.config))), noted, []

    def release_gpus(self, job_id: str) -> None:
        freed = self.gpus.release(job_id)
        self._gpu_waiting.discard(job_id)
        if freed:
            logger.info("job %s: GPUs %s free again", job_id, ",".join(freed))

    def adopt_gpus(self, job: Job) -> None:
        """A re-attached job keeps the GPUs it was given."""
        devices = read_assignment(JobFiles(self.settings.jobs_dir / job.id).root, job.pid)
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
