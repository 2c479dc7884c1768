"""``data.split: mlperf``: MLPerf DLRMv2's split of the day files (train on every labeled day
but the last; the last halved, its first ceil(N/2) rows validate, the rest test), on small
days written by ``dlrm-vrgd generate``; the expected rows are cut here by hand from the
day files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dlrm_vrgd.config import ConfigError, CriteoData, parse_config
from dlrm_vrgd.data import build_splits
from dlrm_vrgd.data.export import generate_days

from ...conftest import tiny_config, tiny_config_dict


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Train days 0-2 (1000, 1000, 500 rows), val day 3 (300), test day 4 (301: odd)."""
    out = tmp_path_factory.mktemp("mlperf") / "days"
    cfg = tiny_config(
        "data.train_rows=2500", "data.val_rows=300", "data.test_rows=301", "data.chunk_rows=256"
    )
    generate_days(cfg, out, rows_per_day=1000, workers=1, progress=False)
    return out


def criteo_config(data: dict) -> dict:
    """tiny_config's dict reading day files instead of its synthetic rows."""
    return {**tiny_config_dict(), "data": {"source": "criteo", **data}}


def day(path: Path, i: int, kind: str) -> np.ndarray:
    return np.load(path / f"day_{i}_{kind}.npy")


def test_mlperf_split_halves_the_last_day(days: Path) -> None:
    splits = build_splits(CriteoData(path=days, split="mlperf"))
    # by hand: train = days 0-3 (the manifest's val day too), val = 151 rows, test = 150
    assert splits.train.num_rows == 1000 + 1000 + 500 + 300
    assert (splits.val.num_rows, splits.test.num_rows) == (151, 150)  # ceil / floor of 301 / 2
    sparse, labels = day(days, 4, "sparse"), day(days, 4, "labels")[:, 0]
    val, test = splits.val.read(0, 151), splits.test.read(0, 150)
    np.testing.assert_array_equal(val.sparse, sparse[:151])
    np.testing.assert_array_equal(test.sparse, sparse[151:])
    np.testing.assert_array_equal(val.labels, labels[:151])
    np.testing.assert_array_equal(test.labels, labels[151:])
    np.testing.assert_array_equal(val.dense, day(days, 4, "dense")[:151])
    np.testing.assert_array_equal(splits.train.read(2500, 2800).sparse, day(days, 3, "sparse"))

    # the default split follows the manifest: train days 0-2, val day 3, test day 4, whole
    default = build_splits(CriteoData(path=days))
    assert (default.train.num_rows, default.val.num_rows, default.test.num_rows) == (
        2500, 300, 301,
    )  # fmt: skip


def test_mlperf_split_validates_on_the_whole_half_unless_told(days: Path) -> None:
    assert CriteoData(path=days, split="mlperf").max_val_rows is None
    assert CriteoData(path=days).max_val_rows == 1_000_000
    capped = build_splits(CriteoData(path=days, split="mlperf", max_val_rows=100))
    assert capped.val.num_rows == 100 and capped.test.num_rows == 150
    # the stored (dumped) config reads back the same
    cfg = parse_config(criteo_config({"path": str(days), "split": "mlperf"}))
    again = parse_config(cfg.to_dict())
    assert again.data == cfg.data and again.data.max_val_rows is None


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"train_days": [0]}, "data.train_days"),
        ({"val_days": [4]}, "data.val_days"),
        ({"test_days": [4]}, "data.test_days"),
        ({"val_fraction": 0.3}, "data.val_fraction"),
    ],
)
def test_mlperf_split_takes_no_day_fields(extra: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=f"data.split mlperf .* takes no {named}"):
        parse_config(criteo_config({"path": "days", "split": "mlperf", **extra}))
