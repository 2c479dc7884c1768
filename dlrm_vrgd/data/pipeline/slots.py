"""Host buffers of built micro-batches: their layout, filling one from rows, and the two sets
of reused buffers, pinned (copied to a GPU) and shared (written by worker processes).

Ids are narrowed to int32 where they only travel (shared buffers, pinned buffers, the copy to
the GPU, which the pipeline widens back on the device: FBGEMM's and the sparse optimizer's
int64) and stay int64 on a CPU run; an id outside ``[0, 2^31)`` is refused, never wrapped.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np
import torch

from dlrm_vrgd.data.batch import batch_sparse
from dlrm_vrgd.data.multihot import BagLayout, batch_ids
from dlrm_vrgd.data.rows import Rows

INT32_MAX = 2**31 - 1
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class Layout:
    """One micro-batch: ``rows`` (B) rows of ``num_dense`` (F) floats and ``num_tables`` (T)
    ids, and a label; multi-hot (``bags``): ``width`` (L) ids a row, held as one ``B·L``
    array in the KJT's table order (:mod:`~dlrm_vrgd.data.multihot`)."""

    rows: int
    num_dense: int
    num_tables: int
    bags: BagLayout | None = None

    @property
    def width(self) -> int:
        """Ids a row: ``T``, or ``L`` for multi-hot rows."""
        return self.num_tables if self.bags is None else self.bags.width

    @property
    def sparse_shape(self) -> tuple[int, ...]:
        """The shape of a micro-batch's ids: ``B x T``, or ``(B·L,)`` multi-hot."""
        if self.bags is None:
            return (self.rows, self.num_tables)
        return (self.rows * self.bags.width,)

    def nbytes(self, id_bytes: int = 4) -> int:
        """Bytes of one micro-batch with ``id_bytes`` per id."""
        return self.rows * (4 * self.num_dense + id_bytes * self.width + 4)


@dataclass
class HostBatch:
    """A built micro-batch on the host: ``dense`` B x F float32, ``sparse`` B x T (multi-hot:
    B·L in table order) int64 (its own memory) or int32 (a pinned slot, for the GPU),
    ``labels`` B float32, ``probs`` B float32 or None; ``slot``: the pinned slot it lives in,
    None when it owns its memory; ``bags``: the static bag sizes of multi-hot ids (None:
    one-hot)."""

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor
    probs: torch.Tensor | None = None
    slot: int | None = None
    bags: BagLayout | None = None

    @staticmethod
    def own(rows: Rows) -> HostBatch:
        """``rows`` as tensors, without a copy where they already have the batch's dtypes."""
        return HostBatch(
            dense=torch.from_numpy(np.ascontiguousarray(rows.dense, dtype=np.float32)),
            sparse=torch.from_numpy(batch_sparse(rows)),
            labels=torch.from_numpy(np.ascontiguousarray(rows.labels, dtype=np.float32)),
            probs=None if rows.probs is None else torch.from_numpy(rows.probs),
            bags=rows.bags,
        )


def narrow_ids(ids: np.ndarray, out: np.ndarray) -> None:
    """Copy ``ids`` into the int32 array ``out``; a ValueError for an id outside
    ``[0, 2^31)`` (it would wrap)."""
    if ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high > INT32_MAX:
            raise ValueError(f"ids {low}..{high} do not fit int32 (a table has at most 2^31 rows)")
    np.copyto(out, ids, casting="unsafe")


