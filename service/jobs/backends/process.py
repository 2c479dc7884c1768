"""Process-group plumbing for jobs: start a command in its own session, tell whether any process
of the group is left, signal the whole group, identify a pid across service restarts.

A job's command starts with ``start_new_session=True``: it leads a new session and process
group (pgid = its pid), and everything it starts (torchrun and its workers) stays in that
group unless it moves itself out. Ending a job means signalling the group, not the pid.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from dlrm_vrgd.procfs import PROC as _PROC
from dlrm_vrgd.procfs import is_alive, start_time
from dlrm_vrgd.procfs import stat_fields as _stat_fields
from service.jobs import reading

__all__ = [
    "describe_exit",
    "is_alive",
    "job_processes",
    "renice",
    "signal_group",
    "signal_processes",
    "spawn",
    "start_time",
]

logger = logging.getLogger(__name__)


def spawn(
    cmd: Sequence[str], cwd: Path, log_path: Path, env: Mapping[str, str], preamble: str = ""
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new session, stdout and stderr appended to ``log_path`` (after
    ``preamble``, the service's lines for this attempt). The log is opened as every job file
    is (:func:`service.jobs.reading.open_in`): a link or a FIFO planted in its place is
    refused (:class:`~service.jobs.reading.JobFileError`), never followed or waited on."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    fd = reading.open_in(log_path, flags=flags)
    with os.fdopen(fd, "ab") as log:
        os.set_blocking(fd, True)
        if preamble:
            log.write(preamble.encode())
            log.flush()
        return subprocess.Popen(
            list(cmd),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
            close_fds=True,
        )


def renice(pid: int, increment: int) -> None:
    """Lower the priority of a just-started job process; what it starts inherits it."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, pid)
        os.setpriority(os.PRIO_PROCESS, pid, min(19, current + increment))
    except (ProcessLookupError, PermissionError, OSError) as err:
        logger.warning("could not renice process %d: %s", pid, err)


def job_processes(pgid: int, marker: str | None = None) -> list[int]:
    """Live (non-zombie) processes of the job: members of process group ``pgid`` and, where
    /proc allows, every process whose environment holds ``marker`` (``NAME=value``).

    The marker finds what left the group: torchrun starts each worker in a session of its
    own, and a worker outlives a SIGKILLed torchrun as an orphan.
    """
    if not _PROC.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    needle = marker.encode() if marker else None
    found = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        fields = _stat_fields(pid)
        # fields: state ppid pgrp ...
        if not fields or len(fields) < 3 or fields[0] in ("Z", "X"):
            continue
        if fields[2] == str(pgid):
            found.append(pid)
        elif needle is not None and pid != os.getpid():
            try:
                env = (entry / "environ").read_bytes()
            except OSError:
                continue
            if needle in env.split(b"\0"):
                found.append(pid)
    return found


def signal_processes(pids: list[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each pid (gone ones are skipped)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to every process of the group; False if the group is gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        logger.warning("not allowed to signal process group %d", pgid)
        return False
    return True


def describe_exit(code: int | None) -> str:
    """``exit status 1`` / ``killed by signal SIGKILL (9)`` / ``exit status unknown``."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} ({-code})"
    return f"exit status {code}"
