"""Writing a checkpoint: every rank writes its state into a staging directory, rank 0 seals
it with a manifest (size and SHA-256 of each file) and renames it into place, then prunes."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dlrm_vrgd.checkpoint.layout import BEST, MANIFEST, CheckpointError, list_checkpoints, step_name
from dlrm_vrgd.rundir.files import atomic_write_bytes, atomic_write_json
from dlrm_vrgd.rundir.layout import CHECKPOINTS


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def staging_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f".staging_{step_name(step)}"


def write_rank_state(run_dir: Path, step: int, rank: int, state: dict[str, Any]) -> None:
    """Write one rank's state into the staging directory of ``step``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    try:
        atomic_write_bytes(staging_dir(run_dir, step) / f"rank{rank}.pt", buf.getvalue())
    except OSError:  # a full disk: no half-written checkpoint stays behind
        shutil.rmtree(staging_dir(run_dir, step), ignore_errors=True)
        raise


def remove_stale_staging(run_dir: Path) -> list[Path]:
    """Remove the ``.staging_step_*`` directories an interrupted or failed save left (a run
    starting or resuming calls this before it trains); the paths removed."""
    root = Path(run_dir) / CHECKPOINTS
    stale = sorted(root.glob(".staging_step_*")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


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
    try:
        atomic_write_json(
            stage / MANIFEST,
            {"step": step, "world_size": world_size, "files": files, "config": config},
        )
    except OSError:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    final = Path(run_dir) / CHECKPOINTS / step_name(step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(stage, final)
    kept = None
    if best is not None and (final.parent / step_name(int(best["step"]))).is_dir():
        kept = step_name(int(best["step"]))
        atomic_write_json(
            final.parent / BEST,
            {"step": int(best["step"]), "val_auc": best["auc"], "checkpoint": kept},
        )
    prunable = [p for p in list_checkpoints(run_dir) if p.name != kept]
    for old in prunable[: max(len(prunable) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)
    return final
