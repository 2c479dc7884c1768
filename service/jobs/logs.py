"""A job's log (``train.log``: stdout and stderr of every process of every attempt) as users
read it: by byte offset (``read_from``, what ``?offset=N&follow=true`` streams), one rank's
lines (``rank_of``), the last lines (``service.jobs.files.tail_lines``).

Rank labels: under Slurm every task's line starts with its task number (``srun --label``:
``1: ...``), one task per node; torchrun labels its workers' lines ``[default0]:`` when asked
to (``--tee``). A line's rank is ``task * nproc_per_node + local rank``; a line without a
label (the launcher's own) belongs to no rank.
"""

from __future__ import annotations

import re
from pathlib import Path

#: Most bytes one read returns (a follower asks again for the rest).
MAX_CHUNK = 1 << 20
_SRUN = re.compile(r"^\s*(\d+): ")
_TORCHRUN = re.compile(r"^\s*\[[A-Za-z_]*?(\d+)\]:")


def read_from(path: Path, offset: int, limit: int = MAX_CHUNK) -> tuple[bytes, int]:
    """The log's bytes from ``offset`` (at most ``limit``, ending at a line end when one is
    in them) and the offset after them; nothing when the log is shorter or absent."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            if offset >= size:
                return b"", offset
            f.seek(offset)
            data = f.read(limit)
    except FileNotFoundError:
        return b"", offset
    if len(data) == limit and b"\n" in data:
        data = data[: data.rfind(b"\n") + 1]
    return data, offset + len(data)


def rank_of(line: str, nproc_per_node: int = 1) -> int | None:
    """The rank that wrote ``line`` by its labels, or None (no label)."""
    task = None
    m = _SRUN.match(line)
    if m:
        task = int(m.group(1))
        line = line[m.end() :]
    t = _TORCHRUN.match(line)
    if t:
        return (task or 0) * nproc_per_node + int(t.group(1))
    return task * nproc_per_node if task is not None else None


def rank_lines(lines: list[str], rank: int, nproc_per_node: int = 1) -> list[str]:
    """The lines of one rank."""
    return [ln for ln in lines if rank_of(ln, nproc_per_node) == rank]


class RankFilter:
    """Keeps the lines of one rank from a stream of log bytes (a partial last line waits for
    its end); no rank: everything passes."""

    def __init__(self, rank: int | None, nproc_per_node: int = 1) -> None:
        self.rank, self.nproc = rank, nproc_per_node
        self._partial = b""

    def feed(self, data: bytes, final: bool = False) -> bytes:
        if self.rank is None:
            return data
        data, self._partial = self._partial + data, b""
        if not final:
            cut = data.rfind(b"\n") + 1
            data, self._partial = data[:cut], data[cut:]
        kept = [
            line
            for line in data.splitlines(keepends=True)
            if rank_of(line.decode("utf-8", errors="replace"), self.nproc) == self.rank
        ]
        return b"".join(kept)
