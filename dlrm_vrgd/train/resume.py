"""Resuming a run: the checkpoint it continues from, what its config may change, and loading
that checkpoint into a :class:`~dlrm_vrgd.train.loop.Trainer` (resharded when it was written by
another number of ranks or another sharding: :mod:`dlrm_vrgd.checkpoint.reshard`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dlrm_vrgd import checkpoint as ckpt
from dlrm_vrgd import rundir
from dlrm_vrgd.config import OPERATIONAL, RunConfig, TrainConfig, marked_fields, strip_marked
from dlrm_vrgd.train.loop import Trainer

logger = logging.getLogger(__name__)

#: Config keys a resumed run may change (how long and how often, not what is trained), with
#: every field marked OPERATIONAL in dlrm_vrgd/config.py; a key covers the keys below it.
RESUMABLE_CHANGES = {
    "run.gsnr_every",
    "run.noise_scale_beta",
    "run.steps",
    "run.epochs",
    "run.eval_every",
    "run.evals_per_epoch",
    "run.target_auc",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.log_every",
    "run.eval_rows",
    "run.threads",
    "run.malloc_mmap_threshold_kb",
    "run.precision",
} | {f"run.{name}" for name in marked_fields(RunConfig, OPERATIONAL)}

#: What may change when a run resumes on another number of ranks (its tables are resharded).
RESHARD_CHANGES = {
    "run.nproc_per_node",
    "run.nnodes",
    "run.rdzv_endpoint",
    "run.rdzv_id",
    "run.sharding",
    "run.collective_timeout_s",
}


def _covered(key: str, allowed: set[str]) -> bool:
    """Whether the dotted ``key`` or a key above it is in ``allowed``."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in allowed for i in range(1, len(parts) + 1))


def config_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts."""
    keys = set(old) | set(new)
    out = []
    for k in sorted(keys):
        path = f"{prefix}{k}"
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, path + ".")
        elif a != b:
            out.append(path)
    return out


def check_resume(
    out: Path, cfg: TrainConfig, resume: bool, skipped: list[tuple[Path, str]] | None = None
) -> Path | None:
    """The checkpoint to resume from (None: start afresh), or a clear error before any work.

    That is the newest checkpoint that verifies; newer, damaged ones are logged and appended to
    ``skipped`` (path, reason)."""
    if not resume:
        if (out / rundir.CONFIG).exists():
            raise FileExistsError(f"{out} already holds a run: pass --resume or another --out")
        return None
    latest, damaged = ckpt.newest_verified(out)
    for path, reason in damaged:
        logger.warning("skipping damaged checkpoint %s: %s", path.name, reason)
    if skipped is not None:
        skipped += damaged
    if latest is None:
        return None
    manifest = ckpt.read_manifest(latest)
    changed = [
        k
        for k in config_changes(strip_marked(manifest["config"]), strip_marked(cfg.to_dict()))
        if not _covered(k, RESUMABLE_CHANGES | RESHARD_CHANGES)
    ]
    if changed:
        raise ValueError(f"cannot resume {out}: config differs in {', '.join(changed)}")
    if needs_reshard(manifest, cfg):
        logger.info(
            "resuming %s (written by %d rank(s)) on %d: its tables are resharded",
            latest,
            manifest["world_size"],
            cfg.run.world_size,
        )
    return latest


def finished_run(out: Path, total_steps: int) -> dict[str, Any] | None:
    """The result.json of a run in ``out`` that already trained all ``total_steps`` or was
    stopped early or at its target AUC, else None (no result, an unreadable one, or fewer
    steps: e.g. ``run.steps`` was raised)."""
    try:
        result = json.loads((out / rundir.RESULT).read_text())
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(result, dict) or not isinstance(result.get("steps"), int):
        return None
    target = result.get("target")
    done = (
        result["steps"] >= total_steps
        or isinstance(result.get("stopped_early"), dict)
        or (isinstance(target, dict) and target.get("reached") is True)
    )
    return result if done else None


def resume_hint(out: Path) -> str:
    latest = ckpt.latest_checkpoint(out)
    if latest is None:
        return "no checkpoint was written yet: --resume starts it again from step 0"
    return f"--resume continues from {latest.name}"


def needs_reshard(manifest: dict[str, Any], cfg: TrainConfig) -> bool:
    """Whether a checkpoint's shards differ from what ``cfg`` runs on (ranks or sharding)."""
    saved = manifest["config"]["run"]
    return int(manifest["world_size"]) != cfg.run.world_size or (
        cfg.run.world_size > 1 and saved.get("sharding") != list(cfg.run.sharding)
    )


def load_checkpoint(trainer: Trainer, latest: Path) -> None:
    """Load checkpoint ``latest`` into ``trainer``, resharding it when it was written by
    another number of ranks or sharding (:mod:`dlrm_vrgd.checkpoint.reshard`)."""
    if not needs_reshard(ckpt.read_manifest(latest), trainer.cfg):
        trainer.load_state_dict(ckpt.load_rank_state(latest, trainer.env.rank))
        return
    from dlrm_vrgd.checkpoint.reshard import gather_checkpoint, rank_state

    full = gather_checkpoint(latest)
    with_ema = bool(trainer.sparse_opt.gsnr and trainer.sparse_opt.estimator == "ema")
    trainer.load_state_dict(rank_state(full, trainer.lookups, with_ema, trainer.env.rank))
