"""Rows: a block of Criteo-layout examples as numpy arrays (the unit every data source yields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from dlrm_vrgd.data.multihot import BagLayout, MultiHotTables


@dataclass(frozen=True)
class Rows:
    """``N`` examples: ``dense`` N x F float32 (already transformed), ``sparse`` N x T int64
    ids (multi-hot: N x L, the bags of ``bags`` side by side), ``labels`` N float32 in {0, 1},
    ``probs`` N float32 true click probabilities (synthetic data only).

    ``hot``: multi-hot rows not made yet: ``sparse`` still holds the one-hot ``N x T`` ids and
    ``hot``'s synthesis makes the bags where the micro-batch is filled, straight into the
    table order of the KJT (:func:`~dlrm_vrgd.data.multihot.batch_ids`); :meth:`materialized`
    gives the ``N x L`` rows."""

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    probs: np.ndarray | None = None
    #: multi-hot rows: the fixed bag size of each table (None: one id a table)
    bags: BagLayout | None = None
    #: the synthesis that makes these one-hot ids multi-hot (None: ``sparse`` is final)
    hot: MultiHotTables | None = None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def nbytes(self) -> int:
        arrays = (self.dense, self.sparse, self.labels, self.probs)
        return sum(a.nbytes for a in arrays if a is not None)

    def slice(self, start: int, stop: int) -> Rows:
        return Rows(
            dense=self.dense[start:stop],
            sparse=self.sparse[start:stop],
            labels=self.labels[start:stop],
            probs=None if self.probs is None else self.probs[start:stop],
            bags=self.bags,
            hot=self.hot,
        )

    def materialized(self) -> Rows:
        """These rows with their multi-hot ids made (``sparse`` ``N x L`` int64); themselves
        where ``hot`` is None."""
        if self.hot is None:
            return self
        sparse = self.hot.expand(self.sparse)
        return Rows(self.dense, sparse, self.labels, self.probs, bags=self.bags)

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        if len(parts) == 1:
            return parts[0]
        if len({id(p.hot) for p in parts}) > 1:
            raise ValueError("rows to join are one-hot ids of different syntheses")
        has_probs = all(p.probs is not None for p in parts)
        return Rows(
            dense=np.concatenate([p.dense for p in parts]),
            sparse=np.concatenate([p.sparse for p in parts]),
            labels=np.concatenate([p.labels for p in parts]),
            probs=np.concatenate([p.probs for p in parts]) if has_probs else None,  # type: ignore[misc]
            bags=parts[0].bags,
            hot=parts[0].hot,
        )


class RowSource(Protocol):
    """Random access to one split. ``block_rows`` is the natural read/shuffle granularity."""

    num_rows: int
    block_rows: int
    cardinalities: list[int]
    num_dense: int

    def read(self, start: int, stop: int) -> Rows: ...
