"""Checkpoints are data, never code: a pickle that would run code is refused by every command
that loads one (resume, export, reshard), whatever its manifest says; a failed save leaves no
half-written checkpoint; random damage to a real checkpoint never runs code, never raises
anything but CheckpointError, and never loads silently."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlrm_vrgd.train import checkpoint as ckpt
from dlrm_vrgd.train.loop import Callback, train
from dlrm_vrgd.train.reshard import gather_checkpoint

from ..conftest import tiny_config, tiny_config_dict


class Payload:
    """Unpickling this runs ``touch MARKER`` (what an attacker's pickle would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
def fill(fs: Path, leave: int) -> None:
    """Fill the filesystem of ``fs`` so that about ``leave`` bytes stay free."""
    slack = fs / "slack"
    slack.write_bytes(b"\0" * leave)
    with (fs / "filler").open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC
    slack.unlink()


class FillDiskAt(Callback):
    def __init__(self, fs: Path, step: int) -> None:
        self.fs, self.step = fs, step

    def on_step(self, record: dict) -> None:
        if record["step"] == self.step:
            fill(self.fs, 12 << 10)  # a few metrics lines fit, a 30 kB rank file does not


@pytest.fixture
def small_fs(tmp_path: Path) -> Any:
    """A 4 MiB tmpfs (root only; skipped elsewhere)."""
    fs = tmp_path / "fs"
    fs.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(fs)],
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
    try:
        yield fs
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


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
def states_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(states_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def json_edits() -> st.SearchStrategy[tuple[str, Any]]:
    junk = st.one_of(st.none(), st.booleans(), st.integers(-2, 1 << 70), st.text(max_size=8),
                     st.lists(st.integers(), max_size=3), st.just({"bytes": 1}))  # fmt: skip
    return st.tuples(
        st.sampled_from(["drop", "add", "set", "whole", "file_entry", "file_name"]), junk
    )


def mutate_json(path: Path, edit: tuple[str, Any], data: st.DataObject) -> None:
    kind, junk = edit
    m = json.loads(path.read_text())
    keys = sorted(m)
    if kind == "drop":
        del m[data.draw(st.sampled_from(keys))]
    elif kind == "add":
        m[data.draw(st.text(min_size=1, max_size=6).filter(lambda k: k not in m))] = junk
    elif kind == "set":
        m[data.draw(st.sampled_from(keys))] = junk
    elif kind == "whole":
        m = junk
    elif kind == "file_entry":
        name = data.draw(st.sampled_from(sorted(m["files"])))
        field = data.draw(st.sampled_from(["bytes", "sha256", None]))
        if field is None:
            m["files"][name] = junk
        else:
            m["files"][name][field] = junk
    else:  # a listed name that points elsewhere
        name = data.draw(st.sampled_from(["../rank0.pt", "sub/rank0.pt", "rank1.pt", ""]))
        m["files"][name] = next(iter(m["files"].values()))
    path.write_text(json.dumps(m))


def mutate_bytes(path: Path, kind: str, data: st.DataObject) -> None:
    raw = path.read_bytes()
    if kind == "flip":
        at = data.draw(st.integers(0, len(raw) - 1))
        xor = data.draw(st.integers(1, 255))
        path.write_bytes(raw[:at] + bytes([raw[at] ^ xor]) + raw[at + 1 :])
    elif kind == "truncate":
        path.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1))])
    else:
        path.write_bytes(raw + data.draw(st.binary(min_size=1, max_size=64)))


def same_json(a: bytes, b: bytes) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


MUTATIONS = ["flip", "truncate", "append", "json", "remove", "add_file", "symlink", "dir",
             "payload"]  # fmt: skip


def mutate_dir(target: Path, data: st.DataObject, marker: Path) -> bool:
    """Apply one random mutation to the directory ``target`` (a checkpoint or a model);
    whether it changed anything."""
    names = sorted(os.listdir(target))
    kind = data.draw(st.sampled_from(MUTATIONS), label="mutation")
    name = data.draw(st.sampled_from(names), label="file")
    path = target / name
    raw = path.read_bytes()
    if name == "manifest.json" and kind in ("flip", "truncate", "append"):
        mutate_bytes(path, kind, data)
        return not same_json(raw, path.read_bytes())
    if kind in ("flip", "truncate", "append"):
        mutate_bytes(path, kind, data)
    elif kind == "json":
        manifest = target / "manifest.json"
        before = manifest.read_bytes()
        mutate_json(manifest, data.draw(json_edits()), data)
        return json.loads(manifest.read_bytes()) != json.loads(before)
    elif kind == "remove":
        path.unlink()
    elif kind == "add_file":
        (target / data.draw(st.sampled_from(["extra.pt", ".hidden", "rank9.pt"]))).write_bytes(b"x")
    elif kind == "symlink":  # the same bytes, through a link out of the directory
        outside = target.parent / f"outside-{name}"
        outside.write_bytes(raw)
        path.unlink()
        path.symlink_to(outside)
    elif kind == "dir":
        path.unlink()
        path.mkdir()
    else:  # a code-running pickle with a manifest that agrees with it
        victim = data.draw(st.sampled_from([n for n in names if n.endswith(".pt")]))
        state = torch.load(target / victim, weights_only=True)
        evil = {"state": state, "payload": Payload(marker)} if isinstance(state, dict) else state
        torch.save(evil, target / victim)
        manifest = json.loads((target / "manifest.json").read_text())
        manifest["files"][victim] = {"bytes": (target / victim).stat().st_size,
                                     "sha256": sha256(target / victim)}  # fmt: skip
        (target / "manifest.json").write_text(json.dumps(manifest))
    return True


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
        changed = mutate_dir(copy, data, marker)
        try:
            loaded = gather_checkpoint(copy).rank0
        except ckpt.CheckpointError:
            loaded = None
        assert not marker.exists(), "a checkpoint's pickle ran code"
        if changed:
            assert loaded is None, "a changed checkpoint loaded"
        else:
            assert loaded is not None and states_equal(loaded, original)
