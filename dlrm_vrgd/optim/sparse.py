"""Row-wise optimizer for embedding tables, one update per global batch (DESIGN.md 4.3).

Group protocol, as for the dense optimizers: after the backward of each group (micro-batch)
call :meth:`SparseRowwiseOptimizer.collect`; it folds the captured per-(row, group) gradients
into per-table accumulators. :meth:`SparseRowwiseOptimizer.step` then forms, for every row
touched in the step, the mean row gradient over the ``k`` groups

    ḡ_row = (1/k) Σ_d g_{d,row}        (g_{d,row} = 0 for groups that did not touch the row)

and hands it to the table's fused kernel (FBGEMM EXACT_ROWWISE_ADAGRAD / EXACT_SGD), which
updates each touched row exactly once. Since every group's loss is the mean over its own ``B``
rows, ``ḡ`` is the gradient of the mean loss over the whole global batch.

Memory: an ``int32`` slot per table row (the size of the row-wise Adagrad state) plus
``O(touched rows x D)`` for the step's sums.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from dlrm_vrgd.embedding.capture import LookupCapture, RowGrads

logger = logging.getLogger(__name__)


class RowwiseLookup(Protocol):
    """What the optimizer needs from an embedding collection (FBGEMM or torch backend)."""

    capture: LookupCapture

    @property
    def table_names(self) -> list[str]: ...

    @property
    def table_rows(self) -> list[int]: ...

    def apply_rows(
        self, rows: list[torch.Tensor], grads: list[torch.Tensor], lr: float, chunk_rows: int
    ) -> None: ...


class RowAccumulator:
    """Sums over one step of one table's per-group row gradients, keyed by row.

    ``grad_sum[i]`` = Σ_d g_{d,row_i} (D-vector), ``sq_sum[i]`` = Σ_d ‖g_{d,row_i}‖²,
    ``n_groups[i]`` = number of groups that touched ``row_i``; ``rows[:size]`` in first-touch order.
    """

    def __init__(self, num_rows: int, dim: int, device: torch.device | None = None) -> None:
        self.dim = dim
        self.device = device
        self.slot = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
        self.size = 0
        self._alloc(0)

    def _alloc(self, capacity: int) -> None:
        self.rows = torch.empty(capacity, dtype=torch.int64, device=self.device)
        self.grad_sum = torch.zeros(capacity, self.dim, device=self.device)
        self.sq_sum = torch.zeros(capacity, device=self.device)
        self.n_groups = torch.zeros(capacity, dtype=torch.int32, device=self.device)

    def _reserve(self, needed: int) -> None:
        if needed <= self.rows.numel():
            return
        old = (self.rows, self.grad_sum, self.sq_sum, self.n_groups)
        self._alloc(max(needed, 2 * self.rows.numel(), 1024))
        new_bufs = (self.rows, self.grad_sum, self.sq_sum, self.n_groups)
        for new, prev in zip(new_bufs, old, strict=True):
            new[: self.size] = prev[: self.size]

    def add(self, rg: RowGrads) -> None:
        """Fold one call's per-(row, group) gradients (``rg.rows`` sorted) into the sums."""
        if rg.rows.numel() == 0:
            return
        urows, inverse = torch.unique_consecutive(rg.rows, return_inverse=True)
        slots = self.slot[urows].long()
        new = slots < 0
        n_new = int(new.sum())
        if n_new:
            self._reserve(self.size + n_new)
            fresh = torch.arange(self.size, self.size + n_new, device=slots.device)
            slots[new] = fresh
            self.slot[urows[new]] = fresh.to(torch.int32)
            self.rows[self.size : self.size + n_new] = urows[new]
            self.grad_sum[self.size : self.size + n_new].zero_()
            self.sq_sum[self.size : self.size + n_new].zero_()
            self.n_groups[self.size : self.size + n_new].zero_()
            self.size += n_new
        idx = slots[inverse]
        self.grad_sum.index_add_(0, idx, rg.grads)
        self.sq_sum.index_add_(0, idx, rg.grads.square().sum(dim=1))
        self.n_groups.index_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))

    def drain(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows, grad_sum, sq_sum, n_groups)`` of the step, then reset for the next one.

        The returned tensors are views into buffers reused by the next step.
        """
        n = self.size
        rows = self.rows[:n]
        self.slot[rows] = -1
        self.size = 0
        return rows, self.grad_sum[:n], self.sq_sum[:n], self.n_groups[:n]


class SparseRowwiseOptimizer:
    """One row-wise update of every touched embedding row per global step.

    Args:
        lookups: embedding collections whose lookups are captured (:class:`RowwiseLookup`).
        lr: learning rate handed to the fused kernel (``param_groups[0]["lr"]``, so schedules
            set it like a ``torch.optim`` optimizer's).
        chunk_rows: rows per replay call of the fused kernel.
        groups_per_collect: groups contributed by one :meth:`collect` (1 on one process; the
            number of source ranks when a sharded table's owner receives every rank's bags).
    """

    def __init__(
        self,
        lookups: list[RowwiseLookup],
        lr: float,
        chunk_rows: int = 65_536,
        groups_per_collect: int = 1,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if chunk_rows <= 0:
            raise ValueError(f"Invalid chunk_rows: {chunk_rows}")
        self.lookups = list(lookups)
        self.param_groups: list[dict[str, Any]] = [{"lr": lr, "initial_lr": lr}]
        self.chunk_rows = chunk_rows
        self.groups_per_collect = groups_per_collect
        self.k = 0
        self._acc = [
            [
                RowAccumulator(rows, dim)
                for rows, dim in zip(lk.table_rows, lk.capture.table_dims, strict=True)
            ]
            for lk in self.lookups
        ]
        self._last_summary: list[dict[str, Any]] = []

    def collect(self) -> None:
        """Fold the row gradients captured since the last call in as one more group."""
        for lookup, accs in zip(self.lookups, self._acc, strict=True):
            for call in lookup.capture.take():
                for acc, rg in zip(accs, call, strict=True):
                    acc.add(rg)
        self.k += self.groups_per_collect

    @torch.no_grad()
    def step(self) -> None:
        """Apply the mean row gradient of the collected groups, then reset."""
        if self.k == 0:
            logger.warning("SparseRowwiseOptimizer.step() without collect(): nothing to apply")
            return
        lr = float(self.param_groups[0]["lr"])
        summary = []
        for lookup, accs in zip(self.lookups, self._acc, strict=True):
            rows_out, grads_out = [], []
            for name, acc in zip(lookup.table_names, accs, strict=True):
                rows, grad_sum, _sq_sum, n_groups = acc.drain()
                rows_out.append(rows)
                grads_out.append(grad_sum / self.k)
                summary.append(
                    {
                        "table": name,
                        "touched_rows": int(rows.numel()),
                        "multi_group_rows": int((n_groups >= 2).sum()),
                    }
                )
            with torch.enable_grad():
                lookup.apply_rows(rows_out, grads_out, lr, self.chunk_rows)
        self._last_summary = summary
        self.k = 0

    def summary(self) -> list[dict[str, Any]]:
        """Per-table figures of the last step (touched rows, rows seen in >= 2 groups)."""
        return self._last_summary

    def state_dict(self) -> dict[str, Any]:
        return {"param_groups": [dict(g) for g in self.param_groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.param_groups = [dict(g) for g in state["param_groups"]]
