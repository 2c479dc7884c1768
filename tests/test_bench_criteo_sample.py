"""bench/criteo_sample.py: planted-signal rows in Kaggle's train.txt format, which
``preprocess`` reads without a bad row, with the generator's click rate and its counts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from dlrm_vrgd.config import SyntheticData
from dlrm_vrgd.data.criteo.preprocess import preprocess
from dlrm_vrgd.data.synthetic import SyntheticCriteo

ROOT = Path(__file__).resolve().parents[1]


def test_the_sample_is_criteo_text_of_the_generators_rows(tmp_path: Path) -> None:
    text = tmp_path / "s.txt"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "criteo_sample.py"), "--rows", "2000", "--out",
         str(text)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = text.read_text().splitlines()
    assert len(lines) == 2000 and all(len(ln.split("\t")) == 40 for ln in lines)
    res = preprocess([text], tmp_path / "days", max_rows_per_table=10_000, progress=False)
    assert res.rows == 2000  # a bad row would have stopped it
    labels = np.load(tmp_path / "days" / "day_0_labels.npy").ravel()
    dense = np.load(tmp_path / "days" / "day_0_dense.npy")
    rows = SyntheticCriteo(SyntheticData(train_rows=2000, val_rows=1, test_rows=1,
                                         chunk_rows=2000)).generate("train", 0)  # fmt: skip
    np.testing.assert_array_equal(labels, rows.labels.astype(np.int32))
    counts = np.rint(np.expm1(rows.dense.astype(np.float64)))
    np.testing.assert_allclose(dense, np.log(counts + 5).astype(np.float32), rtol=1e-6)
