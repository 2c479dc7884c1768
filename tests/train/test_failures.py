"""How runs fail and recover, through the real CLI: a non-finite loss stops the run at that
step (status failed, last good checkpoint kept, no result); a damaged newest checkpoint of any
shape falls back to the newest one that verifies (logged and recorded); a garbage line in
metrics.jsonl is named by file and line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dlrm_vrgd import checkpoint as ckpt
from dlrm_vrgd.rundir import read_jsonl

from ..conftest import tiny_config_dict


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", *args], capture_output=True, text=True, timeout=300
    )


def exploding(tmp_path: Path) -> Path:
    """SGD with lr 1e6 on both sides: finite for two steps, then the loss is NaN at step 3."""
    raw = tiny_config_dict(
        run={"steps": 6, "checkpoint_every": 2},
        optim={"dense": {"name": "sgd", "lr": 1e6}, "sparse": {"name": "sgd", "lr": 1e6}},
    )
    path = tmp_path / "exploding.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_nan_loss_fails_the_run_at_that_step_keeping_the_last_good_checkpoint(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    proc = cli("train", "--config", str(exploding(tmp_path)), "--out", str(out))
    assert proc.returncode == 1, proc.stderr
    assert "error: step 3: the loss is nan (not finite)" in proc.stderr
    assert "Traceback" not in proc.stderr
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 2
    assert status["error"].startswith("NonFiniteError: step 3: the loss is nan")
    assert not (out / "result.json").exists()
    [kept] = ckpt.list_checkpoints(out)
    assert kept.name == "step_00000002"
    manifest = ckpt.verify(kept)
    assert manifest["step"] == 2
    trained = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert trained == [1, 2]  # nothing logged for the bad step


def finished_run(tmp_path: Path) -> tuple[Path, Path]:
    """A 4-step run with checkpoints at steps 2 and 4."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict(run={"steps": 4, "checkpoint_every": 2})))
    out = tmp_path / "run"
    proc = cli("train", "--config", str(config), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000002", "step_00000004"]
    return config, out


MANIFESTS = [b"{}", b"[]", b'"text"', b"17", b"\xff\xfe garbage", b'{"step": 4}',
             b'{"step": 4, "world_size": 1, "files": [], "config": {}}',
             b'{"step": 4, "world_size": true, "files": {}, "config": {}}',
             b'{"step": 4, "world_size": 1, "files": {"rank0.pt": 3}, "config": {}}']  # fmt: skip


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_a_manifest_of_any_shape_is_a_checkpoint_error(tmp_path: Path, manifest: bytes) -> None:
    d = tmp_path / "checkpoints" / "step_00000004"
    d.mkdir(parents=True)
    (d / "manifest.json").write_bytes(manifest)
    with pytest.raises(ckpt.CheckpointError, match="corrupt manifest"):
        ckpt.read_manifest(d)
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint verifies"):
        ckpt.newest_verified(tmp_path)


@pytest.mark.parametrize("damage", ["{}", "rank file truncated"])
def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(
    tmp_path: Path, damage: str
) -> None:
    config, out = finished_run(tmp_path)
    newest = out / "checkpoints" / "step_00000004"
    if damage == "rank file truncated":
        (newest / "rank0.pt").write_bytes((newest / "rank0.pt").read_bytes()[:100])
    else:
        (newest / "manifest.json").write_text(damage)
    proc = cli(
        "train", "--config", str(config), "--out", str(out), "--resume", "--set", "run.steps=6",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "skipping damaged checkpoint step_00000004" in proc.stderr
    assert "trained 6 steps" in proc.stdout
    records = read_jsonl(out / "metrics.jsonl")
    [fallback] = [r for r in records if r["kind"] == "checkpoint_fallback"]
    assert fallback["resumed_from"] == "step_00000002" and fallback["step"] == 2
    assert [s["checkpoint"] for s in fallback["skipped"]] == ["step_00000004"]
    trained = [r["step"] for r in records if r["kind"] == "train"]
    assert trained == [1, 2, 3, 4, 5, 6]  # steps 3-4 of the first run dropped, then retrained
    assert ckpt.verify(out / "checkpoints" / "step_00000006")["step"] == 6


def test_a_garbage_metrics_line_is_named_and_resume_refuses_only_when_none_verifies(
    tmp_path: Path,
) -> None:
    config, out = finished_run(tmp_path)
    metrics = out / "metrics.jsonl"
    before = metrics.read_bytes()
    lines = before.split(b"\n")
    lines.insert(2, b"{not json")
    metrics.write_bytes(b"\n".join(lines))
    # more steps than the run made, so that the resume really reads its records (resuming a
    # finished run is a no-op that reads nothing)
    proc = cli(
        "train", "--config", str(config), "--out", str(out), "--resume", "--set", "run.steps=6",
    )  # fmt: skip
    assert proc.returncode == 2
    assert f"error: {metrics}:3: not a JSON record" in proc.stderr
    assert "Traceback" not in proc.stderr

    metrics.write_bytes(before)
    for step in (2, 4):
        (out / "checkpoints" / f"step_{step:08d}" / "manifest.json").write_text("[]")
    proc = cli("train", "--config", str(config), "--out", str(out), "--resume")
    assert proc.returncode == 1
    assert "error: " in proc.stderr and "no checkpoint verifies" in proc.stderr
    assert "step_00000004/manifest.json: corrupt manifest: a JSON list" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert metrics.read_bytes() == before  # refused before anything was written
