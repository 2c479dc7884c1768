"""A tampered data manifest (the one export reads to learn how the model's features were made)
gives one FeatureError naming the file, never a traceback, and never names a vocabulary file
outside its directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dlrm_vrgd.config import parse_config
from dlrm_vrgd.serve.features import FeatureError, layout_of_run

GOOD = {
    "sparse": {"max_rows_per_table": None, "frequency_threshold": 0, "cardinalities": [5] * 26},
    "dense_transform": {"floor": -1},
}


def layout(tmp_path: Path, manifest: object) -> object:
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    cfg = parse_config({"data": {"source": "criteo", "path": str(tmp_path)}})
    return layout_of_run(cfg, [5] * 26, 13)


def test_a_good_manifest_gives_its_layout(tmp_path: Path) -> None:
    lay, vocab = layout(tmp_path, GOOD)
    assert lay.dense_floor == -1 and vocab is None


@pytest.mark.parametrize(
    "manifest",
    [
        {**GOOD, "dense_transform": {"floor": None}},
        {**GOOD, "dense_transform": []},
        {"sparse": "x", "dense_transform": {"floor": 0}},
        [],
        "[" * 100_000,
    ],
)
def test_a_tampered_manifest_is_one_error_naming_the_file(tmp_path: Path, manifest) -> None:
    if isinstance(manifest, str):  # not JSON of this shape: nested past the depth cap
        (tmp_path / "manifest.json").write_text(manifest)
        cfg = parse_config({"data": {"source": "criteo", "path": str(tmp_path)}})
        with pytest.raises(FeatureError, match="manifest.json"):
            layout_of_run(cfg, [5] * 26, 13)
        return
    with pytest.raises(FeatureError, match="manifest.json"):
        layout(tmp_path, manifest)


def test_the_vocabulary_is_read_from_the_directory_only(tmp_path: Path) -> None:
    np.save(tmp_path.parent / "outside.npy", np.arange(3))
    sparse = {**GOOD["sparse"], "frequency_threshold": 2, "vocab": {"file": "../outside.npy"}}
    with pytest.raises(FeatureError, match="not a name in the directory"):
        layout(tmp_path, {**GOOD, "sparse": sparse})
