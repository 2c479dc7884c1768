"""What the input pipeline runs: the builder, its workers and its depth (``run.input``
resolved for a data source and a device), and the order of the keys it builds ahead.

A micro-batch is named by its key ``(step, group)`` (:class:`~dlrm_vrgd.data.batch.TrainStream`:
its rows are a pure function of the key), so building ahead changes when rows are read, never
which: the order, a resumed run and a resharded one read exactly what the serial path reads.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dlrm_vrgd.config import InputConfig

#: A micro-batch's name: ``(global step, group)``; group ``g = rank·A + j``.
Key = tuple[int, int]

BUILDERS = ("serial", "threads", "processes")
#: Most worker processes ``auto`` starts per rank.
MAX_AUTO_PROCESSES = 16


@dataclass(frozen=True)
class InputPlan:
    """A resolved ``run.input``: ``builder`` one of :data:`BUILDERS`, ``workers`` threads or
    processes (1 for ``serial``), ``depth`` micro-batches built ahead (0 for ``serial``)."""

    builder: str
    workers: int
    depth: int

    def describe(self) -> str:
        if self.builder == "serial":
            return "serial (built by the step, nothing ahead)"
        kind = "thread" if self.builder == "threads" else "process"
        many = "" if self.workers == 1 else "es" if kind == "process" else "s"
        return f"{self.workers} {kind}{many}, {self.depth} micro-batches ahead"


def cores_per_rank(nproc_per_node: int) -> int:
    """The cores this process may use: its affinity mask (or the CPU count) over the ranks of
    the node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, nproc_per_node))


def can_fork() -> bool:
    """Worker processes are forked (they inherit the open sources: memory maps, the synthetic
    teacher); only where ``fork`` exists and is the platform's own (Linux)."""
    return sys.platform.startswith("linux")


def resolve_plan(cfg: InputConfig, source: str, device: str, cores: int) -> InputPlan:
    """``run.input`` for a data source (``synthetic`` or ``criteo``) on ``device`` (``cpu`` or
    ``cuda``) with ``cores`` cores per rank (see :class:`~dlrm_vrgd.config.InputConfig`)."""
    builder = cfg.builder
    if builder == "auto":
        builder = "processes" if source == "synthetic" and device == "cuda" else "threads"
    if builder == "processes" and not can_fork():
        builder = "threads"  # said once by the pipeline's log line
    if builder == "serial":
        return InputPlan("serial", 1, 0)
    if cfg.workers is not None:
        workers = cfg.workers
    elif builder == "processes":
        workers = max(1, min(MAX_AUTO_PROCESSES, cores - 2))
    else:
        workers = 1
    depth = cfg.depth if cfg.depth is not None else max(2, 2 * workers)
    return InputPlan(builder, workers, depth)


def rank_keys(start: Key, rank: int, accumulation: int, total_steps: int) -> Iterator[Key]:
    """The keys one rank asks for from ``start`` on, in the order its steps use them: ``start``
    first (whatever it is), then ``(s, rank·A + j)`` for ``j < A``, steps below
    ``total_steps``."""
    step, group = start
    yield start
    j = group - rank * accumulation + 1
    while step < total_steps:
        if not 0 <= j < accumulation:
            step, j = step + 1, 0
            continue
        yield step, rank * accumulation + j
        j += 1


def block_affinity(global_batch: int, micro_batch: int, block_rows: int) -> Callable[[Key], int]:
    """Which worker should build a key: the index of the stretch of ``max(B, block_rows)``
    stream positions its first row falls in. Keys of one source block (a synthetic chunk, B
    below ``block_rows``) then go to the worker that already holds the block; larger
    micro-batches take turns. A key starts wherever the stream is, so it usually straddles
    one more block than it covers, which its neighbour (another worker) reads too: for the
    synthetic source that block is generated twice (+1/8 of the work at B = 8 chunks, twice
    the work at B = one chunk; bench/input.py)."""
    span = max(micro_batch, block_rows)

    def affinity(key: Key) -> int:
        step, group = key
        return (step * global_batch + group * micro_batch) // span

    return affinity
