"""The input pipeline: the trainer asks for micro-batches by key, the pipeline has the next
ones built ahead.

``get(key)`` returns the micro-batch on the run's device and records how long the caller
waited for it (:attr:`InputPipeline.last_wait_s`). Behind it, ``depth`` keys of the rank's
schedule (:func:`~dlrm_vrgd.data.pipeline.plan.rank_keys`) are in flight at a builder (threads
or worker processes); on CUDA each is built into a pinned slot, and the next one's copy to the
device is issued on the copy stream as soon as it is built, while the step computes the
current one (:mod:`~dlrm_vrgd.data.pipeline.device`). A slot is written again only once the
event after its copy has completed.

A key other than the one expected (a caller that jumps: a resumed run, a test) restarts the
schedule from that key: what was in flight is waited for and dropped. Any key gives the same
rows, whenever and by whomever it is built. ``close`` stops the builder; the pipeline is also
closed when it is garbage-collected or the interpreter exits (no thread or process outlives
it).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from dlrm_vrgd.data.batch import Batch
from dlrm_vrgd.data.pipeline.device import CudaStager, Staged, Stager
from dlrm_vrgd.data.pipeline.plan import InputPlan, Key
from dlrm_vrgd.data.pipeline.slots import HostBatch, Layout, PinnedSlots
from dlrm_vrgd.data.pipeline.threads import BuildFn, InputWorkerError, ThreadBuilder
from dlrm_vrgd.data.rows import Rows

logger = logging.getLogger(__name__)


class Builder(Protocol):
    workers: int

    def submit(self, key: Key, slot: int | None, worker: int) -> None: ...

    def ready(self, key: Key) -> bool: ...

    def wait(self, key: Key) -> HostBatch: ...

    def close(self, timeout: float = 5.0) -> None: ...


def _close(builder: Builder | None) -> None:
    if builder is not None:
        builder.close()


def _filler(pinned: PinnedSlots | None) -> Callable[[Rows, int | None], HostBatch]:
    """A thread's ``fill``: into the pinned slot given with the key, else its own memory."""

    def fill(rows: Rows, slot: int | None) -> HostBatch:
        if slot is None:
            return HostBatch.own(rows)
        assert pinned is not None
        return pinned.fill(slot, rows)

    return fill


