"""Writing preprocessed Criteo days: npy files appended block by block, checksums, and a
staging directory that becomes the output directory only once complete.

An npy file's header holds its row count, which a stream does not know until its end: the
header is written as a fixed 128-byte placeholder and rewritten in place at the end (numpy reads
any header length). The output directory ``OUT`` is assembled as ``.OUT.partial-PID`` next to
it, and renamed to ``OUT`` after its manifest is written; a previous ``OUT`` (which must hold a
manifest) is swapped out only then. A later run removes partial directories whose process is
gone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import struct
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlrm_vrgd.data.criteo.format import NUM_CAT, NUM_INT
from dlrm_vrgd.data.criteo.parse import ParsedBlock
from dlrm_vrgd.procfs import is_alive

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "dlrm-vrgd/criteo-days"
MANIFEST_VERSION = 1
KINDS = ("dense", "sparse", "labels")
_NPY_HEADER_BYTES = 128


def day_file(day: int, kind: str) -> str:
    """``day_{day}_{kind}.npy`` (torchrec's names)."""
    return f"day_{day}_{kind}.npy"


# --------------------------------------------------------------------------------- files
def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """A version-1.0 npy header padded to a fixed 128 bytes, so that it can be rewritten in
    place once the row count is known."""
    descr = np.lib.format.dtype_to_descr(dtype)
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {shape!r}, }}"
    size = _NPY_HEADER_BYTES - 10
    body = text.encode("latin1").ljust(size - 1) + b"\n"
    if len(body) != size:
        raise ValueError(f"npy header for shape {shape} does not fit {_NPY_HEADER_BYTES} bytes")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", size) + body


class NpyAppender:
    """An ``R x C`` npy file written row block by row block."""

    def __init__(self, path: Path, dtype: str, columns: int) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self.columns = columns
        self.rows = 0
        self._f = path.open("wb")
        self._f.write(b"\0" * _NPY_HEADER_BYTES)

    def append(self, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=self.dtype).reshape(-1, self.columns)
        self._f.write(memoryview(arr).cast("B"))
        self.rows += arr.shape[0]

    def close(self) -> None:
        """Write the final header (``fsync`` comes with the checksum, in the background)."""
        self._f.seek(0)
        self._f.write(_npy_header(self.dtype, (self.rows, self.columns)))
        self._f.close()

    def abort(self) -> None:
        self._f.close()


def sha256_file(path: Path, chunk: int = 8 << 20, sync: bool = False) -> str:
    """SHA-256 of a file (hex); with ``sync``, ``fsync`` it first."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        if sync:
            os.fsync(f.fileno())
        while data := f.read(chunk):
            h.update(data)
    return h.hexdigest()


@dataclass
class DayWriter:
    """One output day being written."""

    index: int
    input_index: int
    input_row: int
    staging: Path
    labeled: bool
    positives: int = 0
    files: dict[str, NpyAppender] = field(default_factory=dict)
    #: SHA-256 of each file, computed in the background once it is final.
    hashes: dict[str, Future[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        specs = {"dense": ("<f4", NUM_INT), "sparse": ("<i8", NUM_CAT), "labels": ("<i4", 1)}
        for kind, (dtype, cols) in specs.items():
            self.files[kind] = NpyAppender(self.staging / day_file(self.index, kind), dtype, cols)

    @property
    def rows(self) -> int:
        return self.files["labels"].rows

    def append(self, block: ParsedBlock, start: int, stop: int) -> None:
        self.files["dense"].append(block.dense[start:stop])
        self.files["sparse"].append(block.sparse[start:stop])
        labels = block.labels[start:stop]
        self.files["labels"].append(labels)
        self.positives += int(np.count_nonzero(labels == 1))

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def abort(self) -> None:
        for f in self.files.values():
            f.abort()

    def record(self, source: str) -> dict[str, Any]:
        """The day's manifest entry (waits for its checksums)."""
        files = {}
        for kind, f in self.files.items():
            files[kind] = {
                "file": f.path.name,
                "dtype": f.dtype.str,
                "shape": [f.rows, f.columns],
                "bytes": f.path.stat().st_size,
                "sha256": self.hashes[kind].result(),
            }
        return {
            "day": self.index,
            "rows": self.rows,
            "labeled": self.labeled,
            "positives": self.positives if self.labeled else None,
            "source": {
                "input": self.input_index,
                "path": source,
                "rows": [self.input_row, self.input_row + self.rows],
            },
            "files": files,
        }


# ------------------------------------------------------------------------ staging / out
def prepare_staging(out: Path, overwrite: bool) -> Path:
    """Check ``out`` and make a fresh staging directory next to it."""
    if out.exists():
        if not out.is_dir():
            raise FileExistsError(f"{out} exists and is not a directory")
        if any(out.iterdir()):
            if not overwrite:
                raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
            if not (out / MANIFEST).is_file():
                raise FileExistsError(
                    f"refusing to replace {out}: it has no {MANIFEST}, so it is not the output "
                    "of dlrm-vrgd preprocess"
                )
    out.parent.mkdir(parents=True, exist_ok=True)
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(partial|old)-(\d+)$")
    for sibling in out.parent.iterdir():
        m = pattern.match(sibling.name)
        if m and not is_alive(int(m.group(2))):
            if m.group(1) == "partial":
                logger.info("removing %s, left by an interrupted run", sibling)
                shutil.rmtree(sibling, ignore_errors=True)
            else:
                logger.warning("%s holds a previous %s that was being replaced", sibling, out)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(staging: Path, out: Path) -> None:
    _fsync_dir(staging)
    old = None
    if out.exists():
        if any(out.iterdir()):
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        else:
            out.rmdir()
    os.replace(staging, out)
    _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old)
