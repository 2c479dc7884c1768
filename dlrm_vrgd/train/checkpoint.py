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
#: ``checkpoints/best.json``: ``{"step", "val_auc", "checkpoint"}`` of the best-validation
#: checkpoint, which pruning keeps beside the newest ones.
BEST = "best.json"


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


def publish(
    run_dir: Path,
    step: int,
    world_size: int,
    config: dict[str, Any],
    keep: int,
    best: dict[str, Any] | None = None,
) -> Path:
    """Seal the staging directory of ``step`` (all ranks written) and rename it into place.

    Older checkpoints beyond the newest ``keep`` are removed afterwards, except the one of
    ``best`` (``{"step", "auc"}``: the best validation so far) when it was checkpointed; that
    one is named in ``checkpoints/best.json``.
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
    kept = None
    if best is not None and (final.parent / _name(int(best["step"]))).is_dir():
        kept = _name(int(best["step"]))
        atomic_write_json(
            final.parent / BEST,
            {"step": int(best["step"]), "val_auc": best["auc"], "checkpoint": kept},
        )
    prunable = [p for p in list_checkpoints(run_dir) if p.name != kept]
    for old in prunable[: max(len(prunable) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def best_checkpoint(run_dir: Path) -> Path:
    """The best-validation checkpoint named by ``checkpoints/best.json`` (verified by the
    caller's load); :class:`CheckpointError` when the run kept none."""
    path = Path(run_dir) / CHECKPOINTS / BEST
    try:
        record = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: missing (the run kept no best checkpoint: it needs run.eval_every and "
            "run.checkpoint_every or checkpoint_every_s, with run.keep_best_checkpoint)"
        ) from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__})") from None
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path}: 'step' must be a non-negative integer")
    ckpt = path.parent / _name(step)
    if not ckpt.is_dir() or ckpt.is_symlink():
        raise CheckpointError(f"{path}: names step {step}, whose checkpoint is gone")
    return ckpt


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
