"""Every read of a file in a job's directory: no link followed, regular files only, bounded in
size and in time.

A job's directory is written by the job (and by anything else that can write there), so a file
the service reads from it may be a symbolic link to a file of the host, a link to
``/dev/zero``, a FIFO that blocks whoever opens it, or a file that never ends. Every read here:

* walks from the job's directory one component at a time with ``O_NOFOLLOW`` (a link anywhere
  on the path, ``run`` included, is refused, not followed), and opens with ``O_NONBLOCK`` so a
  FIFO never blocks the open;
* ``fstat``s what it opened: anything but a regular file (a FIFO, a device, a socket, a
  directory) is refused;
* reads at most what the caller asks (a whole file only up to a cap);
* in the API, runs on a pool of its own (:func:`bounded`) with a deadline
  (``DLRM_VRGD_FILE_READ_TIMEOUT_S``): a read stuck in the kernel (a hung network file system)
  holds one of that pool's threads, never a request thread, and the request answers 503.

A refused file raises :class:`JobFileError` (409 in the API), naming the file relative to the
job's directory.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from dlrm_vrgd import safejson
from service.errors import ArtifactDamaged, Unavailable

T = TypeVar("T")

#: Largest JSON file read whole (result.json, gpus.json, exit.json).
MAX_JSON_BYTES = 16 << 20
#: Threads of the pool that reads job files for requests.
READ_THREADS = 8

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_pool: concurrent.futures.ThreadPoolExecutor | None = None


class JobFileError(ArtifactDamaged):
    """A job's file the service will not read: a link, not a regular file, too large, or not
    the JSON it should be. 409 in the API."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}; refused")
        self.name = name
        self.reason = reason


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _split(path: Path, within: Path | None) -> tuple[Path, list[str]]:
    """``(directory opened first, components below it)`` of ``path``."""
    path = Path(path)
    if within is None:
        return path.parent, [path.name]
    parts = list(path.relative_to(within).parts)
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"{path}: not a path inside {within}")
    return Path(within), parts


def open_in(
    path: Path, within: Path | None = None, flags: int = _FILE_FLAGS, mode: int = 0o644
) -> int:
    """A descriptor of the regular file ``path``, reached through no link below ``within``
    (default: its own directory; the components are opened one by one with ``O_NOFOLLOW``).
    :class:`FileNotFoundError` when it is missing; :class:`JobFileError` (naming the path
    relative to ``within``) for a link on the way or anything but a regular file. ``flags``
    may add ``O_WRONLY | O_APPEND | O_CREAT`` (a log the service writes)."""
    root, parts = _split(path, within)
    rel = "/".join(parts)
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise JobFileError(rel, "its directory is a link or not a directory") from None
        raise
    try:
        for i, part in enumerate(parts[:-1]):
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    where = "/".join(parts[: i + 1])
                    raise JobFileError(rel, f"{where} is a link or not a directory") from None
                raise
            os.close(fd)
            fd = nfd
        try:
            out = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=fd)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise JobFileError(rel, "a symbolic link") from None
            if err.errno in (errno.EISDIR, errno.ENXIO):
                raise JobFileError(rel, "not a regular file") from None
            raise
    finally:
        os.close(fd)
    st = os.fstat(out)
    if not stat.S_ISREG(st.st_mode):
        os.close(out)
        raise JobFileError(rel, _kind(st.st_mode))
    return out


def read_bytes(path: Path, limit: int, within: Path | None = None) -> bytes | None:
    """The whole file (None when missing); :class:`JobFileError` when over ``limit`` bytes."""
    try:
        fd = open_in(path, within)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise JobFileError(name_of(path, within), f"over {limit:,} bytes")
    return data


def read_json(path: Path, within: Path | None = None, limit: int = MAX_JSON_BYTES) -> Any:
    """The file's JSON value (None when missing), bounded in size and nesting
    (:mod:`dlrm_vrgd.safejson`); :class:`JobFileError` naming the reason otherwise."""
    data = read_bytes(path, limit, within)
    if data is None:
        return None
    try:
        return safejson.loads(data)
    except ValueError as err:
        raise JobFileError(
            name_of(path, within), f"not valid JSON ({safejson.describe(err)})"
        ) from None


def read_range(
    path: Path, offset: int, limit: int, within: Path | None = None
) -> tuple[bytes, int] | None:
    """Up to ``limit`` bytes from ``offset`` and the file's size; None when missing."""
    try:
        fd = open_in(path, within)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if offset >= size:
            return b"", size
        f.seek(offset)
        return f.read(min(limit, size - offset)), size


def read_tail(path: Path, nbytes: int, within: Path | None = None) -> bytes:
    """The file's last ``nbytes`` bytes (``b""`` when missing)."""
    try:
        fd = open_in(path, within)
    except FileNotFoundError:
        return b""
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - nbytes))
        return f.read(min(nbytes, size))


def name_of(path: Path, within: Path | None = None) -> str:
    """``path`` as errors name it: relative to ``within`` (default: its own name)."""
    return "/".join(_split(path, within)[1])


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="job-file")
    return _pool


def bounded(timeout_s: float, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the job-file pool, waited for at most ``timeout_s`` seconds
    (:class:`~service.errors.Unavailable`, 503, after that; the read goes on in its thread)."""
    future = _executor().submit(fn, *args)
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise Unavailable(
            f"reading the job's files took over {timeout_s:g} s (DLRM_VRGD_FILE_READ_TIMEOUT_S)"
        ) from None


async def bounded_async(timeout_s: float, fn: Callable[..., T], *args: Any) -> T:
    """:func:`bounded` for a coroutine (the event loop never waits on the read)."""
    import asyncio

    future = _executor().submit(fn, *args)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
    except TimeoutError:
        raise Unavailable(
            f"reading the job's files took over {timeout_s:g} s (DLRM_VRGD_FILE_READ_TIMEOUT_S)"
        ) from None
