"""Evaluation over one or several ranks.

Every rank scores an equal share of the split — ``⌈N / W⌉`` rows in equal batches, the last
share padded with rows from the start of the split and masked out — because a sharded model's
forward is a collective that every rank must run with the same batch size. The predictions are
then gathered, and every rank computes the same metrics (model and oracle) on the ``N`` rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dlrm_vrgd.data.batch import Batch
from dlrm_vrgd.data.rows import Rows, RowSource
from dlrm_vrgd.metrics import EvalAccumulator
from dlrm_vrgd.train.distributed import DistEnv, all_gather_rows


@dataclass
class EvalBatch:
    batch: Batch
    valid: torch.Tensor  # B bool: False for padding rows


def rank_share(
    source: RowSource, batch_rows: int, env: DistEnv, limit: int | None = None
) -> list[EvalBatch]:
    """This rank's share of the first ``limit`` rows of ``source`` (see module docstring)."""
    n = source.num_rows if limit is None else min(limit, source.num_rows)
    share = -(-n // env.world_size)
    start = env.rank * share
    out = []
    for lo in range(start, start + share, batch_rows):
        hi = min(lo + batch_rows, start + share)
        positions = np.arange(lo, hi)
        valid = positions < n
        if valid.all():
            rows = source.read(lo, hi)
        else:  # pad with rows from the start of the split (masked out of the metrics)
            parts = [source.read(lo, n)] if lo < n else []
            pad = int((~valid).sum())
            parts += [source.read(i, min(i + pad, n)) for i in range(0, pad, n)]
            rows = Rows.concat(parts).slice(0, hi - lo)
        out.append(EvalBatch(Batch.from_rows(rows), torch.from_numpy(valid)))
    return out


@torch.no_grad()
def evaluate_share(
    predict: Callable[[Batch], torch.Tensor],
    batches: list[EvalBatch],
    env: DistEnv,
    device: torch.device,
    keep: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Metrics of the whole split from every rank's share (``predict`` returns probabilities).
    With ``keep``, its ``probs`` and ``labels`` become the scored rows' (numpy; a PR curve)."""
    probs, labels, truth, valid = [], [], [], []
    has_truth = all(b.batch.probs is not None for b in batches)
    for eb in batches:
        batch = eb.batch.to(device)
        probs.append(predict(batch).float().cpu())
        labels.append(eb.batch.labels)
        valid.append(eb.valid)
        if has_truth:
            truth.append(eb.batch.probs)  # type: ignore[arg-type]
    columns = [torch.cat(probs), torch.cat(labels), torch.cat(valid).float()]
    if has_truth:
        columns.append(torch.cat(truth).float())
    gathered = all_gather_rows(torch.stack(columns, dim=1), env)
    mask = gathered[:, 2] > 0.5
    acc = EvalAccumulator()
    acc.update(gathered[mask, 0], gathered[mask, 1], gathered[mask, 3] if has_truth else None)
    if keep is not None:
        keep["probs"], keep["labels"] = gathered[mask, 0].numpy(), gathered[mask, 1].numpy()
    return acc.compute()
