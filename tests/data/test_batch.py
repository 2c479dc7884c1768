from __future__ import annotations

import numpy as np
import pytest

from dlrm_vrgd.data.batch import Batch, TrainStream, feature_names
from dlrm_vrgd.data.rows import Rows


class IdSource:
    """Row i has id i in its single sparse column: lets tests see which rows a read returns."""

    def __init__(self, n: int, block: int) -> None:
        self.num_rows, self.block_rows = n, block
        self.cardinalities, self.num_dense = [n], 1

    def read(self, start: int, stop: int) -> Rows:
        ids = np.arange(start, stop, dtype=np.int64)
        return Rows(
            ids[:, None].astype(np.float32), ids[:, None], np.zeros(stop - start, np.float32)
        )


def ids_of(rows: Rows) -> list[int]:
    return rows.sparse[:, 0].tolist()


def test_each_epoch_visits_every_row_once() -> None:
    src = IdSource(1000, 64)  # last block is short (1000 = 15 * 64 + 40)
    stream = TrainStream(src, global_batch=200, micro_batch=50, seed=0)
    seen = [i for step in range(5) for g in range(4) for i in ids_of(stream.rows(step, g))]
    assert sorted(seen) == list(range(1000))
    assert seen != list(range(1000))  # block-shuffled
    # the second epoch visits them again, in another order
    second = [i for step in range(5, 10) for g in range(4) for i in ids_of(stream.rows(step, g))]
    assert sorted(second) == list(range(1000)) and second != seen


def test_blocks_stay_contiguous() -> None:
    stream = TrainStream(IdSource(1024, 128), global_batch=128, micro_batch=128, seed=1)
    ids = ids_of(stream.rows(0, 0))
    assert ids == list(range(ids[0], ids[0] + 128)) and ids[0] % 128 == 0


def test_steps_straddle_epochs_without_dropping_rows() -> None:
    src = IdSource(300, 100)
    stream = TrainStream(src, global_batch=200, micro_batch=100, seed=0)
    # step 1 covers stream positions 200..399: the last 100 rows of epoch 0, then 100 of epoch 1
    assert sorted(
        ids_of(stream.rows(0, 0)) + ids_of(stream.rows(0, 1)) + ids_of(stream.rows(1, 0))
    ) == list(range(300))
    assert stream.epoch(3) == pytest.approx(2.0)


def test_groups_are_disjoint_and_deterministic() -> None:
    a = TrainStream(IdSource(4096, 256), global_batch=1024, micro_batch=128, seed=5)
    b = TrainStream(IdSource(4096, 256), global_batch=1024, micro_batch=128, seed=5)
    groups = [ids_of(a.rows(2, g)) for g in range(8)]
    flat = [i for g in groups for i in g]
    assert len(set(flat)) == 1024
    assert groups == [ids_of(b.rows(2, g)) for g in reversed(range(8))][::-1]


def test_too_few_rows_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="fewer than one global batch"):
        TrainStream(IdSource(100, 10), global_batch=128, micro_batch=64, seed=0)


def test_batch_kjt_layout() -> None:
    rows = Rows(
        dense=np.zeros((3, 2), np.float32),
        sparse=np.array([[1, 10], [2, 20], [3, 30]]),
        labels=np.array([0, 1, 0], np.float32),
    )
    kjt = Batch.from_rows(rows).kjt(feature_names(2))
    assert kjt.keys() == ["cat_0", "cat_1"]
    assert kjt.values().tolist() == [1, 2, 3, 10, 20, 30]
    assert kjt.lengths().tolist() == [1] * 6
    assert kjt["cat_1"].values().tolist() == [10, 20, 30]
