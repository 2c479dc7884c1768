"""MLPerf DLRMv2's materialized multi-hot days: ``day_{i}_sparse_multi_hot.npz``.

The file is a zip archive, stored (not compressed), of one ``{k}.npy`` per feature ``k = 0 ..
T-1``: ``rows x s_k`` int32 ids (``np.savez`` of ``materialize_synthetic_multihot_dataset.py``,
``mlcommons/training`` ``recommendation_v2/torchrec_dlrm``). Beside it lie ``day_{i}_dense.npy``
and ``day_{i}_labels.npy``. :func:`open_multi_hot` memory-maps every member where it lies in the
archive (as MLPerf's reader does), so reading a row range reads those rows only;
:func:`write_multi_hot` writes the same layout from one-hot ids, streaming row blocks (a day
never has to fit in memory).
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

#: Rows written at a time by :func:`write_multi_hot`.
WRITE_ROWS = 1 << 18
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip local file header (30 bytes)


class NpzError(ValueError):
    """A multi-hot npz that cannot be memory-mapped as MLPerf's layout."""


def multi_hot_file(day: int) -> str:
    """``day_{day}_sparse_multi_hot.npz`` (MLPerf's name)."""
    return f"day_{day}_sparse_multi_hot.npz"


def _member_map(zf: zipfile.ZipFile, path: Path, name: str) -> np.ndarray:
    info = zf.NameToInfo.get(name)
    if info is None:
        raise NpzError(f"{path}: no member {name}")
    if info.compress_type != zipfile.ZIP_STORED:
        raise NpzError(
            f"{path}: {name} is compressed; MLPerf's layout stores members uncompressed "
            "(np.savez, not np.savez_compressed)"
        )
    fp = zf.fp
    assert fp is not None
    fp.seek(info.header_offset)
    head = fp.read(_LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        raise NpzError(f"{path}: {name}: bad local header")
    fields = _LOCAL_HEADER.unpack(head)
    start = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
    fp.seek(start)
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
    except ValueError as err:
        raise NpzError(f"{path}: {name}: not an npy array: {err}") from None
    if dtype.kind not in "iu" or dtype.itemsize not in (4, 8) or fortran or len(shape) != 2:
        raise NpzError(f"{path}: {name}: {dtype} {list(shape)}; expected rows x size int32")
    offset = fp.tell()
    if offset - start + int(np.prod(shape)) * dtype.itemsize > info.file_size:
        raise NpzError(f"{path}: {name}: shorter than its header says")
    if int(np.prod(shape)) == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(shape))


def open_multi_hot(path: str | Path, tables: int | None = None) -> list[np.ndarray]:
    """The members ``0.npy .. {T-1}.npy`` of a multi-hot npz as read-only memory maps
    (``rows x s_k``); ``tables``: how many there must be (None: as many as the file holds)."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as zf:
            names = set(zf.NameToInfo)
            count = tables if tables is not None else len(names)
            want = [f"{k}.npy" for k in range(count)]
            if set(want) != names:
                raise NpzError(
                    f"{path}: members {sorted(names)[:4]}...; expected 0.npy..{count - 1}.npy"
                )
            maps = [_member_map(zf, path, name) for name in want]
    except zipfile.BadZipFile as err:
        raise NpzError(f"{path}: not a zip (npz) file: {err}") from None
    rows = {m.shape[0] for m in maps}
    if len(rows) != 1:
        raise NpzError(f"{path}: features with different row counts {sorted(rows)}")
    return maps


def write_multi_hot(
    path: str | Path,
    rows: int,
    sizes: list[int] | tuple[int, ...],
    bags: Callable[[int, int, int], np.ndarray],
) -> None:
    """Write a multi-hot npz of ``rows`` rows: member ``k`` is ``rows x sizes[k]`` int32,
    its block ``[a, b)`` given by ``bags(k, a, b)``; written block by block as ``np.savez``
    lays the file out (stored, zip64)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for k, size in enumerate(sizes):
            with zf.open(f"{k}.npy", "w", force_zip64=True) as f:
                header = {"descr": "<i4", "fortran_order": False, "shape": (rows, int(size))}
                np.lib.format.write_array_header_1_0(f, header)
                for a in range(0, rows, WRITE_ROWS):
                    b = min(rows, a + WRITE_ROWS)
                    block = np.ascontiguousarray(bags(k, a, b), dtype="<i4")
                    if block.shape != (b - a, size):
                        raise ValueError(f"feature {k}: a block of {block.shape}")
                    f.write(memoryview(block).cast("B"))
