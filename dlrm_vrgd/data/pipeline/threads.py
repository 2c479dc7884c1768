"""Builders of micro-batches in the background: what they share (results by key, errors that
name the worker and the key) and the thread builder.

A builder takes ``submit(key, slot, worker)`` and answers ``wait(key)`` with the built
:class:`~dlrm_vrgd.data.pipeline.slots.HostBatch`, in whatever order its workers finish.
A worker that fails raises :class:`InputWorkerError` from ``wait`` of that key; one that died
fails every key it held. ``close`` stops the workers and never hangs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dlrm_vrgd.data.pipeline.plan import Key
from dlrm_vrgd.data.pipeline.slots import HostBatch
from dlrm_vrgd.data.rows import Rows

logger = logging.getLogger(__name__)

#: Rows of one key: ``build(step, group)`` (:meth:`~dlrm_vrgd.data.batch.TrainStream.rows`).
BuildFn = Callable[[int, int], Rows]
#: A built micro-batch from its rows and the pinned slot given with its key (None: its own
#: memory).
FillFn = Callable[[Rows, int | None], HostBatch]
#: A wait for input says so in the log every this many seconds.
SLOW_WAIT_S = 60.0


class InputWorkerError(RuntimeError):
    """A worker of the input pipeline failed; the message names it and the micro-batch."""


def where(key: Key) -> str:
    return f"micro-batch (step {key[0]}, group {key[1]})"


@dataclass
class Failure:
    """What ``wait`` raises for a key: the message, and the exception when it is one of this
    process (a thread's), to chain."""

    message: str
    cause: BaseException | None = None

    def error(self) -> InputWorkerError:
        err = InputWorkerError(self.message)
        err.__cause__ = self.cause
        return err


class Results:
    """Built micro-batches (or failures) by key, handed from the workers to ``wait``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._done: dict[Key, HostBatch | Failure] = {}
        self._cond = threading.Condition()
        self.closed = False

    def put(self, key: Key, result: HostBatch | Failure) -> None:
        with self._cond:
            self._done[key] = result
            self._cond.notify_all()

    def ready(self, key: Key) -> bool:
        with self._cond:
            return key in self._done

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def take(self, key: Key, check: Callable[[], Failure | None]) -> HostBatch:
        """Wait for ``key``'s result; ``check`` is asked every second (and at each wake-up)
        for a failure that stops the wait (a dead worker)."""
        started = warned = time.monotonic()
        with self._cond:
            while key not in self._done:
                if self.closed:
                    raise InputWorkerError(f"{self.name}: closed while waiting for {where(key)}")
                failure = check()
                if failure is not None:
                    self._done[key] = failure
                    break
                self._cond.wait(timeout=1.0)
                now = time.monotonic()
                if now - warned >= SLOW_WAIT_S:
                    warned = now
                    logger.warning("%s: waited %.0f s for %s", self.name, now - started, where(key))
            result = self._done.pop(key)
        if isinstance(result, Failure):
            raise result.error()
        return result


class ThreadBuilder:
    """``workers`` threads, each with its own queue of keys (so a worker keeps the keys of the
    source blocks it already read). For sources whose reads release the GIL: numpy copies
    out of memory maps (npy days), large numpy operations."""

    def __init__(self, build: BuildFn, fill: FillFn, workers: int) -> None:
        self.workers = workers
        self._build, self._fill = build, fill
        self._results = Results("input threads")
        self._queues: list[queue.SimpleQueue[tuple[Key, int | None] | None]] = [
            queue.SimpleQueue() for _ in range(workers)
        ]
        self._owner: dict[Key, int] = {}
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"dlrm-vrgd-input-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _run(self, index: int) -> None:
        tasks = self._queues[index]
        while (item := tasks.get()) is not None:
            key, slot = item
            try:
                result: HostBatch | Failure = self._fill(self._build(*key), slot)
            except BaseException as err:  # handed to wait(), which raises it
                result = Failure(
                    f"input thread {index} failed building {where(key)}: "
                    f"{type(err).__name__}: {err}",
                    err,
                )
            self._results.put(key, result)

    def submit(self, key: Key, slot: int | None, worker: int) -> None:
        index = worker % self.workers
        self._owner[key] = index
        self._queues[index].put((key, slot))

    def ready(self, key: Key) -> bool:
        return self._results.ready(key)

    def wait(self, key: Key) -> HostBatch:
        index = self._owner.pop(key, 0)

        def check() -> Failure | None:
            if self._threads[index].is_alive():
                return None
            return Failure(f"input thread {index} is gone; it held {where(key)}")

        return self._results.take(key, check)

    def close(self, timeout: float = 5.0) -> None:
        """Ask every thread to stop after its current micro-batch and wait up to ``timeout``
        seconds for them (daemon threads: one still reading does not hold the process)."""
        self._results.closed = True
        self._results.notify()
        for q in self._queues:
            q.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
