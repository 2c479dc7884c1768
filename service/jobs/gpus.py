"""GPU assignment for jobs: which GPUs the host has, how many a job asks for, who holds which.

The service hands each job the GPUs it asks for through ``CUDA_VISIBLE_DEVICES`` and never the
same GPU to two jobs at once. A job asks for ``run.nproc_per_node`` GPUs when ``run.device``
is ``cuda`` (one per rank on this host, multi-node jobs included) and for none otherwise; a job
without GPUs sees none (``CUDA_VISIBLE_DEVICES=""``).

The GPUs come from ``DLRM_VRGD_GPUS``: a list such as ``0,1,2,3`` (values are passed to
``CUDA_VISIBLE_DEVICES`` as they are, so GPU UUIDs and MIG device UUIDs work too), ``none``, or
``auto`` (the default): the service's own ``CUDA_VISIBLE_DEVICES`` when it has one, else
``nvidia-smi -L``: every GPU by index, or, for a GPU split into MIG instances, each instance by
UUID. Indices are PCI bus order, as ``nvidia-smi`` numbers them; jobs run with
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that CUDA numbers them the same way.

What a job was given is written to ``gpus.json`` in its directory before it starts, so that a
service restarted while the job runs gives it back the same GPUs (:func:`read_assignment`).

Scheduling (:func:`next_job`): queued jobs start in FIFO order. By default a job that needs
more GPUs than are free waits at the head of the queue and the jobs behind it wait too
(head-of-line blocking: no job starves, a big job is never overtaken). With
``DLRM_VRGD_GPU_BACKFILL=true`` a later job that fits the free GPUs may start first (GPUs stay
busy, but a stream of small jobs can keep a big one waiting indefinitely).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

#: The variable that tells CUDA (and so torch, torchrun's workers and NCCL) which GPUs to use.
GPU_ENV = "CUDA_VISIBLE_DEVICES"
#: Seconds ``nvidia-smi -L`` may take before detection gives up.
DETECT_TIMEOUT_S = 15.0
#: File in a job's directory naming the GPUs the job was given.
ASSIGNMENT_FILE = "gpus.json"

_DEVICE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]*$")
_GPU_LINE = re.compile(r"^GPU (\d+):")
_MIG_LINE = re.compile(r"^\s+MIG .*\(UUID: (MIG-[^)\s]+)\)")

T = TypeVar("T")


class GpuError(ValueError):
    """A GPU list that cannot be used, or a request the allocator cannot serve."""


# ------------------------------------------------------------------------- the GPU list
def parse_gpu_spec(spec: str) -> tuple[str, ...] | None:
    """``DLRM_VRGD_GPUS`` -> the GPUs it names; None for ``auto`` (detect them).

    ``"0,1,2,3"`` (commas and/or spaces) -> ``("0", "1", "2", "3")``; ``"none"`` or ``""`` ->
    ``()``. Raises :class:`GpuError` for a repeated or malformed entry.
    """
    text = spec.strip()
    if text.lower() == "auto":
        return None
    if text.lower() in ("", "none"):
        return ()
    devices = tuple(d for d in re.split(r"[,\s]+", text) if d)
    for d in devices:
        if not _DEVICE.match(d):
            raise GpuError(f"not a GPU index or UUID: {d!r}")
    repeated = sorted({d for d in devices if devices.count(d) > 1})
    if repeated:
        raise GpuError(f"GPU listed more than once: {', '.join(repeated)}")
    return devices


def parse_nvidia_smi(output: str) -> tuple[str, ...]:
    """GPUs in ``nvidia-smi -L`` output: ``"GPU 2: ..."`` -> ``"2"``; a GPU with MIG instances
    contributes its instances' UUIDs instead (CUDA addresses MIG instances only by UUID)."""
    devices: list[str] = []
    gpu: str | None = None
    migs: list[str] = []

    def flush() -> None:
        if gpu is not None:
            devices.extend(migs or [gpu])

    for line in output.splitlines():
        m = _GPU_LINE.match(line)
        if m:
            flush()
            gpu, migs = m.group(1), []
            continue
        m = _MIG_LINE.match(line)
        if m and gpu is not None:
            migs.append(m.group(1))
    flush()
    return tuple(devices)


