"""What ``dlrm-vrgd score`` writes: the predictions file and the streaming metrics.

The predictions (CSV, or Parquet when the name ends in ``.parquet``/``.pq`` or
``fmt="parquet"``; ``kaggle``: ``Id,Predicted`` only) are appended a block at a time to a
temporary file and renamed when complete (:class:`OutputFile`); :class:`Sink` feeds it and the
metrics from a thread of its own, so writing overlaps the next block's forward.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

OutputFormat = Literal["csv", "parquet", "kaggle"]
_EPS = 1e-7  # probability clamp of the logloss (as dlrm_vrgd.metrics)
_AUC_BITS = 20  # histogram bins: the top 20 bits of the probability's float32 pattern


def output_format(out: Path, fmt: OutputFormat | None) -> OutputFormat:
    if fmt is not None:
        return fmt
    return "parquet" if out.suffix.lower() in (".parquet", ".pq") else "csv"


class StreamingMetrics:
    """AUC, logloss, NE and calibration over any number of rows in constant memory.

    logloss, NE and calibration are exact sums. AUC comes from per-class histograms over the
    top :data:`_AUC_BITS` bits of each probability's float32 bit pattern (for values in
    ``[0, 1]`` the pattern is monotone in the value; bins are ``2^-11`` of the value wide), with
    pairs inside one bin counted as ties: exact up to ties within a bin.
    """

    def __init__(self) -> None:
        bins = 1 << _AUC_BITS
        self.pos = np.zeros(bins, dtype=np.int64)
        self.neg = np.zeros(bins, dtype=np.int64)
        self.rows = 0
        self.clicks = 0
        self.prob_sum = 0.0
        self.loss_sum = 0.0

    def update(self, probs: np.ndarray, labels: np.ndarray) -> None:
        probs = np.asarray(probs, dtype=np.float32)
        y = np.asarray(labels) > 0
        shift = np.uint32(31 - _AUC_BITS)
        bins = (np.clip(probs, 0.0, 1.0).view(np.uint32) >> shift).astype(np.intp)
        self.pos += np.bincount(bins[y], minlength=len(self.pos))
        self.neg += np.bincount(bins[~y], minlength=len(self.neg))
        p = np.clip(probs.astype(np.float64), _EPS, 1 - _EPS)
        self.loss_sum -= float(np.sum(np.where(y, np.log(p), np.log1p(-p))))
        self.rows += len(probs)
        self.clicks += int(y.sum())
        self.prob_sum += float(probs.astype(np.float64).sum())

    def auc(self) -> float:
        n_pos, n_neg = int(self.pos.sum()), int(self.neg.sum())
        if n_pos == 0 or n_neg == 0:
            return 0.5
        below = np.cumsum(self.neg) - self.neg  # negatives in lower bins
        wins = float(np.sum(self.pos * below)) + 0.5 * float(np.sum(self.pos * self.neg))
        return wins / (n_pos * n_neg)

    def compute(self) -> dict[str, float]:
        n = self.rows
        rate = self.clicks / n if n else float("nan")
        logloss = self.loss_sum / n if n else float("nan")
        base = (
            -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate)) if 0 < rate < 1 else float("nan")
        )
        return {
            "rows": n,
            "clicks": self.clicks,
            "auc": self.auc(),
            "logloss": logloss,
            "ne": logloss / base if 0 < rate < 1 else float("nan"),
            "calibration": self.prob_sum / self.clicks if self.clicks else float("nan"),
        }


@dataclass(frozen=True)
class ScoredBlock:
    """One block's predictions and where its rows came from."""

    file: str
    lines: np.ndarray  # 1-based line (or row) numbers in ``file``
    ids: pa.Array | None
    labels: np.ndarray | None  # -1 where a row has none
    probs: np.ndarray


class OutputFile:
    """Predictions appended as record batches to a temporary file, renamed when complete.

    ``kaggle``: a Kaggle submission, ``Id,Predicted`` and nothing else (``score`` accepts it only
    when every input has an ``Id`` column)."""

    def __init__(self, path: Path, fmt: OutputFormat, with_id: bool, with_label: bool) -> None:
        self.path = path
        self.tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        self.kaggle = fmt == "kaggle"
        if self.kaggle:
            fields = [pa.field("Id", pa.string()), pa.field("Predicted", pa.float32())]
        else:
            fields = [pa.field("file", pa.string()), pa.field("line", pa.int64())]
            if with_id:
                fields.append(pa.field("Id", pa.string()))
            if with_label:
                fields.append(pa.field("label", pa.int8()))
            fields.append(pa.field("probability", pa.float32()))
        self.schema = pa.schema(fields)
        self.with_id, self.with_label = with_id, with_label
        path.parent.mkdir(parents=True, exist_ok=True)
        self._writer: Any = (
            pq.ParquetWriter(str(self.tmp), self.schema)
            if fmt == "parquet"
            else pcsv.CSVWriter(str(self.tmp), self.schema)
        )

    def write(self, block: ScoredBlock) -> None:
        n = len(block.probs)
        probs = pa.array(block.probs, type=pa.float32())
        if self.kaggle:
            self._writer.write_batch(pa.record_batch([block.ids, probs], schema=self.schema))
            return
        cols: list[pa.Array] = [
            pa.DictionaryArray.from_arrays(np.zeros(n, np.int32), pa.array([block.file])).cast(
                pa.string()
            ),
            pa.array(block.lines, type=pa.int64()),
        ]
        if self.with_id:
            cols.append(block.ids if block.ids is not None else pa.nulls(n, pa.string()))
        if self.with_label:
            labels = block.labels
            if labels is None:
                cols.append(pa.nulls(n, pa.int8()))
            else:
                cols.append(pa.array(labels.astype(np.int8), mask=labels < 0))
        cols.append(probs)
        self._writer.write_batch(pa.record_batch(cols, schema=self.schema))

    def commit(self) -> None:
        self._writer.close()
        with self.tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:
            self.tmp.unlink(missing_ok=True)


class Sink:
    """The output and the metrics, fed by one thread of their own (``score-write``) at most
    ``depth`` blocks behind the model, so writing overlaps the next block's forward. An error
    there is raised by the next :meth:`put` or by :meth:`drain`."""

    def __init__(
        self, writer: OutputFile, metrics: StreamingMetrics | None, depth: int = 2
    ) -> None:
        self.writer, self.metrics, self.depth = writer, metrics, depth
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="score-write")
        self.pending: deque[Future[None]] = deque()

    def put(self, block: ScoredBlock) -> None:
        while len(self.pending) >= self.depth:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(self._write, block))

    def _write(self, block: ScoredBlock) -> None:
        self.writer.write(block)
        if self.metrics is not None and block.labels is not None:
            self.metrics.update(block.probs, block.labels)

    def drain(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def close(self) -> None:
        """Stop the thread (writes not started are dropped): the output may then be closed."""
        self.pool.shutdown(wait=True, cancel_futures=True)
