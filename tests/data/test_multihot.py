"""dlrm_vrgd/data/multihot.py: bag layouts with static KJT parts, MLPerf's lookup tables, the
multi-hot row source, and data.multi_hot_sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dlrm_vrgd.config import ConfigError, CriteoData, SyntheticData, parse_config
from dlrm_vrgd.data import build_splits
from dlrm_vrgd.data.batch import Batch, TrainStream
from dlrm_vrgd.data.criteo.npz import NpzError, open_multi_hot, write_multi_hot
from dlrm_vrgd.data.multihot import BagLayout, MultiHotTables
from dlrm_vrgd.data.pipeline.slots import HostBatch, Layout, PinnedSlots, SharedSlots


def test_kjt_of_a_multi_hot_batch() -> None:
    bags = BagLayout((2, 1, 3))
    sparse = torch.arange(4 * 6).reshape(4, 6)  # row r: 6r .. 6r+5
    kjt = bags.kjt(sparse, ["a", "b", "c"])
    for key, (lo, hi) in zip("abc", [(0, 2), (2, 3), (3, 6)], strict=True):
        jt = kjt[key]
        torch.testing.assert_close(jt.values(), sparse[:, lo:hi].reshape(-1))
        assert jt.lengths().tolist() == [hi - lo] * 4
    assert kjt.offsets().tolist() == [0, 2, 4, 6, 8, 9, 10, 11, 12, 15, 18, 21, 24]
    assert kjt.length_per_key() == [8, 4, 12]


def test_static_parts_are_made_once_per_batch_size() -> None:
    bags = BagLayout((3, 1))
    a = bags.parts(16)
    assert bags.parts(16) is a  # every batch of 16 rows reuses them
    assert bags.parts(8) is not a
    k1 = bags.kjt(torch.zeros(16, 4, dtype=torch.int64), ["x", "y"])
    k2 = bags.kjt(torch.ones(16, 4, dtype=torch.int64), ["x", "y"])
    assert k1.offsets() is k2.offsets() is a.offsets
    with pytest.raises(ValueError, match="4 ids a row"):
        bags.values(torch.zeros(16, 5, dtype=torch.int64))


def test_bag_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BagLayout((2, 0))
    with pytest.raises(ValueError, match="2 bag sizes for 3 tables"):
        MultiHotTables([5, 6, 7], [2, 2])


def test_expand_one_hot_rows() -> None:
    tables = MultiHotTables([5, 7, 11], [3, 1, 2])
    ids = np.array([[0, 6, 10], [4, 0, 3]])
    out = tables.expand(ids)
    assert out.shape == (2, 6) and out.dtype == np.int64
    np.testing.assert_array_equal(out[:, [0, 3, 4]], ids)  # the one-hot id leads its bag
    for k, (lo, hi) in enumerate([(0, 3), (3, 4), (4, 6)]):
        np.testing.assert_array_equal(out[:, lo:hi], tables.table(k)[ids[:, k]])
        assert out[:, lo:hi].max() < tables.rows[k]
    narrow = tables.expand(ids, out=np.empty((2, 6), dtype=np.int32))
    np.testing.assert_array_equal(narrow, out)
    with pytest.raises(IndexError):
        tables.expand(np.array([[5, 0, 0]]))  # id 5 of a 5-row table


def test_synthetic_multi_hot_rows_and_stream() -> None:
    cfg = SyntheticData(
        train_rows=600, val_rows=50, test_rows=50, cardinalities=[40, 30, 20], chunk_rows=64,
        multi_hot_sizes=[4, 1, 2],
    )  # fmt: skip
    splits = build_splits(cfg)
    plain = build_splits(cfg.model_copy(update={"multi_hot_sizes": None}))
    assert splits.bags == BagLayout((4, 1, 2)) and plain.bags is None
    rows = splits.train.read(10, 90)
    one = plain.train.read(10, 90)
    assert rows.sparse.shape == (80, 7) and rows.bags == splits.bags
    np.testing.assert_array_equal(rows.sparse[:, [0, 4, 5]], one.sparse)
    np.testing.assert_array_equal(rows.labels, one.labels)
    stream = TrainStream(splits.train, global_batch=128, micro_batch=32, seed=3)
    got = stream.rows(2, 1)
    assert got.bags == splits.bags and got.materialized().sparse.shape == (32, 7)
    batch = Batch.from_rows(got)
    assert batch.bags is splits.bags
    assert batch.kjt(["a", "b", "c"]).values().numel() == 32 * 7

    class Stored:  # the same rows, read multi-hot (N x L) as a day file would give them
        num_rows, block_rows = splits.train.num_rows, splits.train.block_rows
        cardinalities, num_dense = splits.train.cardinalities, splits.train.num_dense
        bags, read = splits.train.bags, splits.train.read  # type: ignore[attr-defined]

    stored = TrainStream(Stored(), global_batch=128, micro_batch=32, seed=3)  # type: ignore[arg-type]
    # the pipeline's rows stay one-hot until the fill; same ids per (row, table, position)
    for step, group in [(0, 0), (2, 1), (4, 3), (9, 2)]:  # keys straddling shuffle blocks
        rows = stored.rows(step, group)
        lazy = stream.rows(step, group)
        assert rows.hot is None and rows.sparse.shape == (32, 7)
        assert lazy.hot is not None and lazy.sparse.shape == (32, 3)
        np.testing.assert_array_equal(lazy.materialized().sparse, rows.sparse)
        want = np.concatenate(
            [rows.sparse[:, a:b].reshape(-1) for a, b in [(0, 4), (4, 5), (5, 7)]]
        )
        for source in (lazy, rows):
            kjt = Batch.from_rows(source).kjt(["a", "b", "c"])
            assert kjt.values().tolist() == want.tolist()
            assert kjt.lengths().tolist() == [4] * 32 + [1] * 32 + [2] * 32


def test_pipeline_slots_carry_bags() -> None:
    bags = BagLayout((2, 3))
    layout = Layout(4, 2, 2, bags)
    assert layout.width == 5 and layout.nbytes() == 4 * (4 * 2 + 4 * 5 + 4)
    assert layout.sparse_shape == (20,)
    tables = MultiHotTables([9, 9], [2, 3])
    from dlrm_vrgd.data.rows import Rows

    one_hot = np.array([[1, 2], [3, 4], [5, 6], [7, 8]])
    rows = Rows(
        np.zeros((4, 2), np.float32), tables.expand(one_hot), np.zeros(4, np.float32), bags=bags
    )
    lazy = Rows(rows.dense, one_hot, rows.labels, bags=bags, hot=tables)
    assert np.array_equal(lazy.materialized().sparse, rows.sparse)
    # a micro-batch holds the ids in the KJT's table order: table 0's 4 x 2 bags, table 1's 4 x 3
    kjt_order = np.concatenate([rows.sparse[:, :2].reshape(-1), rows.sparse[:, 2:].reshape(-1)])
    for source in (rows, lazy):  # stored N x L rows and rows the synthesis makes at the fill
        pinned = PinnedSlots(layout, 1, pin=False)
        host = pinned.fill(0, source)
        assert host.bags is bags and host.sparse.dtype == torch.int32
        np.testing.assert_array_equal(host.sparse.numpy(), kjt_order)
        shared = SharedSlots(layout, 1)
        shared.fill(0, source)
        own = shared.own(0)
        assert own.bags is bags
        np.testing.assert_array_equal(own.sparse.numpy(), kjt_order)
        shared.close()
        mine = HostBatch.own(source)
        assert mine.bags is bags and mine.sparse.dtype == torch.int64
        np.testing.assert_array_equal(mine.sparse.numpy(), kjt_order)
        batch = Batch.from_rows(source)
        np.testing.assert_array_equal(batch.sparse.numpy(), kjt_order)
        assert batch.kjt(["a", "b"]).values().tolist() == kjt_order.tolist()
    with pytest.raises(ValueError, match="int32"):
        PinnedSlots(layout, 1, pin=False).fill(
            0, Rows(rows.dense, one_hot - 2, rows.labels, bags=bags, hot=tables)
        )


def test_npz_round_trip_and_refusals(tmp_path: Path) -> None:
    sizes = [3, 1]
    data = [np.arange(30, dtype=np.int32).reshape(10, 3), np.arange(10, dtype=np.int32)[:, None]]
    path = tmp_path / "day_0_sparse_multi_hot.npz"
    write_multi_hot(path, 10, sizes, lambda k, a, b: data[k][a:b])
    maps = open_multi_hot(path, 2)
    for m, d in zip(maps, data, strict=True):
        np.testing.assert_array_equal(m, d)
    with np.load(path) as z:  # numpy reads it as an npz
        np.testing.assert_array_equal(z["0"], data[0])
    with pytest.raises(NpzError, match="expected 0.npy..2.npy"):
        open_multi_hot(path, 3)
    packed = tmp_path / "packed.npz"
    np.savez_compressed(packed, **{"0": data[0], "1": data[1]})
    with pytest.raises(NpzError, match="compressed"):
        open_multi_hot(packed, 2)


def test_config_fields() -> None:
    with pytest.raises(ConfigError, match="2 bag sizes for 3 tables"):
        parse_config(
            {"data": {"source": "synthetic", "cardinalities": [5, 6, 7], "multi_hot_sizes": [1, 2]}}
        )
    with pytest.raises(ConfigError, match="multi_hot_sizes"):
        parse_config(
            {"data": {"source": "synthetic", "cardinalities": [5], "multi_hot_sizes": [0]}}
        )
    cfg = CriteoData(path="x", multi_hot_sizes=[1] * 26, multi_hot_cache="/tmp/mh")
    assert cfg.multi_hot_cache == Path("/tmp/mh")


def test_generate_multi_hot_option() -> None:
    from dlrm_vrgd.cli import build_parser
    from dlrm_vrgd.cli.cmd_data import multi_hot_sizes
    from dlrm_vrgd.data.multihot import MLPERF_MULTI_HOT_SIZES

    args = build_parser().parse_args(["generate", "--config", "c", "--out", "x", "--multi-hot"])
    assert args.multi_hot == "config"
    assert build_parser().parse_args(["generate", "--config", "c", "--out", "x"]).multi_hot is None
    assert multi_hot_sizes(None, [2, 3]) is None
    assert multi_hot_sizes("config", [2, 3]) == [2, 3]
    assert multi_hot_sizes("mlperf", None) == list(MLPERF_MULTI_HOT_SIZES)
    assert multi_hot_sizes("4,1", None) == [4, 1]
    with pytest.raises(ValueError, match="needs data.multi_hot_sizes"):
        multi_hot_sizes("config", None)
    with pytest.raises(ValueError, match="at least 1"):
        multi_hot_sizes("4,0", None)


def _multi_hot_train_config(**extra: dict) -> dict:
    raw: dict = {
        "data": {
            "source": "synthetic", "train_rows": 2048, "val_rows": 256, "test_rows": 256,
            "cardinalities": [50, 60, 70], "chunk_rows": 256, "multi_hot_sizes": [3, 1, 2],
        },
        "run": {"global_batch": 512, "micro_batch": 256, "steps": 3},
    }  # fmt: skip
    for section, values in extra.items():
        raw.setdefault(section, {}).update(values)
    return raw


def test_multi_hot_trains_with_the_plain_rowwise_optimizer() -> None:
    from dlrm_vrgd.train.loop import Trainer

    trainer = Trainer(parse_config(_multi_hot_train_config()))
    try:
        losses = [trainer.train_step()["loss"] for _ in range(3)]
    finally:
        trainer.close_input()
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_multi_hot_training_refuses_the_torch_backend() -> None:
    # its lookup takes one id a table; the gsnr_ / cowclip_ steps are verified on repeated ids
    # (tests/optim/test_sparse_multihot.py) and accepted
    with pytest.raises(ConfigError, match="data.multi_hot_sizes: .*embedding_backend: fbgemm"):
        parse_config(_multi_hot_train_config(model={"embedding_backend": "torch"}))
    for name in ("gsnr_rowwise_adagrad", "cowclip_rowwise_adagrad"):
        parse_config(_multi_hot_train_config(optim={"sparse": {"name": name}}))
