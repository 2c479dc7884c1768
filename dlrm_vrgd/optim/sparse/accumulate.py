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
  the step: one ``cat`` of the rows, one ``unique(return_inverse)``, one ``index_add_`` per group. A
  collect reads nothing back from the device: the capture hands it padded row gradients of a size
  known in advance (``static_size``: one slot per looked-up id, see
  :mod:`dlrm_vrgd.embedding.capture`; the pairs first, then padding, ``RowGrads.valid`` false). The
  padding is cut off a micro-batch later (deferred compaction): :meth:`GroupRows.add` enqueues a
  non-blocking copy of the group's pair count into a small host buffer (pinned on CUDA, with an
  event recorded after it), and the next collect (:meth:`GroupRows.settle`) reads it and keeps
  copies of the group's pairs, freeing its padded buffers. By then the copy has long arrived: the
  host waits only if it ran more than a micro-batch ahead of the device, and then for that copy's
  event, not for the work enqueued since (a micro-batch's forward and backward). The step settles
  the last group (its count staged a moment before: one read) and merges; ``unique`` sizes its
  output: two syncs of a row space a step, none a micro-batch. The merge's sort and sums run over
  the groups' pairs (their distinct rows: the capture sums a row's ids within a group; at Criteo's
  skew ~10x fewer than their ids), and the sums equal the unique route's bit for bit.

  Memory, between collects: one group's padded slots (the last collect's) and the other groups'
  pairs. 8 groups of 64k rows x 26 one-hot features x 64 dims (fp32 gradients; ~164k distinct
  rows a group, the H200 run's figure): 436 MB of padded slots + 7 x 42 MB of pairs = 730 MB,
  where keeping every group padded until the step took 8 x 436 MB = 3.5 GB. The padded part is
  the micro-batch's; what grows with the global batch is the groups' distinct rows only (as when
  the capture read a count back per micro-batch: 8 x 42 MB = 335 MB). Each slot or pair also
  holds its row and group (16 bytes) and, with CowClip, a count (8).
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

    def settle(self) -> None:
        """Nothing deferred: each group is folded in as it comes."""

    def drain(self) -> StepRows:
        """The step's sums, then reset for the next step. The tensors are views into buffers
        the next step reuses."""
        n = self.size
        rows = self.rows[:n]
        self.slot[rows] = -1
        self.size = 0
        counts = self.counts[:n] if self.count_ids else None
        return StepRows(rows, self.grad_sum[:n], self.sq_sum[:n], self.n_groups[:n], counts)


class _PairCounts:
    """The pair counts of the padded groups not yet cut to their pairs, staged on the host.

    :meth:`stage` enqueues a copy of a group's count (a device scalar) into a slot of a small
    host buffer — pinned on CUDA, so that the copy is asynchronous, with an event recorded after
    it — and :meth:`read` returns the staged counts, waiting on those events first. Read a
    micro-batch after it was staged (at the next collect), a count has long arrived: the host
    waits only if it ran more than a micro-batch ahead of the device, and then not for the
    device's whole queue (a ``.item()`` would wait for everything enqueued since, the next
    micro-batch's forward and backward included) but for the copy. On the CPU the copy is
    synchronous and the wait free.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # the copy is asynchronous into pinned memory on CUDA; a plain one elsewhere. On another
        # accelerator a non-blocking copy into pageable memory may return before it is done
        self.non_blocking = device.type in ("cpu", "cuda")
        self.buffer = self._host(8)
        self._counts: list[Tensor] = []  # the staged device scalars, kept until read
        self._events: list[torch.cuda.Event] = []

    def _host(self, n: int) -> Tensor:
        pin = self.device.type == "cuda"
        return torch.empty(n, dtype=torch.int64, device="cpu", pin_memory=pin)

    def stage(self, count: Tensor) -> None:
        """Enqueue the copy of ``count`` (a 0-d int64 device tensor) to the host."""
        if len(self._counts) == self.buffer.numel():  # full: a larger buffer, all staged again
            self.buffer = self._host(2 * self.buffer.numel())
            for i, c in enumerate(self._counts):
                self.buffer[i].copy_(c, non_blocking=self.non_blocking)
        self.buffer[len(self._counts)].copy_(count, non_blocking=self.non_blocking)
        self._counts.append(count)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events.append(event)

    def read(self) -> list[int]:
        """The staged counts, in staging order; then empty."""
        for event in self._events:
            event.synchronize()
        n = len(self._counts)
        self._counts, self._events = [], []
        return self.buffer.tolist()[:n]  # the host buffer: a read of host memory


class GroupRows:
    """Sums over one step, merged once at the step (see the module doc); ``rows`` sorted.

    Protocol: :meth:`add` each call's row gradients; :meth:`settle` at the start of the next
    collect (a micro-batch later) cuts the padded ones to their pairs, with the pair counts
    their :meth:`add` staged on the host; :meth:`drain` at the step.
    """

    def __init__(
        self, dim: int, device: torch.device | None = None, count_ids: bool = False
    ) -> None:
        self.dim = dim
        self.count_ids = count_ids
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        #: every call's row gradients, in order; those at :attr:`_padded` still padded
        self._parts: list[RowGrads] = []
        self._padded: list[int] = []
        self._staged = _PairCounts(self.device)

    @property
    def host_counts(self) -> Tensor:
        """The host buffer the padded groups' pair counts are staged into (for the sync tests:
        a read of it is a read of host memory, filled by a non-blocking copy)."""
        return self._staged.buffer

    @property
    def size(self) -> int:
        """Row entries held (a row touched by two groups counts twice; with the padding of the
        groups not yet settled)."""
        return sum(p.rows.numel() for p in self._parts)

    def add(self, rg: RowGrads) -> None:
        """Keep one call's per-(row, group) gradients until :meth:`drain`; a padded one's pair
        count is staged on the host, nothing read back."""
        if not rg.rows.numel():
            return
        if rg.valid is not None:
            self._staged.stage(rg.valid.sum())
            self._padded.append(len(self._parts))
        self._parts.append(rg)

    def settle(self) -> None:
        """Cut the padded groups held to their pairs (copies, so that the padded buffers are
        freed), with the counts their :meth:`add` staged. Call it a micro-batch after that
        :meth:`add` (the next collect does), when the counts have long reached the host."""
        if not self._padded:
            return
        for i, n in zip(self._padded, self._staged.read(), strict=True):
            p = self._parts[i]
            counts = p.counts[:n].clone() if p.counts.numel() else p.counts
            self._parts[i] = RowGrads(
                p.rows[:n].clone(), p.groups[:n].clone(), p.grads[:n].clone(), counts
            )
        self._padded = []

    def drain(self) -> StepRows:
        """Merge the kept groups: every distinct row once, sorted; then reset."""
        self.settle()
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
