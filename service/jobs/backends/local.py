"""The local backend: a job is one command on the service's own host, in a session and process
group of its own (see :mod:`service.jobs.backends.process`).

Ending it signals the whole group and every process carrying the job's marker (torchrun starts
each worker in a session of its own): SIGTERM on cancel, SIGKILL when the runner's grace period
is over; a job is only reported ended once no process of its group is left. After a restart a
job is re-attached by pid *and* process start time (a reused pid is not the job). The command
runs under a small supervisor (:mod:`service.jobs.supervise`) that records its exit status in
``jobs/<id>/exit.json``: the status of a re-attached job, which is not our child, is read there
(unknown only if the supervisor itself was SIGKILLed). GPUs come
from the runner's allocator (``service/jobs/gpus.py``) in ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from service.jobs import supervise
from service.jobs.backends import process
from service.jobs.backends.base import ENDED, RUNNING, AppStatus, Backend, Handle, LaunchRequest
from service.jobs.gpus import GPU_ENV, visible_devices, write_assignment
from service.jobs.store import Job
from service.jobs.tracking import withheld_note
from service.settings import Settings

logger = logging.getLogger(__name__)

#: Environment variable naming the job in every process of it (torchrun's workers included,
#: which run in sessions of their own): how the runner finds all of a job's processes.
JOB_ENV = "DLRM_VRGD_JOB_ID"
#: Seconds to wait for a process group to vanish after SIGKILL.
KILL_WAIT_S = 5.0


@dataclass
class LocalHandle(Handle):
    pid: int = 0
    pgid: int = 0
    proc_start: str | None = None
    #: Our child; None for a job re-attached after a restart (not our child: its exit status
    #: comes from the supervisor's ``exit_file``, if it could write one).
    popen: subprocess.Popen[bytes] | None = None
    exit_file: Path | None = None


class LocalBackend(Backend):
    name = "local"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._running: dict[str, LocalHandle] = {}

    def schedule(self, request: LaunchRequest) -> LocalHandle:
        files = request.files
        files.root.mkdir(parents=True, exist_ok=True)
        write_assignment(files.root, request.devices)
        env = dict(request.env)
        env[GPU_ENV] = visible_devices(request.devices)
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # indices as nvidia-smi's
        exit_file = files.root / supervise.EXIT_FILE
        exit_file.unlink(missing_ok=True)
        note = withheld_note(request.job.kind, request.job.config, self.settings)
        preamble = f"[dlrm-vrgd service] {note}\n" if note else ""
        popen = process.spawn(
            supervise.wrap(request.cmd, exit_file), files.root, files.log, env, preamble
        )
        if self.settings.job_nice:
            process.renice(popen.pid, self.settings.job_nice)
        handle = LocalHandle(
            job_id=request.job.id,
            app_id=str(popen.pid),
            pid=popen.pid,
            pgid=popen.pid,
            proc_start=process.start_time(popen.pid),
            popen=popen,
            exit_file=exit_file,
        )
        self._running[handle.job_id] = handle
        return handle

    def describe(self, handle: Handle) -> AppStatus:
        assert isinstance(handle, LocalHandle)
        if handle.popen is not None:
            rc = handle.popen.poll()
            return AppStatus(ENDED, rc) if rc is not None else AppStatus(RUNNING)
        if process.is_alive(handle.pid, handle.proc_start):
            return AppStatus(RUNNING)
        code = supervise.read_exit_code(handle.exit_file) if handle.exit_file else None
        return AppStatus(ENDED, code)

    def cancel(self, handle: Handle) -> None:
        assert isinstance(handle, LocalHandle)
        logger.info("job %s: SIGTERM to process group %d", handle.job_id, handle.pgid)
        # One SIGTERM per process: a trainer stops after its step on the first and at once on a
        # second, so the processes of the group are not signalled again by their marker (nor
        # are ranks in a session of their own: their launcher forwards it). Only where the
        # group is gone do the marked processes that outlived it get it directly.
        if not process.signal_group(handle.pgid, signal.SIGTERM):
            process.signal_processes(self._processes(handle), signal.SIGTERM)

    def kill(self, handle: Handle) -> None:
        """SIGKILL the job's process group and every process carrying its marker."""
        assert isinstance(handle, LocalHandle)
        process.signal_group(handle.pgid, signal.SIGKILL)
        process.signal_processes(self._processes(handle), signal.SIGKILL)

    def settle(self, handle: Handle) -> None:
        """SIGKILL whatever is left of the job and wait until no process of it is left."""
        assert isinstance(handle, LocalHandle)
        self._running.pop(handle.job_id, None)
        if not self._processes(handle):
            return
        logger.info("job %s: killing its remaining processes", handle.job_id)
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:
            left = self._processes(handle)
            if not left:
                return
            process.signal_group(handle.pgid, signal.SIGKILL)
            process.signal_processes(left, signal.SIGKILL)
            time.sleep(0.05)
        logger.error("job %s: processes %s survive SIGKILL", handle.job_id, self._processes(handle))

    def recover(self, job: Job) -> LocalHandle | None:
        if job.pid is None or job.pgid is None:
            return None
        handle = LocalHandle(
            job_id=job.id,
            app_id=str(job.pid),
            pid=job.pid,
            pgid=job.pgid,
            proc_start=job.proc_start,
            exit_file=self.settings.jobs_dir / job.id / supervise.EXIT_FILE,
        )
        self._running[job.id] = handle
        return handle

    def list(self) -> Sequence[str]:
        return [h.app_id for h in self._running.values() if self.describe(h).phase != ENDED]

    def close(self) -> None:
        for handle in self._running.values():
            if handle.popen is not None:
                # Not ours to wait for any more; stops Popen.__del__ warning about it.
                handle.popen.returncode = 0
        self._running.clear()

    @staticmethod
    def _processes(handle: LocalHandle) -> list[int]:
        return process.job_processes(handle.pgid, f"{JOB_ENV}={handle.job_id}")
