"""The input pipeline between the row sources and the trainer (``run.input``; docs/input.md).

Micro-batches are keyed by ``(step, group)`` and built ahead of the step by a background
builder: threads (:mod:`.threads`) or forked worker processes (:mod:`.processes`) writing into
reused host buffers (:mod:`.slots`), pinned on a CUDA run and copied to the GPU on a side
stream one micro-batch ahead (:mod:`.device`). :class:`InputPipeline` (:mod:`.core`) keeps the
look-ahead and says how long each ``get`` waited. The rows of a key never depend on any of it
(:class:`~dlrm_vrgd.data.batch.TrainStream`), so order, resume and resharding are unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from dlrm_vrgd.config import TrainConfig
from dlrm_vrgd.data.batch import TrainStream
from dlrm_vrgd.data.multihot import bags_of
from dlrm_vrgd.data.pipeline.core import InputPipeline
from dlrm_vrgd.data.pipeline.plan import (
    InputPlan,
    Key,
    block_affinity,
    cores_per_rank,
    rank_keys,
    resolve_plan,
)
from dlrm_vrgd.data.pipeline.slots import Layout
from dlrm_vrgd.data.pipeline.threads import InputWorkerError

__all__ = [
    "InputPipeline",
    "InputPlan",
    "InputWorkerError",
    "Key",
    "Layout",
    "rank_keys",
    "resolve_plan",
    "trainer_pipeline",
]

logger = logging.getLogger(__name__)


def trainer_pipeline(
    stream: TrainStream,
    cfg: TrainConfig,
    device: torch.device,
    rank: int,
    accumulation: int,
    total_steps: int,
) -> InputPipeline:
    """The pipeline of one rank of a run: its ``run.input`` resolved for the data source and
    the device, its keys ``(s, rank·A + j)`` up to ``total_steps``."""
    run = cfg.run
    source = stream.source
    plan = resolve_plan(run.input, cfg.data.source, device.type, cores_per_rank(run.nproc_per_node))
    if plan.builder != run.input.builder and run.input.builder == "processes":
        logger.warning("input: worker processes need fork (Linux); using threads")
    if plan.builder != "serial":
        source.read(0, 1)  # lazy state (the synthetic teacher, memory maps) made once, here
    logger.info("input: %s (%s data on %s)", plan.describe(), cfg.data.source, device)
    layout = Layout(run.micro_batch, source.num_dense, len(source.cardinalities), bags_of(source))

    def schedule(key: Key) -> Iterator[Key]:
        return rank_keys(key, rank, accumulation, total_steps)

    return InputPipeline(
        stream.rows,
        layout,
        device,
        plan,
        schedule=schedule,
        affinity=block_affinity(run.global_batch, run.micro_batch, source.block_rows),
    )
