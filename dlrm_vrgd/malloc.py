"""glibc's allocator: resident memory that does not creep over the micro-batches of a step.

Every micro-batch allocates and frees the same large activation and gradient buffers. glibc
serves allocations below its *adaptive* mmap threshold (which climbs up to 32 MiB as large
blocks are freed) from its heap and keeps freed heap memory for reuse — fast, but the heap
fragments, so over many micro-batches the resident set creeps up (measured by bench/memory.py:
+~150 MB over 64 micro-batches of the Kaggle-sized model). Fixing the threshold (``mallopt``)
sends every allocation above it to ``mmap``, returned to the system when freed: resident memory
then tracks what is alive, at the price of page faults on every large allocation (slower steps).
``run.malloc_mmap_threshold_kb`` chooses; 0 keeps glibc's adaptive default.

By default the trainer instead calls :func:`release_free_memory` (``malloc_trim(0)``) after
every micro-batch: at that point the micro-batch's buffers are all free, and glibc hands the
pages of its free heap chunks back to the system (``madvise(MADV_DONTNEED)``) while keeping the
address space. The heap keeps its fast reuse within a micro-batch; what is retained across
micro-batches is then what is alive (the step's row sums), not the fragments (bench/memory.py
measures both; the cost is one call and the pages re-touched in the next micro-batch). The
sparse step does the same between the chunks of its touched rows (:func:`released`): each chunk
allocates and frees ``chunk_rows x D`` temporaries, and without it the heap grew by ~240 B per
touched row over a 512k step (118 MB at 503k rows) — the step's peak then exceeded the
micro-batches'.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Iterator, Sequence
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
