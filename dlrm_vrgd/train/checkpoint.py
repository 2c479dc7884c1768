"""Atomic, verified checkpoints.

A checkpoint is a directory ``checkpoints/step_XXXXXXXX/`` holding one ``rank{r}.pt`` per rank
and a ``manifest.json`` (step, world size, config, and the size and SHA-256 of every file).
It is assembled under a temporary name and renamed into place only when complete, so a
checkpoint directory either exists whole or not at all; loading re-checks sizes and hashes, so
a file truncated or altered afterwards is reported (:class:`CheckpointError`), never loaded.
A resume takes the newest checkpoint that verifies (:func:`newest_verified`): a damaged one
(manifest of any shape, missing or altered file) is skipped with the reason.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dlrm_vrgd.train.rundir import CHECKPOINTS, atomic_write_bytes, atomic_write_json

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt."""


def _name(step: int) -> str:
    return f"step_{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def staging_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f".staging_{_name(step)}"


def write_rank_state(run_dir: Path, step: int, rank: int, state: dict[str, Any]) -> None:
    """Write one rank's state into the staging directory of ``step``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(staging_dir(run_dir, step) / f"rank{rank}.pt", buf.getvalue())


def publish(run_dir: Path, step: int, world_size: int, config: dict[str, Any], keep: int) -> Path:
    """Seal the staging directory of ``step`` (all ranks written) and rename it into place.

    Older checkpoints beyond the newest ``keep`` are removed afterwards.
    """
    stage = staging_dir(run_dir, step)
    files = {}
    for r in range(world_size):
        path = stage / f"rank{r}.pt"
        if not path.exists():
            raise CheckpointError(f"{path}: rank {r} did not write its state")
        files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    atomic_write_json(
        stage / MANIFEST,
        {"step": step, "world_size": world_size, "files": files, "config": config},
    )
    final = Path(run_dir) / CHECKPOINTS / _name(step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(stage, final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Published checkpoint directories, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step_") and p.is_dir())


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def read_manifest(ckpt: Path) -> dict[str, Any]:
    """The manifest of ``ckpt``, checked for shape (:class:`CheckpointError` if it is not one)."""
    path = Path(ckpt) / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (incomplete checkpoint)") from None
    except (OSError, ValueError) as err:  # unreadable, not UTF-8, not JSON
        raise CheckpointError(f"{path}: corrupt manifest: {err}") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"{path}: corrupt manifest: {problem}")
    return manifest


def _manifest_problem(m: Any) -> str | None:
    if not isinstance(m, dict):
        return f"a JSON {type(m).__name__}, not an object"
    for key, kind in (("step", int), ("world_size", int), ("files", dict), ("config", dict)):
        if not isinstance(m.get(key), kind) or isinstance(m.get(key), bool):
            return f"{key!r} missing or not {'an integer' if kind is int else 'an object'}"
    if m["world_size"] < 1 or m["step"] < 0:
        return "step or world_size out of range"
    for name, meta in m["files"].items():
        if (
            not isinstance(meta, dict)
            or not isinstance(meta.get("bytes"), int)
            or not isinstance(meta.get("sha256"), str)
            or "/" in name
        ):
            return f"files entry {name!r} is not {{bytes, sha256}}"
    return None


def verify(ckpt: Path) -> dict[str, Any]:
    """Check every file of ``ckpt`` against its manifest; the manifest, or CheckpointError."""
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    for r in range(manifest["world_size"]):
        if f"rank{r}.pt" not in manifest["files"]:
            raise CheckpointError(f"{ckpt / MANIFEST}: lists no state for rank {r}")
    for name, meta in manifest["files"].items():
        _check_file(ckpt / name, meta)
    return manifest


def newest_verified(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint of ``run_dir`` that verifies (None when there is no checkpoint),
    and the newer ones skipped with the reason; :class:`CheckpointError` when none verifies."""
    skipped: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify(path)
        except CheckpointError as err:
            skipped.append((path, str(err)))
            continue
        return path, skipped
    if skipped:
        reasons = "; ".join(reason for _, reason in skipped)
        raise CheckpointError(f"{run_dir}: no checkpoint verifies: {reasons}")
    return None, skipped


def _check_file(path: Path, meta: dict[str, Any]) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    size = path.stat().st_size
    if size != meta["bytes"]:
        raise CheckpointError(f"{path}: {size} bytes, manifest says {meta['bytes']} (truncated?)")
    if _sha256(path) != meta["sha256"]:
        raise CheckpointError(f"{path}: checksum mismatch (corrupt)")


def load_rank_state(ckpt: Path, rank: int, map_location: str | torch.device = "cpu") -> dict:
    """Verify and load one rank's state of checkpoint directory ``ckpt``."""
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    name = f"rank{rank}.pt"
    meta = manifest["files"].get(name)
    path = ckpt / name
    if meta is None:
        raise CheckpointError(
            f"{ckpt}: written by {manifest['world_size']} rank(s), has no state for rank {rank}"
        )
    _check_file(path, meta)
    return torch.load(path, map_location=map_location, weights_only=False)
