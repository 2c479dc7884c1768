"""Is a process alive, and is it still the same one? Read from ``/proc`` (Linux), with a plain
existence check where there is none. Shared by the preprocessor's staging lock and the
service's job backends."""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (field 3 = state onwards)."""
    try:
        raw = (PROC / str(pid) / "stat").read_bytes()
    except OSError:  # gone, not ours, or no /proc
        return None
    end = raw.rfind(b")")
    return raw[end + 2 :].decode(errors="replace").split()


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot) or None where /proc is absent."""
    fields = stat_fields(pid)
    return fields[19] if fields and len(fields) > 19 else None


def is_alive(pid: int, started: str | None = None) -> bool:
    """True if ``pid`` runs (not a zombie) and, when ``started`` is given, is the same process
    that had that start time (not a reused pid)."""
    fields = stat_fields(pid)
    if fields is None:
        if PROC.is_dir():
            return False
        try:  # no /proc (not Linux): a plain existence check
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if fields[0] in ("Z", "X"):
        return False
    return started is None or (len(fields) > 19 and fields[19] == started)
