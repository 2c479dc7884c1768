"""Multi-hot ids against MLPerf DLRMv2's own code (tests/data/mlperf_reference.py, vendored from
mlcommons/training): the synthesis made on the fly from one-hot days, and MLPerf's materialized
``day_{i}_sparse_multi_hot.npz`` read directly, give MLPerf's ids row for row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
from torchrec.datasets.utils import Batch as TorchrecBatch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_vrgd.config import CriteoData
from dlrm_vrgd.data.batch import Batch
from dlrm_vrgd.data.criteo.source import criteo_splits
from dlrm_vrgd.data.multihot import (
    MLPERF_MULTI_HOT_SIZES,
    MLPERF_NUM_EMBEDDINGS,
    MultiHotTables,
)
from tests.data import mlperf_reference as ref

SIZES = list(MLPERF_MULTI_HOT_SIZES)
#: MLPerf's caps, cut to 3,000 rows (the small tables keep theirs: 3, 4, 10, 14, ...)
CAPS = [min(c, 3000) for c in MLPERF_NUM_EMBEDDINGS]
DAY_ROWS = (301, 257, 200)  # the last day (val / test) even: both halvings agree on it
BATCH = 64


@pytest.fixture(scope="module")
def onehot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MLPerf's preprocessed one-hot days (torchrec's npy layout, no manifest): int32 ids up
    to twice the caps (the synthesis takes them modulo the caps), dense, labels."""
    out = tmp_path_factory.mktemp("mlperf_onehot")
    rng = np.random.default_rng(46)
    for i, n in enumerate(DAY_ROWS):
        high = np.asarray(CAPS) * 2
        sparse = (rng.random((n, 26)) * high).astype(np.int32)
        np.save(out / f"day_{i}_sparse.npy", sparse)
        np.save(out / f"day_{i}_dense.npy", rng.random((n, 13), dtype=np.float32))
        np.save(out / f"day_{i}_labels.npy", rng.integers(0, 2, (n, 1), dtype=np.int32))
    return out


@pytest.fixture(scope="module")
def multihot() -> ref.Multihot:
    return ref.Multihot(SIZES, CAPS, batch_size=BATCH, collect_freqs_stats=False)


