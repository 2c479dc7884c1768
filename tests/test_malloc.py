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


def test_the_growth_guard_hands_back_only_once_the_heap_grew_by_its_margin(monkeypatch) -> None:
    """Heap spans fed by hand (MiB): the first call sets the base; growth within the margin
    keeps the heap as it is; past it, one hand-back, and the span read after it is the base."""
    import dlrm_vrgd.malloc as malloc

    spans = iter([100, 150, 164, 165, 170, 234, 235, 200])
    monkeypatch.setattr(malloc, "heap_bytes", lambda: next(spans) << 20)
    backs: list[int] = []
    monkeypatch.setattr(malloc, "release_free_memory", lambda: backs.append(1) or True)
    guard = malloc.HeapGrowthGuard(margin=64 << 20)
    assert [guard() for _ in range(3)] == [False, False, False]  # base 100; 150, 164 <= 164
    assert backs == []
    assert guard() is True  # 165 > 100 + 64: handed back, then the span is 170
    assert (len(backs), guard.base, guard.handed_back) == (1, 170 << 20, 1)
    assert guard() is False  # 234 <= 170 + 64
    assert guard() is True  # 235 > 234
    assert (len(backs), guard.base, guard.handed_back) == (2, 200 << 20, 2)


def test_heap_release_modes(monkeypatch) -> None:
    import dlrm_vrgd.malloc as malloc

    assert malloc.heap_release("micro_batch") is malloc.release_free_memory
    assert isinstance(malloc.heap_release("growth"), malloc.HeapGrowthGuard)
    assert malloc.heap_release("never")() is False
    with pytest.raises(ValueError, match="run.heap_release: 'often'"):
        malloc.heap_release("often")


def test_auto_hands_back_per_micro_batch_on_a_cpu_and_never_on_cuda(monkeypatch) -> None:
    import dlrm_vrgd.malloc as malloc

    assert malloc.resolve_heap_release("auto", "cpu") == "micro_batch"
    assert malloc.resolve_heap_release("auto", "cuda") == "never"
    assert malloc.resolve_heap_release("growth", "cuda") == "growth"  # a chosen mode stays
    calls: list[int] = []
    monkeypatch.setattr(malloc, "release_free_memory", lambda: calls.append(1) or True)
    assert malloc.heap_release("auto", "cpu")() is True and calls == [1]
    assert malloc.heap_release("auto", "cuda")() is False and calls == [1]


def test_without_mallinfo2_the_guard_hands_back_every_time(monkeypatch) -> None:
    import dlrm_vrgd.malloc as malloc

    monkeypatch.setattr(malloc, "heap_bytes", lambda: None)
    backs: list[int] = []
    monkeypatch.setattr(malloc, "release_free_memory", lambda: backs.append(1) or True)
    guard = malloc.HeapGrowthGuard()
    assert [guard(), guard()] == [True, True] and len(backs) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallinfo2")
def test_heap_bytes_holds_the_live_heap_blocks() -> None:
    """Real glibc: with 64 MiB of live 64 KiB blocks (heap-served: below the mmap threshold),
    the heaps' span is at least that (it may have been wider before: the blocks can reuse free
    space)."""
    import ctypes

    from dlrm_vrgd.malloc import heap_bytes

    if heap_bytes() is None:
        pytest.skip("glibc without mallinfo2")
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(1024)]
    try:
        span = heap_bytes()
        assert span is not None and span >= 64 << 20
    finally:
        for p in blocks:
            libc.free(p)