class InputPipeline:
    """Micro-batches by key (module docstring).

    ``build(step, group)`` gives a key's rows; ``schedule(key)`` the keys the caller will ask
    for from ``key`` on (``key`` first); ``affinity(key)`` which worker should build it
    (:func:`~dlrm_vrgd.data.pipeline.plan.block_affinity`). ``stager``: how built micro-batches
    reach the device (default: a :class:`CudaStager` on CUDA, none on a CPU); with one, they
    are built into reused slots (pinned on CUDA), whose accounting a test can so drive on a
    CPU."""

    def __init__(
        self,
        build: BuildFn,
        layout: Layout,
        device: torch.device,
        plan: InputPlan,
        schedule: Callable[[Key], Iterator[Key]],
        affinity: Callable[[Key], int] = lambda key: 0,
        stager: Stager | None = None,
    ) -> None:
        self.plan = plan
        self.device = device
        self.layout = layout
        self._build = build
        self._schedule = schedule
        self._affinity = affinity
        self._keys: Iterator[Key] = iter(())
        self._inflight: deque[Key] = deque()
        self._slot_of: dict[Key, int | None] = {}
        self._staged: Staged | _Host | None = None
        self._copying: deque[Staged] = deque()  # issued copies whose slot is not free yet
        self._error: BaseException | None = None
        self.closed = False
        #: Seconds the last :meth:`get` waited for its micro-batch (0 when it was ready).
        self.last_wait_s = 0.0
        self._pinned: PinnedSlots | None = None
        self._stager: Stager | None = None
        self._free: list[int] = []
        self.builder: Builder | None = None
        if plan.builder == "serial":
            return
        if stager is None and device.type == "cuda":
            stager = CudaStager(device)
        if stager is not None:
            self._stager = stager
            # every key in flight, the one staged ahead, the one handed over, one spare
            self._pinned = PinnedSlots(layout, plan.depth + 3, pin=device.type == "cuda")
            self._free = list(range(len(self._pinned)))
        if plan.builder == "processes":
            from dlrm_vrgd.data.pipeline.processes import ProcessBuilder

            self.builder = ProcessBuilder(
                build, layout, plan.workers, plan.depth + 1, pinned=self._pinned
            )
        else:
            # the threads must not hold the pipeline (it would never be collected)
            self.builder = ThreadBuilder(build, _filler(self._pinned), plan.workers)
        self._finalizer = weakref.finalize(self, _close, self.builder)

    # ------------------------------------------------------------------------ get
    def get(self, key: Key) -> Batch:
        """The micro-batch of ``key`` on the device (see the module docstring)."""
        t0 = time.perf_counter()
        if self.closed:
            raise RuntimeError("the input pipeline is closed")
        if self._error is not None:
            raise InputWorkerError(f"the input pipeline failed before: {self._error}")
        if self.builder is None:  # serial: built here, now, as the trainer always did
            batch = Batch.from_rows(self._build(*key)).to(self.device)
        else:
            try:
                batch = self._get(key, self.builder)
            except InputWorkerError as err:
                self._error = err
                raise
        self.last_wait_s = time.perf_counter() - t0
        return batch

    def _get(self, key: Key, builder: Builder) -> Batch:
        if not self._inflight or self._inflight[0] != key:
            self._restart(key)
            self._top_up(builder)
        self._inflight.popleft()
        self._top_up(builder)
        staged, self._staged = self._staged, None
        if staged is None or staged.key != key:
            assert staged is None
            staged = self._stage(key, builder.wait(key))
        batch = self._hand_over(staged)
        if self._stager is not None and self._inflight and builder.ready(self._inflight[0]):
            ahead = self._inflight[0]  # built already: its copy overlaps this micro-batch
            self._staged = self._stage(ahead, builder.wait(ahead))
        return batch

    def _stage(self, key: Key, host: HostBatch) -> Staged | _Host:
        self._slot_of.pop(key, None)
        if self._stager is None:
            return _Host(key, host)
        staged = self._stager.start(key, host)
        self._copying.append(staged)
        return staged

    def _hand_over(self, staged: Staged | _Host) -> Batch:
        if isinstance(staged, _Host):
            h = staged.host
            return Batch(h.dense, h.sparse, h.labels, h.probs, h.bags)
        assert self._stager is not None
        return self._stager.hand_over(staged)

    # --------------------------------------------------------------- the schedule
    def _top_up(self, builder: Builder) -> None:
        while len(self._inflight) < self.plan.depth:
            key = next(self._keys, None)
            if key is None:
                return
            slot = self._take_slot() if self._stager is not None else None
            self._slot_of[key] = slot
            try:
                builder.submit(key, slot, self._affinity(key))
            except BaseException:
                self._give_back(slot)
                raise
            self._inflight.append(key)

    def _restart(self, key: Key) -> None:
        """Drop what is in flight (waiting for it: a slot is never taken from a builder that
        may still write it) and schedule from ``key``."""
        assert self.builder is not None
        if self._inflight:
            logger.debug("input: %s asked for, %s expected: restarting", key, self._inflight[0])
        staged, self._staged = self._staged, None  # its slot comes back with its copy
        while self._inflight:
            old = self._inflight.popleft()
            if staged is not None and old == staged.key:
                continue  # taken from the builder already
            try:
                self.builder.wait(old)
            except InputWorkerError as err:
                logger.debug("input: dropped %s: %s", old, err)
            self._give_back(self._slot_of.pop(old, None))
        self._keys = self._schedule(key)

    # ---------------------------------------------------------------- pinned slots
    def _take_slot(self) -> int:
        self._reclaim(block=False)
        if not self._free:
            self._reclaim(block=True)
        if not self._free:
            raise RuntimeError("input: no pinned slot is free (more keys in flight than slots)")
        return self._free.pop()

    def _reclaim(self, block: bool) -> None:
        """Slots whose copy completed are free again; ``block``: wait for the oldest copy."""
        if block and self._copying:
            self._copying[0].event.synchronize()
        while self._copying and self._copying[0].copied():
            self._give_back(self._copying.popleft().slot)

    def _give_back(self, slot: int | None) -> None:
        if slot is not None:
            self._free.append(slot)

    # ---------------------------------------------------------------------- close
    def close(self) -> None:
        """Stop the builder (threads finish their micro-batch; processes are asked, then
        terminated, then killed) and wait for the copies in flight. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.builder is not None:
            self._finalizer.detach()
            self.builder.close()
        if self._stager is not None:
            self._stager.synchronize()
        self._copying.clear()
        self._staged = None
        self._inflight.clear()

    def __enter__(self) -> InputPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Host:
    """A built micro-batch on a CPU run (nothing to copy)."""

    def __init__(self, key: Key, host: HostBatch) -> None:
        self.key = key
        self.host = host
