"""Host buffers: ids narrowed to int32 only where they travel, never wrapped; shared slots."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlrm_vrgd.data.pipeline.slots import (
    INT32_MAX,
    HostBatch,
    Layout,
    PinnedSlots,
    SharedSlots,
    narrow_ids,
)

from .helpers import key_rows


def test_narrowing_keeps_every_id_that_fits() -> None:
    ids = np.array([[0, 1], [INT32_MAX, 12345]], dtype=np.int64)
    out = np.empty((2, 2), dtype=np.int32)
    narrow_ids(ids, out)
    assert out.tolist() == ids.tolist()


@pytest.mark.parametrize("bad", [INT32_MAX + 1, -1, 2**40])
def test_an_id_that_would_wrap_is_refused(bad: int) -> None:
    ids = np.array([[0, bad]], dtype=np.int64)
    with pytest.raises(ValueError, match="do not fit int32"):
        narrow_ids(ids, np.empty((1, 2), dtype=np.int32))


def test_a_pinned_slot_holds_int32_ids_and_the_rows() -> None:
    layout = Layout(8, 3, 2)
    slots = PinnedSlots(layout, 2, pin=False)  # the same buffers, unpinned (no CUDA here)
    rows = key_rows(4, 1)
    host = slots.fill(1, rows)
    assert host.slot == 1 and host.sparse.dtype == torch.int32
    assert host.sparse.tolist() == rows.sparse.tolist()
    assert torch.equal(host.dense, torch.from_numpy(rows.dense))


def test_rows_of_another_shape_are_refused() -> None:
    slots = PinnedSlots(Layout(4, 3, 2), 1, pin=False)
    with pytest.raises(ValueError, match="micro-batch holds"):
        slots.fill(0, key_rows(0, 0))  # 8 rows into a slot of 4


def test_shared_slots_are_independent_and_copied_out_as_int64() -> None:
    layout = Layout(8, 3, 2)
    shared = SharedSlots(layout, 3)
    for slot, key in enumerate([(0, 0), (0, 1), (5, 3)]):
        shared.fill(slot, key_rows(*key))
    own = shared.own(2)
    rows = key_rows(5, 3)
    assert own.sparse.dtype == torch.int64 and own.sparse.tolist() == rows.sparse.tolist()
    shared.fill(2, key_rows(9, 9))  # the copy is its own memory
    assert own.sparse.tolist() == rows.sparse.tolist()
    assert shared.arrays(0)[1][0, 0] == 0 and shared.arrays(1)[1][0, 0] == 1
    pinned = PinnedSlots(layout, 1, pin=False)
    got = pinned.copy_from(0, shared.arrays(1))
    assert got.sparse.tolist() == key_rows(0, 1).sparse.tolist()
    shared.close()


def test_own_keeps_int64_rows_without_a_copy() -> None:
    rows = key_rows(1, 1)
    host = HostBatch.own(rows)
    assert host.sparse.dtype == torch.int64
    assert np.shares_memory(host.sparse.numpy(), rows.sparse)
