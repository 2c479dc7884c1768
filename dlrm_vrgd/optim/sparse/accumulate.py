"""The step's per-row sums of the groups' row gradients, two ways.

Both give, for every row ``i`` that a group of the step touched (one row space of one lookup):
``grad_sum[i] = Σ_d g_{d,row_i}`` (D-vector), ``sq_sum[i] = Σ_d ‖g_{d,row_i}‖²``, ``n_groups[i]``
the groups that touched it and, with ``count_ids``, ``counts[i]`` the samples of the step holding
its id (CowClip's ``cnt``).

* :class:`RowAccumulator` (the CPU's): folds each group in as it comes, into buffers reserved for
  every row of the space (the OS commits a page only when it is written, so resident memory
  follows the rows touched). Memory: the step's touched rows, whatever the number of groups. It
  reads a count back per group (host syncs: free on a CPU).
* :class:`GroupRows` (a GPU's): keeps each group's row gradients as they come and merges them at
  the step: one ``cat`` of the rows, one ``unique(return_inverse)``, one ``index_add_`` per group.
  A collect reads nothing back: the capture hands it padded row gradients of a size known in
  advance (``static_size``: one slot per looked-up id, see :mod:`dlrm_vrgd.embedding.capture`;
  the pairs first, then padding, ``RowGrads.valid`` false). The step reads the groups' pair
  counts back in one copy and cuts the padding off before it merges, so that the merge's sort
  and sums run over the groups' distinct rows (at Criteo's skew ~10x fewer than their ids), and
  ``unique`` sizes its output: two syncs of a row space a step, none a micro-batch. Memory: one
  slot per looked-up id of every group until the step (8 groups of 64k rows x 26 one-hot
  features x 64 dims: 3.5 GB; keeping only the distinct rows would take a read-back per
  micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dlrm_vrgd.embedding.capture import RowGrads
from dlrm_vrgd.optim.gsnr import row_sq_norm


@dataclass(frozen=True)
class StepRows:
    """One step's sums of one row space: ``rows`` (U global rows), ``grad_sum`` (U x D),
    ``sq_sum`` (U), ``n_groups`` (U, int32) and ``counts`` (U, int64, or None)."""

    rows: Tensor
    grad_sum: Tensor
    sq_sum: Tensor
    n_groups: Tensor
    counts: Tensor | None


def _unpadded(parts: list[RowGrads]) -> list[RowGrads]:
    """``parts`` without their padding (``static_size``), their pairs' counts read back in one
    copy for all of them (the step's, not a micro-batch's)."""
    padded = [i for i, p in enumerate(parts) if p.valid is not None]
    if not padded:
        return parts
    sizes = torch.stack([parts[i].valid.sum() for i in padded]).tolist()  # type: ignore[union-attr]
    out = list(parts)
    for i, n in zip(padded, sizes, strict=True):
        p = parts[i]
        out[i] = RowGrads(p.rows[:n], p.groups[:n], p.grads[:n], p.counts[:n])
    return out


def _entries(rg: RowGrads, like: Tensor) -> Tensor:
    """1 for each (row, group) pair of ``rg``, 0 for its padding (int32, shaped like ``like``)."""
    if rg.valid is None:
        return torch.ones_like(like, dtype=torch.int32)
    return rg.valid.to(torch.int32)


class RowAccumulator:
    """Sums over one step, folded in group by group (see the module doc); ``rows`` in
    first-touch order.

    On the CPU the buffers are reserved for every row of the table at once: the operating system
    commits a page only when it is first written, so resident memory follows the rows actually
    touched and never needs a grow-and-copy (whose old and new buffers would both be alive). On a
    GPU, whose allocations are committed in full, they grow geometrically instead.
    """

    def __init__(
        self,
        num_rows: int,
        dim: int,
        device: torch.device | None = None,
        count_ids: bool = False,
    ) -> None:
        self.dim = dim
        self.count_ids = count_ids
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.slot = torch.full((num_rows,), -1, dtype=torch.int32, device=self.device)
        self.size = 0
        self._alloc(num_rows if self.device.type == "cpu" else 0)

    def _alloc(self, capacity: int) -> None:
        self.rows = torch.empty(capacity, dtype=torch.int64, device=self.device)
        self.grad_sum = torch.empty(capacity, self.dim, device=self.device)
        self.sq_sum = torch.empty(capacity, device=self.device)
        self.n_groups = torch.empty(capacity, dtype=torch.int32, device=self.device)
        self.counts = torch.empty(
            capacity if self.count_ids else 0, dtype=torch.int64, device=self.device
        )

    def _bufs(self) -> tuple[Tensor, ...]:
        return (self.rows, self.grad_sum, self.sq_sum, self.n_groups, self.counts)

    def _reserve(self, needed: int) -> None:
        if needed <= self.rows.numel():
            return
        old = self._bufs()
        grown = max(needed, self.rows.numel() * 3 // 2, 1024)
        self._alloc(min(grown, self.slot.numel()))  # never past one slot per table row
        for new, prev in zip(self._bufs(), old, strict=True):
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
            if self.count_ids:
                self.counts[self.size : self.size + n_new].zero_()
            self.size += n_new
        idx = slots[inverse]
        self.grad_sum.index_add_(0, idx, rg.grads)
        self.sq_sum.index_add_(0, idx, row_sq_norm(rg.grads))
        self.n_groups.index_add_(0, idx, _entries(rg, idx))
        if self.count_ids:
            self.counts.index_add_(0, idx, rg.counts)

    def drain(self) -> StepRows:
        """The step's sums, then reset for the next step. The tensors are views into buffers
        the next step reuses."""
        n = self.size
        rows = self.rows[:n]
        self.slot[rows] = -1
        self.size = 0
        counts = self.counts[:n] if self.count_ids else None
        return StepRows(rows, self.grad_sum[:n], self.sq_sum[:n], self.n_groups[:n], counts)


class GroupRows:
    """Sums over one step, merged once at the step (see the module doc); ``rows`` sorted."""

    def __init__(
        self, dim: int, device: torch.device | None = None, count_ids: bool = False
    ) -> None:
        self.dim = dim
        self.count_ids = count_ids
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._parts: list[RowGrads] = []

    @property
    def size(self) -> int:
        """Row entries held (a row touched by two groups counts twice)."""
        return sum(p.rows.numel() for p in self._parts)

    def add(self, rg: RowGrads) -> None:
        """Keep one call's per-(row, group) gradients until :meth:`drain`."""
        if rg.rows.numel():
            self._parts.append(rg)

    def drain(self) -> StepRows:
        """Merge the kept groups: every distinct row once, sorted; then reset."""
        parts, self._parts = self._parts, []
        device = self.device
        if not parts:
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            return StepRows(
                empty,
                torch.zeros(0, self.dim, device=device),
                torch.zeros(0, device=device),
                torch.zeros(0, dtype=torch.int32, device=device),
                empty.clone() if self.count_ids else None,
            )
        parts = _unpadded(parts)
        rows, inverse = torch.unique(
            torch.cat([p.rows for p in parts]), sorted=True, return_inverse=True
        )
        u = rows.numel()  # unique sized its output: no read-back here
        grad_sum = torch.zeros(u, self.dim, device=device)
        sq_sum = torch.zeros(u, device=device)
        for part, idx in zip(parts, inverse.split([p.rows.numel() for p in parts]), strict=True):
            grad_sum.index_add_(0, idx, part.grads)
            sq_sum.index_add_(0, idx, row_sq_norm(part.grads))
        n_groups = torch.zeros(u, dtype=torch.int32, device=device)
        n_groups.index_add_(0, inverse, torch.cat([_entries(p, p.rows) for p in parts]))
        counts = None
        if self.count_ids:
            counts = torch.zeros(u, dtype=torch.int64, device=device)
            counts.index_add_(0, inverse, torch.cat([p.counts for p in parts]))
        return StepRows(rows, grad_sum, sq_sum, n_groups, counts)
