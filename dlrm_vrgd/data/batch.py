"""Batches for the model and the mapping from (step, group) to training rows.

The training stream (DESIGN.md 2) is an endless run of epochs over the train split; epoch ``e``
visits the split's blocks in a permutation seeded by ``(seed, e)``. Global step ``s`` consumes
stream positions ``[s·G, (s+1)·G)``; its group ``g = rank·A + j`` (micro-batch ``j`` of rank
``rank``) is the ``B`` rows starting at ``s·G + g·B``. Steps may straddle an epoch boundary: no
row is dropped, and where a step wraps, its rows come from two epochs. Every rank computes its
own rows from ``(step, group)`` alone, so data never overlaps between ranks, and a resumed run
reads exactly the rows the uninterrupted run would have read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dlrm_vrgd.data.rows import Rows, RowSource

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from dlrm_vrgd.data.multihot import BagLayout


def feature_names(num_tables: int) -> list[str]:
    return [f"cat_{i}" for i in range(num_tables)]


@dataclass
class Batch:
    """``dense`` B x F float32, ``sparse`` B x T int64 (one id per table; multi-hot: the ``B·L``
    ids of ``bags`` in table order, the KJT's values, :mod:`~dlrm_vrgd.data.multihot`),
    ``labels`` B float32, ``probs`` B float32 true click probabilities when the data is
    synthetic; ``bags``: the fixed bag sizes of multi-hot data (None: one-hot)."""

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor
    probs: torch.Tensor | None = None
    bags: BagLayout | None = None

    @staticmethod
    def from_rows(rows: Rows) -> Batch:
        return Batch(
            dense=torch.from_numpy(np.ascontiguousarray(rows.dense, dtype=np.float32)),
            sparse=torch.from_numpy(batch_sparse(rows)),
            labels=torch.from_numpy(np.ascontiguousarray(rows.labels, dtype=np.float32)),
            probs=None if rows.probs is None else torch.from_numpy(rows.probs),
            bags=rows.bags,
        )

    def __len__(self) -> int:
        return self.labels.numel()

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.dense.to(device),
            self.sparse.to(device),
            self.labels.to(device),
            None if self.probs is None else self.probs.to(device),
            self.bags,
        )

    def kjt(self, keys: list[str]) -> KeyedJaggedTensor:
        """The categorical ids as a KeyedJaggedTensor ``[T x B x 1]`` (one id per bag;
        multi-hot: ``[T x B x s_t]``, its lengths and offsets the static ones of
        :meth:`~dlrm_vrgd.data.multihot.BagLayout.kjt`)."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        if self.bags is not None:
            return self.bags.kjt(self.sparse, keys)
        n, t = self.sparse.shape
        return KeyedJaggedTensor(
            keys=keys,
            values=self.sparse.t().reshape(-1),
            offsets=torch.arange(n * t + 1, dtype=torch.int64, device=self.sparse.device),
            stride=n,
        )


def batch_sparse(rows: Rows) -> np.ndarray:
    """The ids of a micro-batch of ``rows`` as int64: ``N x T`` one-hot, or the ``N·L``
    multi-hot ids in table order (:func:`~dlrm_vrgd.data.multihot.batch_ids`)."""
    if rows.bags is None:
        return np.ascontiguousarray(rows.sparse, dtype=np.int64)
    from dlrm_vrgd.data.multihot import batch_ids

    out = np.empty(len(rows) * rows.bags.width, dtype=np.int64)
    batch_ids(rows, out)
    return out


class TrainStream:
    """Training rows by (step, group); see the module docstring."""

    def __init__(self, source: RowSource, global_batch: int, micro_batch: int, seed: int) -> None:
        if source.num_rows < global_batch:
            raise ValueError(
                f"the train split has {source.num_rows} rows, fewer than one global batch "
                f"({global_batch}); use more rows or a smaller run.global_batch"
            )
        self.source = source
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.seed = seed
        n, c = source.num_rows, source.block_rows
        self._num_blocks = -(-n // c)
        self._sizes = np.full(self._num_blocks, c, dtype=np.int64)
        self._sizes[-1] = n - c * (self._num_blocks - 1)
        self._orders: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()  # the input pipeline's threads read rows at once

    def epoch(self, step: int) -> float:
        """Epochs completed before ``step`` (fractional)."""
        return step * self.global_batch / self.source.num_rows

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            order = self._orders.get(epoch)
            if order is None:
                rng = np.random.default_rng([self.seed, 0x5EED, epoch])
                perm = rng.permutation(self._num_blocks)
                starts = np.concatenate([[0], np.cumsum(self._sizes[perm])[:-1]])
                order = self._orders[epoch] = (perm, starts)
                if len(self._orders) > 2:
                    self._orders.popitem(last=False)
            return order

    def _segments(self, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """Source row ranges covering stream positions ``[start, stop)``."""
        n, c = self.source.num_rows, self.source.block_rows
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, n)
            perm, starts = self._order(epoch)
            i = int(np.searchsorted(starts, offset, side="right")) - 1
            block = int(perm[i])
            within = offset - int(starts[i])
            take = min(int(self._sizes[block]) - within, stop - pos)
            yield block * c + within, block * c + within + take
            pos += take

    def rows(self, step: int, group: int) -> Rows:
        """The ``B`` rows of group ``group`` of global step ``step``. Rows that the multi-hot
        synthesis makes come one-hot (``hot`` set; :meth:`Rows.materialized` makes them): the
        micro-batch's fill makes their bags once, in the KJT's table order
        (:mod:`~dlrm_vrgd.data.multihot`)."""
        start = step * self.global_batch + group * self.micro_batch
        if not 0 <= group * self.micro_batch < self.global_batch:
            raise IndexError(f"group {group} outside a global batch of {self.global_batch}")
        read = getattr(self.source, "read_one_hot", self.source.read)
        parts = [read(a, b) for a, b in self._segments(start, start + self.micro_batch)]
        return Rows.concat(parts)
