from __future__ import annotations

import sys

import pytest

from dlrm_vrgd.malloc import release_free_memory, set_mmap_threshold


def test_zero_leaves_the_allocator_alone() -> None:
    assert set_mmap_threshold(0) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_threshold_is_set_through_mallopt() -> None:
    assert set_mmap_threshold(32 * 1024) is True  # 32 MiB: glibc's own adaptive maximum


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_release_free_memory_returns_freed_heap_pages() -> None:
    """128 MiB of 64 KiB heap blocks, all freed but the last (which pins the heap's top, so
    glibc cannot shrink it on its own): resident until released, then handed back."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(2048)]
    for p in blocks:
        ctypes.memset(p, 1, 64 << 10)
    for p in blocks[:-1]:
        libc.free(p)
    held = _rss_kib()
    assert release_free_memory() is True
    released = held - _rss_kib()
    libc.free(blocks[-1])
    assert released > 96 << 10, f"only {released} KiB of 128 MiB freed came back"


def test_released_hands_pages_back_between_items_not_after_the_last(monkeypatch) -> None:
    import dlrm_vrgd.malloc as malloc

    events: list[object] = []
    monkeypatch.setattr(malloc, "release_free_memory", lambda: events.append("release"))
    for item in malloc.released(["a", "b", "c"]):
        events.append(item)
    assert events == ["a", "release", "b", "release", "c"]
    assert list(malloc.released([])) == []
    assert list(malloc.released(range(1))) == [0]
