"""The sink group and the worker thread: trackers never fail a run, and fail loudly once."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from dlrm_vrgd.tracking.sink import Sink, Sinks, Worker


class Recording(Sink):
    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_on = fail_on
        self.closed = False

    def _call(self, what: str, arg: Any) -> None:
        if what == self.fail_on:
            raise OSError(f"{what} broke")
        self.calls.append((what, arg))

    def start(self, record: dict[str, Any]) -> None:
        self._call("start", record)

    def metrics(self, record: dict[str, Any]) -> None:
        self._call("metrics", record)

    def gsnr(self, record: dict[str, Any]) -> None:
        self._call("gsnr", record)

    def close(self) -> None:
        self.closed = True


def test_a_failing_tracker_is_dropped_and_the_rest_go_on(caplog) -> None:
    strict, broken, fine = Recording(), Recording(fail_on="metrics"), Recording()
    sinks = Sinks([strict], [broken, fine])
    with caplog.at_level(logging.WARNING):
        sinks.start({"step": 0})
        for step in (1, 2):
            sinks.metrics({"step": step})
        sinks.gsnr({"step": 2})
        sinks.close()
    assert strict.calls == fine.calls  # the same records, stamped once for every sink

    def unstamped(calls: list[Any]) -> list[Any]:
        return [(kind, {k: v for k, v in r.items() if k != "wall_time"}) for kind, r in calls]

    assert unstamped(strict.calls) == [
        ("start", {"step": 0}),
        ("metrics", {"step": 1}),
        ("metrics", {"step": 2}),
        ("gsnr", {"step": 2}),
    ]
    assert unstamped(broken.calls) == [("start", {"step": 0})] and broken.closed
    assert len([r for r in caplog.records if "metrics broke" in r.getMessage()]) == 1


def test_records_are_stamped_with_their_wall_time_once() -> None:
    """Sinks add ``wall_time`` (Unix seconds, ms) to a record without one; a record that has
    one (a rebuilt or replayed record) keeps it; the caller's dict is not changed."""
    got = Recording()
    sinks = Sinks([got])
    record = {"step": 1}
    before = time.time()
    sinks.metrics(record)
    sinks.gsnr({"step": 1, "wall_time": 12.5})
    after = time.time()
    assert record == {"step": 1}
    (_, first), (_, second) = got.calls
    assert round(before, 3) - 0.001 <= first["wall_time"] <= round(after, 3) + 0.001
    assert first["wall_time"] == round(first["wall_time"], 3)
    assert second == {"step": 1, "wall_time": 12.5}


def test_a_failing_run_directory_fails_the_run() -> None:
    sinks = Sinks([Recording(fail_on="gsnr")], [Recording()])
    with pytest.raises(OSError, match="gsnr broke"):
        sinks.gsnr({"step": 1})


def test_worker_runs_calls_in_order_off_the_caller_s_thread_and_fails_once(caplog) -> None:
    seen: list[tuple[int, str]] = []

    def call(i: int) -> None:
        if i == 3:
            raise RuntimeError("server gone")
        seen.append((i, threading.current_thread().name))

    worker = Worker("test tracker")
    with caplog.at_level(logging.WARNING):
        for i in range(6):
            worker.submit(call, i)
        closed: list[bool] = []
        worker.submit_always(closed.append, True)  # runs after the failure too
        assert worker.wait(10)
        worker.stop(10)
    assert [i for i, _ in seen] == [0, 1, 2]  # after the failure: dropped
    assert {name for _, name in seen} == {"dlrm-vrgd-test tracker"}
    assert closed == [True]
    assert isinstance(worker.failed, RuntimeError)
    assert len([r for r in caplog.records if "server gone" in r.getMessage()]) == 1
