from __future__ import annotations

import sys

import pytest

from dlrm_vrgd.train.malloc import set_mmap_threshold


def test_zero_leaves_the_allocator_alone() -> None:
    assert set_mmap_threshold(0) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_threshold_is_set_through_mallopt() -> None:
    assert set_mmap_threshold(32 * 1024) is True  # 32 MiB: glibc's own adaptive maximum
