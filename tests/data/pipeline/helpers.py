"""A row source whose rows name their key, a fake copy stream, and child processes from /proc."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from dlrm_vrgd.data.batch import Batch
from dlrm_vrgd.data.pipeline import InputPipeline, InputPlan, Layout, rank_keys
from dlrm_vrgd.data.pipeline.device import Staged
from dlrm_vrgd.data.pipeline.slots import HostBatch
from dlrm_vrgd.data.rows import Rows

LAYOUT = Layout(rows=8, num_dense=3, num_tables=2)


def key_rows(step: int, group: int, layout: Layout = LAYOUT) -> Rows:
    """Rows that say which key they belong to: id 0 = 1000·step + group, id 1 = the row."""
    b = layout.rows
    sparse = np.empty((b, layout.num_tables), dtype=np.int64)
    sparse[:, 0] = 1000 * step + group
    sparse[:, 1:] = np.arange(b)[:, None]
    dense = (sparse[:, :1] + np.arange(layout.num_dense) / 10).astype(np.float32)
    labels = ((np.arange(b) + step + group) % 2).astype(np.float32)
    return Rows(dense=dense, sparse=sparse, labels=labels)


class Recorder:
    """``build``: :func:`key_rows`, remembering the keys asked for, in any thread or forked
    process (shared memory made before the fork)."""

    def __init__(self, fail_at: tuple[int, int] | None = None, capacity: int = 512) -> None:
        ctx = mp.get_context("fork")
        self._keys = ctx.Array("q", 2 * capacity)  # with its own lock
        self._count = ctx.Value("q", 0, lock=False)
        self.fail_at = fail_at

    @property
    def calls(self) -> list[tuple[int, int]]:
        with self._keys.get_lock():
            n = self._count.value
            flat = list(self._keys[: 2 * n])
        return [(flat[2 * i], flat[2 * i + 1]) for i in range(n)]

    def __call__(self, step: int, group: int) -> Rows:
        with self._keys.get_lock():
            n = self._count.value
            self._keys[2 * n], self._keys[2 * n + 1] = step, group
            self._count.value = n + 1
        if (step, group) == self.fail_at:
            raise ValueError(f"boom at {step}/{group}")
        return key_rows(step, group)


def assert_batch_is(batch: Batch, key: tuple[int, int]) -> None:
    rows = key_rows(*key)
    assert batch.sparse.dtype == torch.int64, batch.sparse.dtype
    torch.testing.assert_close(batch.sparse, torch.from_numpy(rows.sparse), rtol=0, atol=0)
    torch.testing.assert_close(batch.dense, torch.from_numpy(rows.dense), rtol=0, atol=0)
    torch.testing.assert_close(batch.labels, torch.from_numpy(rows.labels), rtol=0, atol=0)


def pipeline(
    build: Callable[[int, int], Rows],
    builder: str,
    workers: int = 1,
    depth: int = 2,
    accumulation: int = 4,
    total_steps: int = 3,
    stager: object = None,
) -> InputPipeline:
    plan = InputPlan(builder, workers if builder != "serial" else 1, depth)

    def schedule(key: tuple[int, int]) -> Iterator[tuple[int, int]]:
        return rank_keys(key, 0, accumulation, total_steps)

    return InputPipeline(
        build,
        LAYOUT,
        torch.device("cpu"),
        plan,
        schedule,
        affinity=lambda key: key[0] * accumulation + key[1],
        stager=stager,  # type: ignore[arg-type]
    )


class FakeEvent:
    """A copy's event that completes late: only when the host waits for it (``synchronize``),
    or, with ``eager``, once the step has been handed the batch. The copy itself reads the
    host slot when it completes or when the step needs the data, whichever comes first, as a
    DMA may read a pinned buffer at any time until its event completes."""

    def __init__(self, copy: Callable[[], None], eager: bool) -> None:
        self._copy = copy
        self.eager = eager
        self.done = False
        self.handed = False
        self.copied = False
        self.waited = False  # the host blocked on it

    def run_copy(self) -> None:
        if not self.copied:
            self._copy()
            self.copied = True

    def query(self) -> bool:
        if self.eager and self.handed:
            self.run_copy()
            self.done = True
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.run_copy()
        self.done = True


class FakeStager:
    """A CPU stand-in for :class:`~dlrm_vrgd.data.pipeline.device.CudaStager` that checks the
    pipeline's account of the slots: a slot written while its last copy is still pending
    fails (:meth:`check_free`), and the copy reads the slot late (:class:`FakeEvent`)."""

    def __init__(self, eager: bool = False) -> None:
        self.eager = eager
        self.last: dict[int, FakeEvent] = {}
        self.events: list[FakeEvent] = []
        self.syncs = 0
        self.violations: list[int] = []

    @property
    def waits(self) -> int:
        """Copies the pipeline blocked on (to free their slot)."""
        return sum(e.waited for e in self.events)

    def check_free(self, slot: int) -> None:
        event = self.last.get(slot)
        if event is not None and not event.done:
            self.violations.append(slot)
            raise AssertionError(f"slot {slot} written while its copy is still pending")

    def start(self, key: tuple[int, int], host: HostBatch) -> Staged:
        b = LAYOUT
        out = Batch(
            torch.empty(b.rows, b.num_dense),
            torch.empty(b.rows, b.num_tables, dtype=torch.int64),
            torch.empty(b.rows),
        )

        def copy() -> None:
            out.dense.copy_(host.dense)
            out.sparse.copy_(host.sparse)  # widened to int64, as on the device
            out.labels.copy_(host.labels)

        event = FakeEvent(copy, self.eager)
        assert host.slot is not None and host.sparse.dtype == torch.int32
        self.last[host.slot] = event
        self.events.append(event)
        return Staged(key, out, event, host.slot)

    def hand_over(self, staged: Staged) -> Batch:
        event = staged.event
        assert isinstance(event, FakeEvent)
        event.run_copy()  # the step reads the data now
        event.handed = True
        return staged.batch

    def synchronize(self) -> None:
        self.syncs += 1
        for event in self.events:
            event.run_copy()
            event.done = True


def children(pid: int | None = None) -> set[int]:
    """Living children of ``pid`` (default: this process), from /proc."""
    pid = os.getpid() if pid is None else pid
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            text = (task / "children").read_text()
        except OSError:
            continue
        out |= {int(c) for c in text.split()}
    return {c for c in out if alive(c)}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
