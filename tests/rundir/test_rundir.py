from __future__ import annotations

import json
import math
from pathlib import Path

from dlrm_vrgd.rundir import (
    JsonlWriter,
    atomic_write_json,
    read_jsonl,
    truncate_jsonl_after,
)


def test_jsonl_reader_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    w = JsonlWriter(path)
    w.write({"step": 1, "loss": 0.5})
    w.write({"step": 2, "loss": math.nan})
    w.close()
    with path.open("a") as f:
        f.write('{"step": 3, "lo')  # a writer caught mid-line
    records = read_jsonl(path)
    assert records == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": None}]


def test_truncate_after_step(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    w = JsonlWriter(path)
    for s in range(1, 6):
        w.write({"step": s})
    w.close()
    truncate_jsonl_after(path, 3)
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]


def test_atomic_json_leaves_no_temporary_files(tmp_path: Path) -> None:
    atomic_write_json(tmp_path / "r.json", {"auc": 0.8, "bad": float("inf")})
    assert json.loads((tmp_path / "r.json").read_text()) == {"auc": 0.8, "bad": None}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
