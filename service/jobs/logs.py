"""A job's log (``train.log``: stdout and stderr of every process of every attempt) as users
read it: by byte offset (``read_from``, what ``?offset=N&follow=true`` streams), one srun
task's lines (``task_of``, ``?task=T``), the last lines (``service.jobs.files.tail_lines``).

Task labels: under Slurm every line a task wrote starts with its task number (``srun
--label``: ``1: ...``), one task per node. That is the only label the log has for every line;
it is not the training rank: torchrun's rendezvous decides which task hosts which ranks (rank 0
may run on task 1), and a rank's own prefixes (``[rank0]:`` on an uncaught error,
``[default0]:`` under ``--tee``) come on a few lines only. A line without a task label (the
launcher's own, every line under the local backend) belongs to no task.
"""

from __future__ import annotations

import re
from pathlib import Path

from service.jobs import reading

#: Most bytes one read returns (a follower asks again for the rest).
MAX_CHUNK = 1 << 20
_SRUN = re.compile(r"^\s*(\d+): ")


def read_from(
    path: Path, offset: int, limit: int = MAX_CHUNK, within: Path | None = None
) -> tuple[bytes, int]:
    """The log's bytes from ``offset`` (at most ``limit``, ending at a line end when one is
    in them) and the offset after them; nothing when the log is shorter or absent. Read as
    every job file is (:mod:`service.jobs.reading`: no link below ``within``, regular files
    only)."""
    got = reading.read_range(path, offset, limit, within)
    if got is None or not got[0]:
        return b"", offset
    data = got[0]
    if len(data) == limit and b"\n" in data:
        data = data[: data.rfind(b"\n") + 1]
    return data, offset + len(data)


def task_of(line: str) -> int | None:
    """The srun task that wrote ``line`` (its ``--label``), or None (no label)."""
    m = _SRUN.match(line)
    return int(m.group(1)) if m else None


def task_lines(lines: list[str], task: int) -> list[str]:
    """The lines of one srun task."""
    return [ln for ln in lines if task_of(ln) == task]


class TaskFilter:
    """Keeps the lines of one srun task from a stream of log bytes (a partial last line waits
    for its end); no task: everything passes."""

    def __init__(self, task: int | None) -> None:
        self.task = task
        self._partial = b""

    def feed(self, data: bytes, final: bool = False) -> bytes:
        if self.task is None:
            return data
        data, self._partial = self._partial + data, b""
        if not final:
            cut = data.rfind(b"\n") + 1
            data, self._partial = data[:cut], data[cut:]
        kept = [
            line
            for line in data.splitlines(keepends=True)
            if task_of(line.decode("utf-8", errors="replace")) == self.task
        ]
        return b"".join(kept)
