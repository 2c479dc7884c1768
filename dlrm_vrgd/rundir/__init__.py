"""The run directory (DESIGN.md 5): the contract that training writes and data, tracking,
serving, studies and the service read.

- :mod:`~dlrm_vrgd.rundir.layout`: what a run writes, by name (``config.json``,
  ``metrics.jsonl``, ``gsnr.jsonl``, ``checkpoints/``, ``result.json``, ``status.json``);
- :mod:`~dlrm_vrgd.rundir.files`: atomic whole-file writes and append-only JSON lines;
- :mod:`~dlrm_vrgd.rundir.sink`: the run directory as a :class:`dlrm_vrgd.tracking.Sink`.

This package imports nothing else of ``dlrm_vrgd`` (tests/test_layering.py); the names below
are its interface.
"""

from __future__ import annotations

from dlrm_vrgd.rundir.files import (
    JsonlWriter,
    atomic_write_bytes,
    atomic_write_json,
    drop_evals_at,
    dumps,
    read_jsonl,
    truncate_jsonl_after,
)
from dlrm_vrgd.rundir.layout import CHECKPOINTS, CONFIG, GSNR, METRICS, RESULT, STATUS
from dlrm_vrgd.rundir.sink import RunDirSink

__all__ = [
    "CHECKPOINTS",
    "CONFIG",
    "GSNR",
    "METRICS",
    "RESULT",
    "STATUS",
    "JsonlWriter",
    "RunDirSink",
    "atomic_write_bytes",
    "atomic_write_json",
    "drop_evals_at",
    "dumps",
    "read_jsonl",
    "truncate_jsonl_after",
]
