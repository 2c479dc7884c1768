"""glibc's mmap threshold: trading speed for resident memory that does not creep.

Every micro-batch allocates and frees the same large activation and gradient buffers. glibc
serves allocations below its *adaptive* mmap threshold (which climbs up to 32 MiB as large
blocks are freed) from its heap and keeps freed heap memory for reuse — fast, but the heap
fragments, so over many micro-batches the resident set creeps up (measured by bench/memory.py:
+~150 MB over 64 micro-batches of the Kaggle-sized model). Fixing the threshold (``mallopt``)
sends every allocation above it to ``mmap``, returned to the system when freed: resident memory
then tracks what is alive, at the price of page faults on every large allocation (slower steps).
``run.malloc_mmap_threshold_kb`` chooses; 0 keeps glibc's adaptive default.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def set_mmap_threshold(kib: int) -> bool:
    """Fix glibc's mmap threshold at ``kib`` KiB; False where that is not possible (not
    Linux/glibc) or not asked for (``kib == 0``)."""
    if kib <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, kib * 1024))
    if not ok:
        logger.warning("mallopt(M_MMAP_THRESHOLD, %d KiB) failed", kib)
    return ok
