"""``dlrm-vrgd generate`` (dlrm_vrgd/cli/cmd_data.py); ``preprocess`` through the CLI is in
tests/data/criteo/test_preprocess_cli.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .conftest import tiny_config_dict
from .test_cli import cli, write_config


def test_generate_writes_npy_splits(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    proc = cli("generate", "--config", str(cfg), "--split", "val", "--out", str(tmp_path / "d"))
    assert proc.returncode == 0, proc.stderr
    dense = np.load(tmp_path / "d" / "val_dense.npy")
    sparse = np.load(tmp_path / "d" / "val_sparse.npy")
    labels = np.load(tmp_path / "d" / "val_labels.npy")
    assert dense.shape == (1024, 13) and sparse.shape == (1024, 6) and labels.shape == (1024, 1)
    from dlrm_vrgd.config import parse_config
    from dlrm_vrgd.data.synthetic import SyntheticCriteo

    rows = SyntheticCriteo(parse_config(tiny_config_dict()).data).source("val").read(0, 1024)
    np.testing.assert_array_equal(sparse, rows.sparse)
    np.testing.assert_array_equal(labels[:, 0], rows.labels)
    assert not list((tmp_path / "d").glob("*.tmp"))
