"""The sparse step's per-table figures, reduced on the device and read by the host once.

Every figure of a table is a sum (or an order statistic) over the table's touched rows. The step
computes them for all tables of a lookup at once, as segmented reductions over the rows (a
segment per table: ``index_add_`` into one slot per table), keeps them on the device as one
``tables x columns`` float64 tensor, and starts one copy to the host (non-blocking, into pinned
memory, on a GPU). Nothing waits for it until :meth:`TableFigures.rows` is read — on the steps
whose figures are logged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

#: Columns that hold counts (read back as ints).
COUNTS = ("touched_rows", "multi_group_rows")


def segment_sum(values: Tensor, segments: Tensor, n: int) -> Tensor:
    """``out[i] = Σ values[segments == i]`` (float64, ``n`` entries, on the values' device)."""
    out = torch.zeros(n, dtype=torch.float64, device=values.device)
    return out.index_add_(0, segments, values.to(torch.float64))


def step_ratio_stats(
    actual: Tensor, plain: Tensor, segments: Tensor, n: int
) -> tuple[Tensor, Tensor]:
    """Per segment, the realised step ratio ``actual / plain`` over the rows that the plain step
    moves (``plain > 0``): its mean and its 10th percentile, the ``⌈m/10⌉``-th smallest of the
    segment's ``m`` ratios (float64, NaN where no row moves). One sort for every segment: by
    ratio, then stably by segment (rows that do not move form a last segment of their own)."""
    nan = torch.full((n,), math.nan, dtype=torch.float64, device=actual.device)
    if actual.numel() == 0:
        return nan, nan.clone()
    live = plain > 0
    ratio = torch.where(live, actual / torch.where(live, plain, 1.0), 0.0).double()
    seg = torch.where(live, segments, n)
    count = torch.zeros(n + 1, dtype=torch.int64, device=seg.device)
    count.index_add_(0, seg, torch.ones_like(seg))
    mean = segment_sum(ratio, seg, n + 1)[:n] / count[:n].clamp_min(1)
    by_ratio = torch.argsort(ratio, stable=True)
    ordered = ratio[by_ratio][torch.argsort(seg[by_ratio], stable=True)]
    start = torch.cumsum(count, 0) - count
    nth = (start + (count + 9) // 10 - 1).clamp(0, ratio.numel() - 1)
    p10 = ordered[nth[:n]]
    moved = count[:n] > 0
    return torch.where(moved, mean, nan), torch.where(moved, p10, nan)


class TableFigures:
    """Named per-table columns of one step (float64 on the device), then one host copy."""

    def __init__(self, names: list[str], device: torch.device) -> None:
        self.names = list(names)
        self.device = device
        self.columns: dict[str, Tensor] = {}
        self.constants: dict[str, Any] = {}
        self._host: Tensor | None = None
        self._ready: torch.cuda.Event | None = None
        self._keys: list[str] = []

    def column(self, key: str, fill: float = 0.0) -> Tensor:
        """The column ``key`` (created filled with ``fill``), to add or write into."""
        if key not in self.columns:
            self.columns[key] = torch.full(
                (len(self.names),), fill, dtype=torch.float64, device=self.device
            )
        return self.columns[key]

    def add(self, key: str, tables: Tensor, values: Tensor) -> None:
        """Add ``values`` of rows to their tables' (``tables``: the table of each row)."""
        self.column(key).index_add_(0, tables, values.to(torch.float64))

    def put(self, key: str, tables: Tensor, values: Tensor, fill: float = math.nan) -> None:
        """Write one value per table in ``tables`` (distinct)."""
        self.column(key, fill).index_copy_(0, tables, values.to(torch.float64))

    def finish(self) -> None:
        """Start the one copy of every column to the host."""
        self._keys = list(self.columns)
        if not self._keys:
            return
        stacked = torch.stack([self.columns[k] for k in self._keys], dim=1)
        if stacked.device.type == "cuda":
            self._host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            self._host.copy_(stacked, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = stacked
        self.columns = {}

    def rows(self) -> list[dict[str, Any]]:
        """One dict per table (waits for the copy): counts as ints, NaN as None."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        values = self._host.tolist() if self._host is not None else [[] for _ in self.names]
        out = []
        for name, row in zip(self.names, values, strict=True):
            entry: dict[str, Any] = {"table": name}
            for key, v in zip(self._keys, row, strict=True):
                if key in COUNTS:
                    entry[key] = int(v)
                else:
                    entry[key] = None if math.isnan(v) else v
            entry.update(self.constants)
            out.append(entry)
        return out
