"""The process builder: forked worker processes write micro-batches into shared slots.

Each worker is forked from the trainer (Linux), so it inherits the open row source (memory
maps, the synthetic teacher) without pickling it, and runs numpy only, never torch. It reads
``(key, slot)`` from its own pipe, writes the rows into the shared slot (ids as int32) and
answers ``(key, slot, error)`` on another. A collector thread in the trainer copies each answer
out of its shared slot (into a pinned slot for the GPU, or into memory of its own on a CPU),
hands the shared slot back, and wakes ``wait``.

No orphans: a worker ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the
trainer decides), dies with the trainer (``PR_SET_PDEATHSIG``, so even a SIGKILLed trainer
leaves none), and :meth:`ProcessBuilder.close` asks, then terminates, then kills. A worker that
dies fails the keys it held, naming itself, its exit code and the key.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from typing import Any

from dlrm_vrgd.data.pipeline.plan import Key
from dlrm_vrgd.data.pipeline.slots import HostBatch, Layout, PinnedSlots, SharedSlots
from dlrm_vrgd.data.pipeline.threads import BuildFn, Failure, InputWorkerError, Results, where

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent exits (Linux ``prctl``); exit now if it already
    did."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)


def _worker(
    index: int,
    build: BuildFn,
    shared: SharedSlots,
    tasks: Connection,
    answers: Connection,
    parent: int,
    inherited: list[Connection],
) -> None:
    """A worker process's loop (runs in the forked child)."""
    for conn in inherited:  # the trainer's ends of every pipe, inherited by the fork
        conn.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent)
    while True:
        try:
            message = tasks.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        key, slot = message
        try:
            shared.fill(slot, build(*key))
            answers.send((key, slot, None))
        except Exception as err:
            text = f"{type(err).__name__}: {err}"
            answers.send((key, slot, (text, traceback.format_exc())))