@pytest.fixture(scope="module")
def materialized_dir(
    onehot_dir: Path, multihot: ref.Multihot, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """MLPerf's materialize script run on the one-hot days."""
    out = tmp_path_factory.mktemp("mlperf_multihot")
    for i in range(len(DAY_ROWS)):
        ref.materialize_day(i, str(onehot_dir), str(out), multihot, CAPS)
    return out


def _kjt_equal(ours: KeyedJaggedTensor, theirs: KeyedJaggedTensor) -> None:
    assert ours.keys() == theirs.keys()
    torch.testing.assert_close(ours.values().long(), theirs.values().long(), rtol=0, atol=0)
    torch.testing.assert_close(ours.lengths().long(), theirs.lengths().long(), rtol=0, atol=0)
    torch.testing.assert_close(ours.offsets().long(), theirs.offsets().long(), rtol=0, atol=0)
    assert ours.length_per_key() == theirs.length_per_key()


def _batches(source, rows: int):
    for a in range(0, source.num_rows, rows):
        yield Batch.from_rows(source.read(a, min(a + rows, source.num_rows)))


def test_lookup_tables_are_mlperfs(multihot: ref.Multihot, tmp_path: Path) -> None:
    ours = MultiHotTables(CAPS, SIZES)
    cached = MultiHotTables(CAPS, SIZES, cache_dir=tmp_path)
    again = MultiHotTables(CAPS, SIZES, cache_dir=tmp_path)  # maps what `cached` drew
    for k, table in enumerate(multihot.multi_hot_tables_l):
        np.testing.assert_array_equal(ours.table(k), table.numpy())
        np.testing.assert_array_equal(cached.table(k), table.numpy())
        np.testing.assert_array_equal(again.table(k), table.numpy())


def test_on_the_fly_synthesis_equals_mlperfs_convert(
    onehot_dir: Path, multihot: ref.Multihot
) -> None:
    """One-hot days read with data.multi_hot_sizes == Multihot.convert_to_multi_hot of the
    same one-hot batch (MLPerf's on-the-fly path), batch for batch."""
    cfg = CriteoData(path=onehot_dir, max_rows_per_table=CAPS, multi_hot_sizes=SIZES)
    splits = criteo_splits(cfg)
    assert splits.bags is not None and splits.bags.sizes == tuple(SIZES)
    assert splits.cardinalities == CAPS
    train = splits.train
    assert train.num_rows == DAY_ROWS[0] + DAY_ROWS[1]
    onehot = np.concatenate([np.load(onehot_dir / f"day_{i}_sparse.npy") for i in (0, 1)])
    seen = 0
    for batch in _batches(train, BATCH):
        n = len(batch)
        ids = torch.from_numpy(onehot[seen : seen + n] % np.asarray(CAPS, dtype=np.int32))
        one_hot = KeyedJaggedTensor.from_lengths_sync(
            keys=DEFAULT_CAT_NAMES,
            values=ids.t().reshape(-1),
            lengths=torch.ones(26 * n, dtype=torch.int32),
        )
        theirs = multihot.convert_to_multi_hot(
            TorchrecBatch(batch.dense, one_hot, batch.labels)
        ).sparse_features
        _kjt_equal(batch.kjt(DEFAULT_CAT_NAMES), theirs)
        seen += n
    assert seen == train.num_rows


@pytest.mark.parametrize("stage", ["train", "val", "test"])
@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")  # MLPerf's reader
def test_materialized_days_read_as_mlperfs_reader(materialized_dir: Path, stage: str) -> None:
    """MLPerf's npz days read directly == MultiHotCriteoIterDataPipe, row for row."""
    days = {"train": [0, 1], "val": [2], "test": [2]}[stage]
    theirs = ref.MultiHotCriteoIterDataPipe(
        stage,
        dense_paths=[str(materialized_dir / f"day_{d}_dense.npy") for d in days],
        sparse_paths=[str(materialized_dir / f"day_{d}_sparse_multi_hot.npz") for d in days],
        labels_paths=[str(materialized_dir / f"day_{d}_labels.npy") for d in days],
        batch_size=BATCH,
        rank=0,
        world_size=1,
        hashes=CAPS,
    )
    cfg = CriteoData(path=materialized_dir, max_rows_per_table=CAPS, max_val_rows=None)
    splits = criteo_splits(cfg)
    ours = getattr(splits, stage)
    assert splits.bags is not None and splits.bags.sizes == tuple(SIZES)
    count = 0
    for mine, batch in zip(_batches(ours, BATCH), theirs, strict=True):
        _kjt_equal(mine.kjt(DEFAULT_CAT_NAMES), batch.sparse_features)
        torch.testing.assert_close(mine.dense, batch.dense_features, rtol=0, atol=0)
        torch.testing.assert_close(mine.labels, batch.labels.float(), rtol=0, atol=0)
        count += len(mine)
    assert count == ours.num_rows == sum(len(b.labels) for b in theirs)


def test_on_the_fly_equals_materialized(onehot_dir: Path, materialized_dir: Path) -> None:
    """Rows made multi-hot as they are read == the rows of MLPerf's materialized files."""
    fly = criteo_splits(CriteoData(path=onehot_dir, max_rows_per_table=CAPS, multi_hot_sizes=SIZES))
    npz = criteo_splits(CriteoData(path=materialized_dir, max_rows_per_table=CAPS))
    for split in ("train", "val", "test"):
        a, b = getattr(fly, split), getattr(npz, split)
        assert a.num_rows == b.num_rows
        np.testing.assert_array_equal(a.read(0, a.num_rows).sparse, b.read(0, b.num_rows).sparse)


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")  # MLPerf's reader
def test_generated_multi_hot_days(tmp_path: Path) -> None:
    """`dlrm-vrgd generate --multi-hot`: MLPerf's reader reads its npz days, and reading them
    gives the live synthetic multi-hot rows (the same synthesis over the same ids)."""
    from dlrm_vrgd.config import SyntheticData, TrainConfig
    from dlrm_vrgd.data import build_splits
    from dlrm_vrgd.data.export import generate_days

    data = SyntheticData(
        train_rows=300, val_rows=64, test_rows=64, chunk_rows=64, multi_hot_sizes=SIZES,
        cardinalities=CAPS,
    )  # fmt: skip
    result = generate_days(
        TrainConfig(data=data), tmp_path / "days", rows_per_day=150, workers=1,
        progress=False, multi_hot=SIZES,
    )  # fmt: skip
    out = result.out
    assert sorted(p.name for p in out.glob("day_0_*")) == [
        "day_0_dense.npy", "day_0_labels.npy", "day_0_probs.npy", "day_0_sparse_multi_hot.npz",
    ]  # fmt: skip
    live = build_splits(data)
    days = criteo_splits(CriteoData(path=out, max_val_rows=None, shuffle_block_rows=64))
    for split in ("train", "val", "test"):
        a, b = getattr(live, split), getattr(days, split)
        np.testing.assert_array_equal(a.read(0, a.num_rows).sparse, b.read(0, b.num_rows).sparse)
    theirs = ref.MultiHotCriteoIterDataPipe(
        "train",
        dense_paths=[str(out / "day_0_dense.npy")],
        sparse_paths=[str(out / "day_0_sparse_multi_hot.npz")],
        labels_paths=[str(out / "day_0_labels.npy")],
        batch_size=BATCH,
        rank=0,
        world_size=1,
        hashes=CAPS,
    )
    rows = live.train.read(0, 150)
    for i, batch in enumerate(theirs):
        mine = Batch.from_rows(rows.slice(i * BATCH, min(150, (i + 1) * BATCH)))
        _kjt_equal(mine.kjt(DEFAULT_CAT_NAMES), batch.sparse_features)