def detect_gpus(timeout_s: float = DETECT_TIMEOUT_S) -> tuple[str, ...]:
    """The host's GPUs according to ``nvidia-smi -L``; none when it is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ()
    try:
        proc = subprocess.run(
            [exe, "-L"], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        logger.warning("nvidia-smi -L failed (%s); no GPUs for jobs", err)
        return ()
    if proc.returncode != 0:
        logger.warning(
            "nvidia-smi -L exited with %d (%s); no GPUs for jobs",
            proc.returncode,
            proc.stderr.strip() or proc.stdout.strip(),
        )
        return ()
    return parse_nvidia_smi(proc.stdout)


def resolve_gpus(spec: str, inherited: str | None = None) -> tuple[str, ...]:
    """The GPUs jobs may use: the listed ones; for ``auto``, those of ``inherited`` (the
    service's own ``CUDA_VISIBLE_DEVICES``) when set, else the detected ones."""
    devices = parse_gpu_spec(spec)
    if devices is not None:
        return devices
    if inherited is not None:
        return parse_gpu_spec(inherited) or ()
    return detect_gpus()


# --------------------------------------------------------------------------- requests
def gpu_request(config: Mapping[str, Any]) -> tuple[int, str]:
    """(GPUs the job asks for on this host, dotted name of the field that asks).

    A train config asks for ``run.nproc_per_node`` GPUs when ``run.device`` is ``cuda``. A
    kind whose config wraps a train config under ``base`` (the batch-size study) is read from
    there. Anything else asks for none.
    """
    sections: list[tuple[str, object]] = [("config.run", config.get("run"))]
    base = config.get("base")
    if isinstance(base, Mapping):
        sections.append(("config.base.run", base.get("run")))
    for prefix, section in sections:
        if isinstance(section, Mapping):
            field = f"{prefix}.nproc_per_node"
            if section.get("device", "cpu") != "cuda":
                return 0, field
            return int(section.get("nproc_per_node", 1)), field
    return 0, "config.run.nproc_per_node"


def gpus_needed(config: Mapping[str, Any]) -> int:
    """GPUs a job with this (resolved) config asks for; see :func:`gpu_request`."""
    return gpu_request(config)[0]


def next_job(
    queue: Iterable[tuple[T, int]], free: int, backfill: bool = False
) -> tuple[T | None, list[T]]:
    """The scheduling rule: (the job to start now or None, the jobs seen waiting for GPUs).

    ``queue`` is (job, GPUs it needs) in FIFO order; ``free`` is the number of free GPUs.
    Without ``backfill`` only the head may start: if it does not fit, nothing starts. With
    ``backfill`` the first job that fits starts, overtaking the ones that do not.
    """
    waiting: list[T] = []
    for job, need in queue:
        if need <= free:
            return job, waiting
        waiting.append(job)
        if not backfill:
            break
    return None, waiting


# -------------------------------------------------------------------------- allocator
class GpuAllocator:
    """Which job holds which GPU; no GPU is ever held by two jobs. Thread-safe."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices: tuple[str, ...] = tuple(devices)
        if len(set(self.devices)) != len(self.devices):
            raise GpuError(f"GPU listed more than once: {self.devices}")
        self._held: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """GPUs of the host that jobs may use."""
        return len(self.devices)

    def _busy(self) -> set[str]:
        return {d for devices in self._held.values() for d in devices}

    def free(self) -> tuple[str, ...]:
        """GPUs no job holds, in the configured order."""
        with self._lock:
            busy = self._busy()
            return tuple(d for d in self.devices if d not in busy)

    def fits(self, count: int) -> bool:
        """True if ``count`` GPUs are free now."""
        return count <= len(self.free())

    def held(self, job_id: str) -> tuple[str, ...]:
        """The GPUs ``job_id`` holds (empty if none)."""
        with self._lock:
            return self._held.get(job_id, ())

    def holders(self) -> dict[str, tuple[str, ...]]:
        """job id -> the GPUs it holds (jobs holding none are left out)."""
        with self._lock:
            return {job: devices for job, devices in self._held.items() if devices}

    def allocate(self, job_id: str, count: int) -> tuple[str, ...]:
        """Give ``job_id`` ``count`` free GPUs (the first free ones, in order) and return them.

        Raises :class:`GpuError` if the job already holds GPUs or fewer than ``count`` are
        free (check :meth:`fits` first).
        """
        if count < 0:
            raise GpuError(f"cannot allocate {count} GPUs")
        with self._lock:
            if self._held.get(job_id):
                raise GpuError(f"job {job_id} already holds GPUs {self._held[job_id]}")
            busy = self._busy()
            free = [d for d in self.devices if d not in busy]
            if count > len(free):
                raise GpuError(
                    f"job {job_id} needs {count} GPU(s); {len(free)} of {self.capacity} free"
                )
            devices = tuple(free[:count])
            self._held[job_id] = devices
            return devices

    def adopt(self, job_id: str, devices: Sequence[str]) -> list[str]:
        """Record that a job re-attached after a restart holds ``devices`` (what it was given
        before). Returns problems found (GPUs not in this service's list, or already held by
        another job); the job keeps its GPUs either way: it is using them."""
        devices = tuple(devices)
        problems = []
        with self._lock:
            for d in devices:
                if d not in self.devices:
                    problems.append(f"GPU {d} is not among this service's GPUs {self.devices}")
                for other, theirs in self._held.items():
                    if other != job_id and d in theirs:
                        problems.append(f"GPU {d} is also held by job {other}")
            self._held[job_id] = devices
        return problems

    def release(self, job_id: str) -> tuple[str, ...]:
        """Free the GPUs of ``job_id``; returns them (empty if it held none)."""
        with self._lock:
            return self._held.pop(job_id, ())


def visible_devices(devices: Sequence[str]) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value for ``devices`` (``""``: no GPU at all)."""
    return ",".join(devices)


# ------------------------------------------------------------- what a job was given
def write_assignment(job_dir: Path, devices: Sequence[str]) -> None:
    """Record (atomically) the GPUs a job is given in ``job_dir/gpus.json``."""
    path = job_dir / ASSIGNMENT_FILE
    fd, tmp = tempfile.mkstemp(dir=job_dir, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:  # a new file: a link planted under a fixed name is not followed
        f.write(json.dumps({"devices": list(devices)}) + "\n")
    os.replace(tmp, path)


def read_assignment(job_dir: Path, pid: int | None = None) -> tuple[str, ...] | None:
    """The GPUs a job was given: from ``job_dir/gpus.json``, else from the environment of its
    process ``pid`` (``/proc/PID/environ``); None when neither tells."""
    from service.jobs.reading import JobFileError, read_json  # no link followed, bounded

    try:
        data = read_json(job_dir / ASSIGNMENT_FILE, limit=64 << 10)
        if data is not None and isinstance(data["devices"], list):
            return tuple(str(d) for d in data["devices"][:1024])
    except (OSError, ValueError, KeyError, TypeError, JobFileError):
        pass
    if pid is None:
        return None
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = f"{GPU_ENV}=".encode()
    for entry in environ:
        if entry.startswith(prefix):
            value = entry[len(prefix) :].decode(errors="replace")
            try:
                return parse_gpu_spec(value) or ()
            except GpuError:
                return None
    return None
