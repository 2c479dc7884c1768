"""How a run-directory file is written so that no reader sees a torn one.

Whole files (``config.json``, ``result.json``, ``status.json``, a checkpoint manifest) are
written to a temporary file in the same directory and renamed into place
(:func:`atomic_write_json`). Append-only files (``metrics.jsonl``, ``gsnr.jsonl``) are written
one whole line per ``write(2)`` call (:class:`JsonlWriter`); readers must ignore a last line
without its newline (:func:`read_jsonl` does).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def dumps(obj: Any) -> str:
    return json.dumps(_clean(obj), allow_nan=False, separators=(",", ":"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(_clean(obj), indent=2, allow_nan=False) + "\n").encode())


class JsonlWriter:
    """Append-only JSON-lines file; each record is one ``write(2)`` of one whole line."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        os.write(self._fd, (dumps(record) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_jsonl(path: Path, start: int = 0) -> list[dict[str, Any]]:
    """Complete records of a JSON-lines file from byte ``start`` (a torn last line is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    with path.open("rb") as f:
        f.seek(start)
        data = f.read()
    end = data.rfind(b"\n")
    if end < 0:
        return []
    out = []
    for n, line in enumerate(data[: end + 1].split(b"\n")[:-1], start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}" if not start else f"{path}: line {n} after byte {start}"
        try:
            record = json.loads(line)
        except ValueError as err:  # also bytes that are not UTF-8
            raise ValueError(f"{where}: not a JSON record ({err})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: not a JSON object")
        out.append(record)
    return out


def _step(record: dict[str, Any]) -> float:
    value = record.get("step", 0)
    return value if isinstance(value, int | float) and not isinstance(value, bool) else 0


def truncate_jsonl_after(path: Path, step: int) -> None:
    """Keep only records with ``step <= step`` (used when a run resumes from a checkpoint)."""
    path = Path(path)
    if not path.exists():
        return
    kept = [r for r in read_jsonl(path) if _step(r) <= step]
    atomic_write_bytes(path, "".join(dumps(r) + "\n" for r in kept).encode())


def drop_evals_at(path: Path, step: int) -> None:
    """Drop the ``kind: eval`` records of ``step`` (a run resumed at its last step evaluates
    again; an earlier attempt's final evals must not be kept twice)."""
    path = Path(path)
    if not path.exists():
        return
    records = read_jsonl(path)
    kept = [r for r in records if not (r.get("kind") == "eval" and int(r.get("step", 0)) == step)]
    if len(kept) != len(records):
        atomic_write_bytes(path, "".join(dumps(r) + "\n" for r in kept).encode())
