"""Checkpoints are data, never code: a pickle that would run code is refused by every command
that loads one (resume, export, reshard), whatever its manifest says; a failed save leaves no
half-written checkpoint; random damage to a real checkpoint never runs code, never raises
anything but CheckpointError, and never loads silently."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlrm_vrgd import checkpoint as ckpt
from dlrm_vrgd.checkpoint.reshard import gather_checkpoint
from dlrm_vrgd.train.run import Callback, train

from ..conftest import fill_disk, tiny_config, tiny_config_dict
from ..tamper import Payload, mutate_dir, sha256, states_equal


def plant_payload(ckpt_dir: Path, marker: Path, rank: int = 0) -> None:
    """Add a code-running object to rank ``rank``'s state and update the manifest's size and
    SHA-256 so that only the unpickling rule can stop it."""
    path = ckpt_dir / f"rank{rank}.pt"
    state = torch.load(path, weights_only=True)
    state["payload"] = Payload(marker)
    torch.save(state, path)
    manifest = json.loads((ckpt_dir / "manifest.json").read_text())
    manifest["files"][path.name] = {"bytes": path.stat().st_size, "sha256": sha256(path)}
    (ckpt_dir / "manifest.json").write_text(json.dumps(manifest))
    ckpt.verify(ckpt_dir)  # sizes and hashes agree: only the pickle check is left


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 1-rank run of 3 steps with its checkpoint, and its config.yaml beside it."""
    root = tmp_path_factory.mktemp("ckpt_security")
    raw = tiny_config_dict(run={"steps": 3, "checkpoint_every": 3, "micro_batch": 32})
    (root / "config.yaml").write_text(yaml.safe_dump(raw))
    train(tiny_config(**raw), root / "run")
    return root


def poisoned(base_run: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of the base run whose checkpoint carries the payload: (run, config, marker)."""
    run = tmp_path / "run"
    shutil.copytree(base_run / "run", run)
    marker = tmp_path / "PAYLOAD_RAN"
    latest = ckpt.latest_checkpoint(run)
    assert latest is not None
    plant_payload(latest, marker)
    return run, base_run / "config.yaml", marker


def test_the_payload_is_live(base_run: Path, tmp_path: Path) -> None:
    """The planted file really runs code under a plain unpickler (so the tests below mean
    something)."""
    run, _, marker = poisoned(base_run, tmp_path)
    latest = ckpt.latest_checkpoint(run)
    assert latest is not None
    torch.load(latest / "rank0.pt", weights_only=False)
    assert marker.exists()


def assert_refused(proc: subprocess.CompletedProcess[str], marker: Path) -> None:
    assert not marker.exists(), "the checkpoint's pickle ran code"
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "rank0.pt: not a tensors-only checkpoint" in proc.stderr, proc.stderr[-2000:]


def test_resume_refuses_a_code_running_pickle(base_run: Path, tmp_path: Path) -> None:
    run, config, marker = poisoned(base_run, tmp_path)
    proc = cli("train", "--config", str(config), "--out", str(run), "--resume",
               "--set", "run.steps=6")  # fmt: skip
    assert_refused(proc, marker)


def test_export_refuses_a_code_running_pickle(base_run: Path, tmp_path: Path) -> None:
    run, _, marker = poisoned(base_run, tmp_path)
    proc = cli("export", "--run", str(run), "--out", str(tmp_path / "model"))
    assert_refused(proc, marker)
    assert not (tmp_path / "model").exists()


def test_reshard_refuses_a_code_running_pickle(base_run: Path, tmp_path: Path) -> None:
    """Resuming the 1-rank checkpoint on 2 ranks gathers it (reshard) in each rank."""
    run, config, marker = poisoned(base_run, tmp_path)
    proc = cli("train", "--config", str(config), "--out", str(run), "--resume",
               "--set", "run.steps=6", "--set", "run.nproc_per_node=2")  # fmt: skip
    assert not marker.exists(), "the checkpoint's pickle ran code"
    assert proc.returncode != 0
    assert "rank0.pt: not a tensors-only checkpoint" in proc.stderr, proc.stderr[-3000:]


# ------------------------------------------------------------------------ failed saves
class FillDiskAt(Callback):
    def __init__(self, fs: Path, step: int) -> None:
        self.fs, self.step = fs, step

    def on_step(self, record: dict) -> None:
        if record["step"] == self.step:
            fill_disk(self.fs, 12 << 10)  # a few metrics lines fit, a 30 kB rank file does not


def test_a_full_disk_during_a_save_leaves_no_staging(small_fs: Path) -> None:
    cfg = tiny_config("run.steps=3", "run.checkpoint_every=3", "run.micro_batch=32")
    run = small_fs / "run"
    with pytest.raises(OSError) as err:
        train(cfg, run, callbacks=[FillDiskAt(small_fs, 2)])
    assert err.value.errno == errno.ENOSPC
    assert list((run / "checkpoints").glob(".staging*")) == []
    assert ckpt.list_checkpoints(run) == []
    (small_fs / "filler").unlink()
    result = train(cfg, run, resume=True)  # space again: the run completes
    assert result.steps == 3 and [p.name for p in ckpt.list_checkpoints(run)] == ["step_00000003"]


def test_resume_removes_a_stale_staging_dir(base_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(base_run / "run", run)
    stale = run / "checkpoints" / ".staging_step_00000005"
    stale.mkdir()
    (stale / "rank0.pt").write_bytes(b"half a checkpoint")
    train(tiny_config("run.steps=4", "run.checkpoint_every=3", "run.micro_batch=32"), run,
          resume=True)  # fmt: skip
    assert not stale.exists()
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_00000003", "step_00000004"]


# --------------------------------------------------------------------------------- fuzz
@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint (rank file and manifest) of a tiny run."""
    root = tmp_path_factory.mktemp("fuzz_ckpt")
    train(tiny_config("run.steps=2", "run.checkpoint_every=2", "run.micro_batch=32"), root)
    latest = ckpt.latest_checkpoint(root)
    assert latest is not None
    return latest


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_checkpoints_never_run_code_nor_load_silently(
    real_checkpoint: Path, data: st.DataObject
) -> None:
    original = gather_checkpoint(real_checkpoint).rank0
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "step_00000002"
        shutil.copytree(real_checkpoint, copy)
        marker = Path(tmp) / "PAYLOAD_RAN"
        _, changed = mutate_dir(copy, data, marker)
        try:
            loaded = gather_checkpoint(copy).rank0
        except ckpt.CheckpointError:
            loaded = None
        assert not marker.exists(), "a checkpoint's pickle ran code"
        if changed:
            assert loaded is None, "a changed checkpoint loaded"
        else:
            assert loaded is not None and states_equal(loaded, original)