def _exit_text(code: int | None) -> str:
    if code is None:
        return "is gone"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ProcessBuilder:
    """``workers`` forked worker processes (module docstring) with ``slots`` shared slots
    (at least the keys in flight plus one). With ``pinned``, answers are copied into the
    pinned slot given with each key; without, into memory of their own (ids int64)."""

    def __init__(
        self,
        build: BuildFn,
        layout: Layout,
        workers: int,
        slots: int,
        pinned: PinnedSlots | None = None,
    ) -> None:
        self.workers = workers
        self._shared = SharedSlots(layout, slots)
        self._pinned = pinned
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(slots):
            self._free.put(i)
        self._results = Results("input worker processes")
        self._owner: dict[Key, int] = {}  # keys submitted and not yet answered -> worker
        self._out: dict[Key, int | None] = {}  # key -> the pinned slot it goes to
        self._dead: dict[int, Failure] = {}
        self._lock = threading.Lock()
        self._stopping = False
        ctx = mp.get_context("fork")
        self._tasks: list[Connection] = []
        self._answers: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(workers):
            task_r, task_w = ctx.Pipe(duplex=False)
            answer_r, answer_w = ctx.Pipe(duplex=False)
            inherited = [*self._tasks, *self._answers, task_w, answer_r]
            proc = ctx.Process(
                target=_worker,
                args=(i, build, self._shared, task_r, answer_w, os.getpid(), inherited),
                name=f"dlrm-vrgd-input-{i}",
                daemon=True,
            )
            proc.start()
            task_r.close()
            answer_w.close()
            self._tasks.append(task_w)
            self._answers.append(answer_r)
            self.procs.append(proc)
        #: the workers' pids (kept: a closed process object no longer tells)
        self.pids: list[int] = [int(p.pid) for p in self.procs]
        logger.info("input: %d worker process(es), pids %s", workers, self.pids)
        self._collector = threading.Thread(
            target=self._collect, name="dlrm-vrgd-input-collector", daemon=True
        )
        self._collector.start()

    # ------------------------------------------------------------------ the collector
    def _collect(self) -> None:
        readers = {conn: i for i, conn in enumerate(self._answers)}
        sentinels = {p.sentinel: i for i, p in enumerate(self.procs)}
        while not self._stopping and (readers or sentinels):
            try:
                ready = wait_any([*readers, *sentinels], timeout=0.5)
            except (OSError, ValueError):  # closed under us by close()
                return
            for r in ready:
                if r in readers:
                    self._drain(r, readers)
                elif r in sentinels:
                    i = sentinels.pop(r)  # type: ignore[index]
                    conn = self._answers[i]
                    if conn in readers:
                        self._drain(conn, readers)  # what it answered before it died
                    if not self._stopping:
                        self._worker_died(i)

    def _drain(self, conn: Connection, readers: dict[Connection, int]) -> None:
        try:
            while conn.poll():
                key, slot, error = conn.recv()
                self._deliver(readers[conn], key, slot, error)
        except (EOFError, OSError):
            readers.pop(conn, None)

    def _deliver(self, worker: int, key: Key, slot: int, error: Any) -> None:
        with self._lock:
            self._owner.pop(key, None)
            out = self._out.pop(key, None)
        result: HostBatch | Failure
        if error is not None:
            text, trace = error
            logger.error("input worker %d's traceback:\n%s", worker, trace)
            result = Failure(
                f"input worker {worker} (pid {self.pids[worker]}) failed building "
                f"{where(key)}: {text}"
            )
        else:
            try:
                if self._pinned is not None and out is not None:
                    result = self._pinned.copy_from(out, self._shared.arrays(slot))
                else:
                    result = self._shared.own(slot)
            except Exception as err:  # the collector goes on; wait() raises it
                result = Failure(f"input: copying {where(key)} out of its shared slot: {err}", err)
        self._free.put(slot)
        self._results.put(key, result)

    def _worker_died(self, index: int) -> None:
        proc = self.procs[index]
        proc.join(2.0)  # its pipes close before the kernel lets it be reaped: wait that moment
        with self._lock:
            held = [k for k, w in self._owner.items() if w == index]
            message = f"input worker {index} (pid {self.pids[index]}) {_exit_text(proc.exitcode)}"
            self._dead[index] = Failure(message)
        logger.error("%s%s", message, f" while building {where(held[0])}" if held else "")
        for key in held:
            self._results.put(key, Failure(f"{message} while building {where(key)}"))

    # ----------------------------------------------------------------- the consumer
    def submit(self, key: Key, slot: int | None, worker: int) -> None:
        index = worker % self.workers
        shared = self._free_slot()
        with self._lock:  # with _worker_died's: a key is either refused here or failed there
            dead = self._dead.get(index)
            if dead is None:
                self._owner[key] = index
                self._out[key] = slot
        if dead is not None:
            self._free.put(shared)
            raise dead.error()
        try:
            self._tasks[index].send((key, shared))
        except OSError:  # its pipe is closed: the worker is gone
            self._free.put(shared)
            raise InputWorkerError(
                f"input worker {index} (pid {self.pids[index]}) "
                f"{_exit_text(self.procs[index].exitcode)}; it was to build {where(key)}"
            ) from None

    def _free_slot(self) -> int:
        while True:
            try:
                return self._free.get(timeout=1.0)
            except queue.Empty:
                if not self._collector.is_alive():
                    gone = "input worker processes: the collector is gone"
                    raise InputWorkerError(gone) from None

    def ready(self, key: Key) -> bool:
        return self._results.ready(key)

    def wait(self, key: Key) -> HostBatch:
        def check() -> Failure | None:
            if not self._collector.is_alive() and not self._results.ready(key):
                return Failure(f"input worker processes: the collector is gone; {where(key)}")
            return None

        return self._results.take(key, check)

    def close(self, timeout: float = 5.0) -> None:
        """Stop every worker: ask (end of its pipe), then SIGTERM, then SIGKILL; all within
        about ``timeout`` seconds, and reap them."""
        if self._stopping:
            return
        self._stopping = True
        self._results.closed = True
        self._results.notify()
        for conn in self._tasks:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + timeout / 2
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + timeout / 2
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        self._collector.join(2.0)
        for conn in (*self._tasks, *self._answers):
            conn.close()
        for proc in self.procs:
            if proc.exitcode is not None:
                proc.close()
        self._shared.close()
