"""A checkpoint's layout: ``checkpoints/step_XXXXXXXX/`` holding one ``rank{r}.pt`` per rank
and a ``manifest.json``; ``checkpoints/best.json`` names the best-validation one."""

from __future__ import annotations

from pathlib import Path

from dlrm_vrgd.rundir.layout import CHECKPOINTS

MANIFEST = "manifest.json"
#: ``checkpoints/best.json``: ``{"step", "val_auc", "checkpoint"}`` of the best-validation
#: checkpoint, which pruning keeps beside the newest ones.
BEST = "best.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Published checkpoint directories, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step_") and p.is_dir())


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None
