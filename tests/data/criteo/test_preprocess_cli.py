"""``dlrm-vrgd preprocess`` and training on its output, as a user runs them (real processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from dlrm_vrgd.data.criteo.format import format_criteo_text
from dlrm_vrgd.rundir import read_jsonl

from ...conftest import tiny_config_dict
from .test_criteo import ROW, expected, line, make_rows


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_preprocess_then_train_two_steps(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    days = [make_rows(300, seed) for seed in (21, 22, 23)]
    for i, rows in enumerate(days):
        (raw / f"day_{i}.tsv").write_bytes(format_criteo_text(*rows))
    out = tmp_path / "criteo"
    proc = cli(
        "preprocess", "--input", str(raw), "--out", str(out), "--max-rows-per-table", "50",
        "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "preprocessed 900 rows from 3 input(s) into 3 day(s)" in proc.stdout
    assert "day 2: 300 rows" in proc.stdout
    np.testing.assert_array_equal(
        np.load(out / "day_1_sparse.npy"), expected(*days[1], cap=50)["sparse"]
    )

    cfg = tiny_config_dict(run={"steps": 2})
    cfg["data"] = {"source": "criteo", "path": str(out), "shuffle_block_rows": 128}
    (tmp_path / "criteo.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    proc = cli("train", "--config", str(tmp_path / "criteo.yaml"), "--out", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert "trained 2 steps, 512 rows" in proc.stdout
    assert "test AUC" in proc.stdout and "oracle" not in proc.stdout  # real data: no oracle
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in train)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["config"]["data"]["source"] == "criteo"
    assert 0.0 <= result["test"]["auc"] <= 1.0


def test_malformed_input_exits_2_naming_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "day_0"
    path.write_text("\n".join([line(ROW), line(ROW[:3] + ["x"] + ROW[4:])]) + "\n")
    out = tmp_path / "out"
    proc = cli("preprocess", "--input", str(path), "--out", str(out), "--no-progress")
    assert proc.returncode == 2
    assert f"error: {path}:2: I3: not an integer" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day_0"]

    proc = cli("preprocess", "--input", str(path), "--out", str(out), "--skip-bad-rows")
    assert proc.returncode == 0, proc.stderr
    assert "skipped 1 malformed rows; first" in proc.stdout
    assert "preprocess" in proc.stderr  # the progress bar
    assert np.load(out / "day_0_labels.npy").shape == (1, 1)


def test_bad_options_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "day_0"
    path.write_text(line(ROW) + "\n")
    proc = cli(
        "preprocess", "--input", str(path), "--out", str(tmp_path / "o"), "--frequency-threshold",
        "3",
    )  # fmt: skip
    assert proc.returncode == 2 and "needs --max-rows-per-table" in proc.stderr
    proc = cli("preprocess", "--input", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "input not found" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day_0"]


def test_split_cuts_one_input_into_train_val_test_days(tmp_path: Path) -> None:
    """``--split 0.8,0.1,0.1`` on one 1,000-row file (a header and blank lines that do not count):
    days of 800, 100 and 100 rows in file order, and configs/criteo_small.yaml trains on them
    reading them as its splits."""
    labels, ints, cats = make_rows(1000, 31)
    text = format_criteo_text(labels, ints, cats, ",", header=True).decode()
    head, *rows = text.splitlines()
    (tmp_path / "sample.csv").write_text("\n".join([head, *rows[:500], "", *rows[500:]]) + "\n")
    out = tmp_path / "criteo"
    proc = cli(
        "preprocess", "--input", str(tmp_path / "sample.csv"), "--out", str(out),
        "--max-rows-per-table", "50", "--split", "0.8,0.1,0.1", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "split 0.8/0.1/0.1: train day 0, val day 1, test day 2" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert [d["rows"] for d in manifest["days"]] == [800, 100, 100]
    assert manifest["splits"]["val_days"] == [1]
    want = expected(labels, ints, cats, cap=50)["sparse"]
    for day, (a, b) in enumerate([(0, 800), (800, 900), (900, 1000)]):
        np.testing.assert_array_equal(np.load(out / f"day_{day}_sparse.npy"), want[a:b])

    # the shipped small real-Criteo config, on this directory
    config = Path(__file__).resolve().parents[3] / "configs" / "criteo_small.yaml"
    run_dir = tmp_path / "run"
    proc = cli("train", "--config", str(config), "--out", str(run_dir), "--set",
               f"data.path={out}", "--set", "run.epochs=1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "trained 4 steps, 1,024 rows" in proc.stdout  # 800 train rows, 256 a step: 4 steps
    test = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("split") == "test"]
    assert test and test[-1]["rows"] == 100  # the whole test day, not half of the last day


def test_split_needs_three_fractions_and_one_input(tmp_path: Path) -> None:
    path = tmp_path / "day_0"
    path.write_text("\n".join([line(ROW)] * 20) + "\n")
    for split, message in (
        ("0.8,0.1", "three positive fractions"),
        ("0.8,0.3,0.1", "summing to 1"),
        ("a,b,c", "not three fractions"),
    ):
        proc = cli("preprocess", "--input", str(path), "--out", str(tmp_path / "o"),
                   "--split", split)  # fmt: skip
        assert proc.returncode == 2 and message in proc.stderr, (split, proc.stderr)
    (tmp_path / "day_1").write_text(path.read_text())
    proc = cli("preprocess", "--input", str(path), str(tmp_path / "day_1"), "--out",
               str(tmp_path / "o"), "--split", "0.8,0.1,0.1")  # fmt: skip
    assert proc.returncode == 2 and "cuts one input" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day_0", "day_1"]
