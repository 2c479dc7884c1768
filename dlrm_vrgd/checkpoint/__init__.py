"""Atomic, verified checkpoints: the format that training writes and resume, export and the
service's retries read.

A checkpoint is a directory ``checkpoints/step_XXXXXXXX/`` holding one ``rank{r}.pt`` per rank
and a ``manifest.json`` (step, world size, config, and the size and SHA-256 of every file).
It is assembled under a temporary name and renamed into place only when complete, so a
checkpoint directory either exists whole or not at all; loading re-checks sizes and hashes, so
a file truncated or altered afterwards is reported (:class:`CheckpointError`), never loaded.
A resume takes the newest checkpoint that verifies (:func:`newest_verified`): a damaged one
(manifest of any shape, missing or altered file) is skipped with the reason.

- :mod:`~dlrm_vrgd.checkpoint.layout`: names, :class:`CheckpointError`, listing;
- :mod:`~dlrm_vrgd.checkpoint.save`: staging, sealing (the manifest), pruning;
- :mod:`~dlrm_vrgd.checkpoint.load`: finding, verifying, loading one rank's state;
- :mod:`~dlrm_vrgd.checkpoint.reshard`: a checkpoint of any number of ranks as whole tables,
  and back into any rank's shards.

This package imports only :mod:`dlrm_vrgd.rundir` and :mod:`dlrm_vrgd.embedding.capture`'s
row-space layout (tests/test_layering.py); the names below are its interface.
"""

from __future__ import annotations

from dlrm_vrgd.checkpoint.layout import (
    BEST,
    MANIFEST,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    step_name,
)
from dlrm_vrgd.checkpoint.load import (
    best_checkpoint,
    load_rank_state,
    newest_verified,
    read_manifest,
    verify,
)
from dlrm_vrgd.checkpoint.save import (
    publish,
    remove_stale_staging,
    staging_dir,
    write_rank_state,
)

__all__ = [
    "BEST",
    "MANIFEST",
    "CheckpointError",
    "best_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_rank_state",
    "newest_verified",
    "publish",
    "read_manifest",
    "remove_stale_staging",
    "staging_dir",
    "step_name",
    "verify",
    "write_rank_state",
]
