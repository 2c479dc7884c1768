"""``dlrm-vrgd generate``: synthetic data as Criteo day files that the Criteo source accepts,
holding exactly the synthetic rows, written in parallel, with the oracle travelling along."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from dlrm_vrgd.config import CriteoData, parse_config
from dlrm_vrgd.data.criteo.source import CriteoDataError, criteo_splits
from dlrm_vrgd.data.export import generate_days, plan_days
from dlrm_vrgd.data.synthetic import SyntheticCriteo
from dlrm_vrgd.train.loop import Trainer

from ..conftest import tiny_config, tiny_config_dict


def mann_whitney_auc(probs: np.ndarray, labels: np.ndarray) -> float:
    """The reference: the share of (positive, negative) pairs the probabilities order right,
    ties counting one half (quadratic; small inputs only)."""
    pos, neg = probs[labels > 0.5], probs[labels <= 0.5]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (len(pos) * len(neg)))


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "days"
    # 4,096 train rows in days of 1,000 (chunks of 512 straddle days), two processes
    generate_days(tiny_config(), out, rows_per_day=1000, workers=2, progress=False)
    return out


def test_the_days_hold_the_synthetic_rows(days: Path) -> None:
    gen = SyntheticCriteo(tiny_config().data)  # type: ignore[arg-type]
    splits = criteo_splits(CriteoData(path=days, max_val_rows=None))
    manifest = json.loads((days / "manifest.json").read_text())
    assert [d["rows"] for d in manifest["days"]] == [1000, 1000, 1000, 1000, 96, 1024, 1024]
    assert manifest["splits"] == {"train_days": [0, 1, 2, 3, 4], "val_days": [5], "test_days": [6]}
    for split, source in (("train", splits.train), ("val", splits.val), ("test", splits.test)):
        want = gen.source(split).read(0, gen.split_rows(split))
        got = source.read(0, source.num_rows)
        assert source.num_rows == len(want)
        np.testing.assert_array_equal(got.dense, want.dense)
        np.testing.assert_array_equal(got.sparse, want.sparse)
        np.testing.assert_array_equal(got.labels, want.labels)
        np.testing.assert_array_equal(got.probs, want.probs)
    assert splits.cardinalities == tiny_config().data.cardinalities  # type: ignore[union-attr]
    assert splits.num_dense == 13


def test_the_oracle_travels_in_the_manifest(days: Path) -> None:
    manifest = json.loads((days / "manifest.json").read_text())
    gen = SyntheticCriteo(tiny_config().data)  # type: ignore[arg-type]
    for split in ("train", "val", "test"):
        rows = gen.source(split).read(0, gen.split_rows(split))
        oracle = manifest["generated"]["oracle"][split]
        assert oracle["rows"] == len(rows)
        assert oracle["auc"] == pytest.approx(mann_whitney_auc(rows.probs, rows.labels), abs=1e-6)
        p = rows.probs.astype(np.float64)
        logloss = -np.mean(rows.labels * np.log(p) + (1 - rows.labels) * np.log(1 - p))
        assert oracle["logloss"] == pytest.approx(logloss, rel=1e-5)
    assert manifest["generated"]["data"]["seed"] == 1


def test_one_process_or_several_write_the_same_bytes(days: Path, tmp_path: Path) -> None:
    one = tmp_path / "one"
    generate_days(tiny_config(), one, rows_per_day=1000, workers=1, progress=False)
    a = json.loads((days / "manifest.json").read_text())["days"]
    b = json.loads((one / "manifest.json").read_text())["days"]
    assert [d["files"] for d in a] == [d["files"] for d in b]  # SHA-256 of every file


def test_training_on_the_days_is_training_on_live_synthetic_data(days: Path) -> None:
    """The same rows in the same order (shuffle blocks = chunks, same seed): the same losses,
    and evaluations report the oracle AUC as on live data."""
    live = Trainer(tiny_config("run.steps=3"))
    raw = tiny_config_dict(run={"steps": 3})
    raw["data"] = {
        "source": "criteo",
        "path": str(days),
        "shuffle_block_rows": 512,
        "max_val_rows": None,
        "verify_checksums": True,
    }
    from_days = Trainer(parse_config(raw))
    try:
        for _ in range(3):
            assert from_days.train_step()["loss"] == live.train_step()["loss"]
    finally:
        live.close_input()
        from_days.close_input()
    a, b = live.evaluate(live.splits.val), from_days.evaluate(from_days.splits.val)
    assert b["auc"] == a["auc"] and b["oracle_auc"] == a["oracle_auc"]


def test_an_altered_day_is_refused(days: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(days, copy)
    probs = copy / "day_5_probs.npy"
    data = bytearray(probs.read_bytes())
    data[-1] ^= 0xFF
    probs.write_bytes(bytes(data))
    with pytest.raises(CriteoDataError, match="SHA-256 differs"):
        criteo_splits(CriteoData(path=copy, verify_checksums=True))
    probs.write_bytes(bytes(data[:-4]))
    with pytest.raises(CriteoDataError, match="day_5_probs.npy"):
        criteo_splits(CriteoData(path=copy))


def test_a_failed_generation_leaves_no_output(tmp_path: Path, monkeypatch) -> None:
    def broken(self, split, chunk):  # type: ignore[no-untyped-def]
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(SyntheticCriteo, "generate", broken)
    out = tmp_path / "days"
    with pytest.raises(RuntimeError, match="disk on fire"):
        generate_days(tiny_config(), out, workers=2, progress=False)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_days_are_planned_from_the_split_sizes() -> None:
    data = tiny_config().data
    plan = plan_days(data, None)  # type: ignore[arg-type]
    assert [(d.day, d.split, d.start, d.rows) for d in plan] == [
        (0, "train", 0, 4096),
        (1, "val", 0, 1024),
        (2, "test", 0, 1024),
    ]


def test_the_cli_generates_and_training_shows_the_oracle(tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config_dict()))
    out = tmp_path / "days"
    run = [sys.executable, "-m", "dlrm_vrgd.cli"]
    gen = subprocess.run(
        [*run, "generate", "--config", str(cfg), "--out", str(out), "--workers", "2",
         "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    assert "oracle AUC" in gen.stdout and "source: criteo" in gen.stdout
    again = subprocess.run(
        [*run, "generate", "--config", str(cfg), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 2 and "--overwrite" in again.stderr
    raw = tiny_config_dict()
    raw["data"] = {"source": "criteo", "path": str(out), "shuffle_block_rows": 512}
    cfg.write_text(yaml.safe_dump(raw))
    trained = subprocess.run(
        [*run, "-v", "train", "--config", str(cfg), "--out", str(tmp_path / "run"),
         "--export-model", str(tmp_path / "model")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    assert "oracle AUC" in trained.stdout  # every eval, as on live synthetic data
    assert "generated synthetic data; oracle AUC of its splits" in trained.stderr
    assert (tmp_path / "model" / "manifest.json").is_file()  # it exports like synthetic
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    # the whole test day is scored: the oracle of the run's test eval is the manifest's
    assert result["test"]["oracle_auc"] == pytest.approx(
        manifest["generated"]["oracle"]["test"]["auc"], abs=1e-6
    )
