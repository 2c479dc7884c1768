"""Copying built micro-batches to a GPU on a side stream (CUDA runs only; a CPU run never
creates a :class:`CudaStager`).

:meth:`CudaStager.start` issues the host-to-device copies of a pinned micro-batch on the copy
stream, ``non_blocking``, widens the int32 ids to int64 there (what FBGEMM and the sparse
optimizer take), and records an event after them. :meth:`CudaStager.hand_over` makes the
compute stream wait for that event (on the device: the host does not block) and marks the
batch's tensors as used by the compute stream (``record_stream``), so that the caching
allocator does not give their memory to a later copy before the step is done with them.
The pinned slot is free once the event has completed (:meth:`Staged.copied`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dlrm_vrgd.data.batch import Batch
from dlrm_vrgd.data.pipeline.plan import Key
from dlrm_vrgd.data.pipeline.slots import HostBatch


class Event(Protocol):
    """What the pipeline asks of a copy's event (``torch.cuda.Event``; a fake in tests)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass
class Staged:
    """A micro-batch whose copy to the device was issued: ``batch`` (device tensors, valid on
    the copy stream once ``event`` has completed), and the pinned ``slot`` it was read from."""

    key: Key
    batch: Batch
    event: Event
    slot: int | None

    def copied(self) -> bool:
        """The copy is done (its host slot may be written again)."""
        return bool(self.event.query())


class Stager(Protocol):
    """Issues a built micro-batch's copy to the device and hands it to the step."""

    def start(self, key: Key, host: HostBatch) -> Staged: ...

    def hand_over(self, staged: Staged) -> Batch: ...

    def synchronize(self) -> None: ...


class CudaStager:
    """The copy stream of one device (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def start(self, key: Key, host: HostBatch) -> Staged:
        with torch.cuda.stream(self.stream):
            dense = host.dense.to(self.device, non_blocking=True)
            sparse = host.sparse.to(self.device, non_blocking=True)
            labels = host.labels.to(self.device, non_blocking=True)
            if sparse.dtype != torch.int64:
                sparse = sparse.to(torch.int64)
            event = torch.cuda.Event()
            event.record(self.stream)
        return Staged(key, Batch(dense, sparse, labels, bags=host.bags), event, host.slot)

    def hand_over(self, staged: Staged) -> Batch:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(staged.event)
        batch = staged.batch
        for t in (batch.dense, batch.sparse, batch.labels):
            t.record_stream(compute)
        return batch

    def synchronize(self) -> None:
        self.stream.synchronize()
