"""glibc's allocator: resident memory that does not creep over the micro-batches of a step.

Every micro-batch allocates and frees the same large activation and gradient buffers. glibc
serves allocations below its *adaptive* mmap threshold (which climbs up to 32 MiB as large
blocks are freed) from its heap and keeps freed heap memory for reuse — fast, but the heap
fragments, so over many micro-batches the resident set creeps up (measured by bench/memory.py:
+~150 MB over 64 micro-batches of the Kaggle-sized model). Fixing the threshold (``mallopt``)
sends every allocation above it to ``mmap``, returned to the system when freed: resident memory
then tracks what is alive, at the price of page faults on every large allocation (slower steps).
``run.malloc_mmap_threshold_kb`` chooses; 0 keeps glibc's adaptive default.

On a CPU, by default (``run.heap_release: auto``, which is ``micro_batch`` there and ``never``
on CUDA: :func:`resolve_heap_release`), the trainer instead calls
:func:`release_free_memory` (``malloc_trim(0)``) after every micro-batch: at that point the
micro-batch's buffers are all free, and glibc hands the pages of its free heap chunks back to
the system (``madvise(MADV_DONTNEED)``) while keeping the address space. The heap keeps its fast
reuse within a micro-batch; what is retained across micro-batches is then what is alive (the
step's row sums), not the fragments. The cost is the pages every micro-batch then touches
afresh: on 2 CPU cores, steps 16-37% slower than under ``growth`` (docs/benchmarks.md).
``growth`` (:class:`HeapGrowthGuard`) hands back only once the heap's span has grown by 64 MiB —
its peak was 56-127 MB higher (16k-512k rows a step); ``never`` leaves glibc alone. In every
mode the sparse step hands back between the chunks of its touched rows (:func:`released`): each
chunk allocates and frees ``chunk_rows x D`` temporaries, and without it the heap grew by ~240 B
per touched row over a 512k step (118 MB at 503k rows) — the step's peak then exceeded the
micro-batches'.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, loaded once; None (also remembered) where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def release_free_memory() -> bool:
    """Hand the pages of glibc's free heap memory back to the system (``malloc_trim(0)``);
    False where there is no glibc or nothing was released."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    return bool(libc.malloc_trim(0))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


@functools.cache
def _mallinfo2() -> Callable[[], _Mallinfo2] | None:
    """glibc's ``mallinfo2``, its return type set once; None where there is none."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    return libc.mallinfo2


def heap_bytes() -> int | None:
    """The span of glibc's heaps in bytes (``mallinfo2().arena``, every arena: what the heaps
    have grown to, not what is resident); None where there is no ``mallinfo2`` (glibc < 2.33,
    or not glibc)."""
    info = _mallinfo2()
    return None if info is None else int(info().arena)


class HeapGrowthGuard:
    """:func:`release_free_memory` only once the heap has grown by ``margin`` bytes since the
    last hand-back (or since the first call). Called after every micro-batch, it keeps the
    heap's reuse — no page handed back, so none re-touched — while the micro-batches fit in what
    the heap holds, and hands the fragments back when the heap grows past them. Where
    :func:`heap_bytes` is unavailable it hands back on every call."""

    def __init__(self, margin: int = 64 << 20) -> None:
        self.margin = margin
        self.base: int | None = None
        self.handed_back = 0

    def __call__(self) -> bool:
        size = heap_bytes()
        if size is not None:
            if self.base is None:
                self.base = size
                return False
            if size <= self.base + self.margin:
                return False
        self.handed_back += 1
        out = release_free_memory()
        self.base = heap_bytes()
        return out


#: ``run.heap_release``: when the trainer hands glibc's free heap pages back.
HEAP_RELEASE = ("auto", "micro_batch", "growth", "never")


def resolve_heap_release(mode: str, device: str) -> str:
    """``auto`` for a device: ``micro_batch`` on ``cpu`` (the step's tensors are host memory),
    ``never`` on ``cuda`` (they live on the GPU; the host's input buffers are reused, so a
    hand-back per micro-batch would only cost the ``malloc_trim`` and the re-touched pages).
    Any other mode is returned as it is."""
    if mode != "auto":
        return mode
    return "micro_batch" if device == "cpu" else "never"


def heap_release(mode: str, device: str = "cpu") -> Callable[[], bool]:
    """The trainer's hand-back after each micro-batch and the dense step: ``micro_batch`` every
    time (:func:`release_free_memory`), ``growth`` when the heap has grown by 64 MiB
    (:class:`HeapGrowthGuard`), ``never`` (the sparse step's chunks still hand back); ``auto``
    as :func:`resolve_heap_release` says for ``device`` (``cpu`` or ``cuda``)."""
    if mode == "auto":
        mode = resolve_heap_release(mode, device)
    if mode == "micro_batch":
        return release_free_memory
    if mode == "growth":
        return HeapGrowthGuard()
    if mode == "never":
        return lambda: False
    raise ValueError(f"run.heap_release: {mode!r} is not one of {', '.join(HEAP_RELEASE)}")


def released(items: Sequence[T]) -> Iterator[T]:
    """Each of ``items`` in turn, with :func:`release_free_memory` between them (after each
    but the last): for a loop whose every pass allocates and frees large temporaries, so that
    the heap does not grow pass by pass. What the loop body still names when it asks for the
    next item is alive then: ``del`` it first."""
    for i, item in enumerate(items):
        yield item
        if i + 1 < len(items):
            release_free_memory()


def set_mmap_threshold(kib: int) -> bool:
    """Fix glibc's mmap threshold at ``kib`` KiB; False where that is not possible (not
    Linux/glibc) or not asked for (``kib == 0``)."""
    if kib <= 0:
        return False
    libc = _libc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, kib * 1024))
    if not ok:
        logger.warning("mallopt(M_MMAP_THRESHOLD, %d KiB) failed", kib)
    return ok