def fill(rows: Rows, dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> None:
    """Write ``rows`` into a micro-batch's arrays (``sparse`` int32 or int64; multi-hot: its
    ``B·L`` ids in table order, made here by the synthesis where ``rows.hot`` is set)."""
    bags = rows.bags
    shape = rows.sparse.shape if bags is None else (len(rows) * bags.width,)
    if rows.dense.shape != dense.shape or shape != sparse.shape:
        raise ValueError(
            f"rows of shape dense {rows.dense.shape} / sparse {rows.sparse.shape}; the "
            f"micro-batch holds {dense.shape} / {sparse.shape}"
        )
    np.copyto(dense, rows.dense, casting="same_kind")
    if bags is not None:
        batch_ids(rows, sparse)
    elif sparse.dtype == np.int32 and rows.sparse.dtype != np.int32:
        narrow_ids(rows.sparse, sparse)
    else:
        np.copyto(sparse, rows.sparse, casting="same_kind")
    np.copyto(labels, rows.labels, casting="same_kind")


class PinnedSlots:
    """``count`` micro-batches of page-locked host memory (``pin``: CUDA runs; tests use
    plain memory), reused: a builder fills a slot, one non-blocking copy reads it, and it is
    free again once that copy's event completed (the pipeline keeps that account). Ids are
    int32."""

    def __init__(self, layout: Layout, count: int, pin: bool = True) -> None:
        b, f, ids = layout.rows, layout.num_dense, layout.sparse_shape
        self.batches = [
            HostBatch(
                dense=torch.empty((b, f), dtype=torch.float32, pin_memory=pin),
                sparse=torch.empty(ids, dtype=torch.int32, pin_memory=pin),
                labels=torch.empty(b, dtype=torch.float32, pin_memory=pin),
                slot=i,
                bags=layout.bags,
            )
            for i in range(count)
        ]

    def __len__(self) -> int:
        return len(self.batches)

    def fill(self, slot: int, rows: Rows) -> HostBatch:
        out = self.batches[slot]
        fill(rows, out.dense.numpy(), out.sparse.numpy(), out.labels.numpy())
        return out

    def copy_from(self, slot: int, arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> HostBatch:
        """Slot ``slot`` filled from a shared slot's arrays."""
        out = self.batches[slot]
        for dst, src in zip((out.dense, out.sparse, out.labels), arrays, strict=True):
            np.copyto(dst.numpy(), src)
        return out


class SharedSlots:
    """``count`` micro-batches in one anonymous shared mapping, made before the worker
    processes are forked: a worker writes a slot, the parent copies it out and hands the slot
    back. Ids are int32. Nothing is named in ``/dev/shm``, so a killed run leaves nothing."""

    def __init__(self, layout: Layout, count: int) -> None:
        b, f = layout.rows, layout.num_dense
        self.bags = layout.bags
        parts = [((b, f), np.float32), (layout.sparse_shape, np.int32), ((b,), np.float32)]
        sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in parts]
        stride = -(-sum(sizes) // _PAGE) * _PAGE
        self._map: mmap.mmap | None = mmap.mmap(-1, max(stride * count, _PAGE))
        self._arrays: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for i in range(count):
            offset, views = i * stride, []
            for (shape, dtype), size in zip(parts, sizes, strict=True):
                n = int(np.prod(shape))
                views.append(np.frombuffer(self._map, dtype, n, offset).reshape(shape))
                offset += size
            self._arrays.append((views[0], views[1], views[2]))

    def __len__(self) -> int:
        return len(self._arrays)

    def arrays(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(dense, sparse int32, labels)`` of a slot (views of the shared mapping)."""
        return self._arrays[slot]

    def fill(self, slot: int, rows: Rows) -> None:
        fill(rows, *self._arrays[slot])

    def own(self, slot: int) -> HostBatch:
        """A copy of a slot in memory of its own, ids widened to int64 (a CPU run)."""
        dense, sparse, labels = self._arrays[slot]
        return HostBatch(
            dense=torch.from_numpy(dense.copy()),
            sparse=torch.from_numpy(sparse.astype(np.int64)),
            labels=torch.from_numpy(labels.copy()),
            bags=self.bags,
        )

    def close(self) -> None:
        """Unmap (once no view of it is left alive elsewhere; else the mapping goes with the
        last view)."""
        self._arrays = []
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None
