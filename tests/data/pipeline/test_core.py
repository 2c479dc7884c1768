"""The input pipeline's scheduling, on a CPU: every key gives its own rows whoever builds it,
the look-ahead stays within ``depth``, a slot is never written while its copy is pending, a
failing or killed worker is named with the key, and nothing outlives ``close``."""

from __future__ import annotations

import gc
import os
import signal
import threading

import pytest

from dlrm_vrgd.data.pipeline import InputWorkerError
from dlrm_vrgd.data.pipeline.slots import PinnedSlots

from .helpers import (
    FakeStager,
    Recorder,
    alive,
    assert_batch_is,
    children,
    key_rows,
    pipeline,
)

BUILDERS = ["serial", "threads", "processes"]
ORDER = [(s, g) for s in range(3) for g in range(4)]


@pytest.mark.parametrize("builder", BUILDERS)
def test_each_key_gives_its_rows_in_order_and_after_jumps(builder: str) -> None:
    with pipeline(Recorder(), builder, workers=2, depth=3) as p:
        for key in ORDER:
            assert_batch_is(p.get(key), key)
        # a caller that jumps back (a test, a resumed run) and forward
        for key in [(0, 1), (0, 2), (2, 3), (1, 0), (1, 1)]:
            assert_batch_is(p.get(key), key)


@pytest.mark.parametrize("builder", ["threads", "processes"])
def test_the_look_ahead_stays_within_depth(builder: str) -> None:
    """After ``get`` of the i-th key, at most ``i + 1 + depth`` keys were ever asked for; after
    ``close`` exactly that many (the ones in flight were finished, none more)."""
    rec = Recorder()
    p = pipeline(rec, builder, workers=2, depth=3)
    for i, key in enumerate(ORDER[:6]):
        p.get(key)
        assert len(rec.calls) <= i + 1 + 3
    p.close()
    assert sorted(rec.calls) == ORDER[: 6 + 3]


def test_the_look_ahead_ends_with_the_run() -> None:
    rec = Recorder()
    with pipeline(rec, "threads", depth=5) as p:
        for key in ORDER:
            p.get(key)
    assert sorted(rec.calls) == ORDER  # nothing past the last step was built


def test_serial_builds_only_what_is_asked_for() -> None:
    rec = Recorder()
    with pipeline(rec, "serial") as p:
        p.get((0, 0))
        p.get((0, 1))
        assert rec.calls == [(0, 0), (0, 1)] and p.last_wait_s > 0


@pytest.mark.parametrize("builder", ["threads", "processes"])
@pytest.mark.parametrize("eager", [False, True])
def test_a_slot_is_written_again_only_after_its_copy(
    builder: str, eager: bool, monkeypatch
) -> None:
    """The copy to the device reads a slot until its event completes (the fake copies late);
    the builder must not write the slot before: checked at every write, and in the rows."""
    stager = FakeStager(eager=eager)
    fill, copy_from = PinnedSlots.fill, PinnedSlots.copy_from

    def checked_fill(self, slot, rows):  # type: ignore[no-untyped-def]
        stager.check_free(slot)
        return fill(self, slot, rows)

    def checked_copy(self, slot, arrays):  # type: ignore[no-untyped-def]
        stager.check_free(slot)
        return copy_from(self, slot, arrays)

    monkeypatch.setattr(PinnedSlots, "fill", checked_fill)
    monkeypatch.setattr(PinnedSlots, "copy_from", checked_copy)
    with pipeline(Recorder(), builder, workers=2, depth=2, stager=stager) as p:
        for key in [*ORDER, (0, 0), (0, 1), *ORDER]:
            assert_batch_is(p.get(key), key)
    assert not stager.violations
    if not eager:  # events complete only when waited for: slots came back that way
        assert stager.waits > 0
    assert len(stager.events) >= 2 * len(ORDER)


def test_a_slot_reused_early_is_caught(monkeypatch) -> None:
    """The check above can fail: a pipeline that frees a slot as soon as the batch is handed
    over (before its copy's event) writes a slot whose copy is pending."""
    import dlrm_vrgd.data.pipeline.core as core

    def early(self, block):  # type: ignore[no-untyped-def]
        while self._copying:
            self._give_back(self._copying.popleft().slot)

    monkeypatch.setattr(core.InputPipeline, "_reclaim", early)
    stager = FakeStager(eager=False)
    fill = PinnedSlots.fill

    def checked_fill(self, slot, rows):  # type: ignore[no-untyped-def]
        stager.check_free(slot)
        return fill(self, slot, rows)

    monkeypatch.setattr(PinnedSlots, "fill", checked_fill)
    with (
        pytest.raises(InputWorkerError, match="written while its copy is still pending"),
        pipeline(Recorder(), "threads", depth=2, stager=stager) as p,
    ):
        for key in ORDER:
            p.get(key)


@pytest.mark.parametrize("builder", ["threads", "processes"])
def test_a_failing_build_names_the_worker_and_the_key(builder: str) -> None:
    p = pipeline(Recorder(fail_at=(1, 2)), builder, workers=1, depth=2)
    for key in ORDER[:6]:
        assert_batch_is(p.get(key), key)
    who = "input thread 0" if builder == "threads" else "input worker 0 (pid "
    with pytest.raises(InputWorkerError) as err:
        p.get((1, 2))
    text = str(err.value)
    assert who in text
    assert "micro-batch (step 1, group 2)" in text and "ValueError: boom" in text
    with pytest.raises(InputWorkerError, match="failed before"):  # it stays failed
        p.get((1, 3))
    p.close()
    if builder == "processes":
        assert not any(alive(pid) for pid in p.builder.pids)  # type: ignore[union-attr]


def _suicide(step: int, group: int):  # type: ignore[no-untyped-def]
    if (step, group) == (1, 0):
        os.kill(os.getpid(), signal.SIGKILL)
    return key_rows(step, group)


def test_a_killed_worker_process_fails_its_key_without_a_hang() -> None:
    p = pipeline(_suicide, "processes", workers=2, depth=2)
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            for key in ORDER:
                p.get(key)
            result.append(None)
        except BaseException as err:
            result.append(err)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive(), "get() hung after a worker died"
    err = result[0]
    assert isinstance(err, InputWorkerError), err
    assert "was killed by SIGKILL" in str(err) and "micro-batch (step 1, group 0)" in str(err)
    p.close()
    assert not any(alive(pid) for pid in p.builder.pids)  # type: ignore[union-attr]


def test_close_and_garbage_collection_leave_no_worker() -> None:
    before = children()
    p = pipeline(Recorder(), "processes", workers=2, depth=4)
    p.get((0, 0))
    pids = set(p.builder.pids)  # type: ignore[union-attr]
    assert pids <= children() and len(pids) == 2
    p.close()
    assert not pids & children() and not any(alive(pid) for pid in pids)
    p.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        p.get((0, 1))

    q = pipeline(Recorder(), "processes", workers=2, depth=4)
    q.get((0, 0))
    pids = set(q.builder.pids)  # type: ignore[union-attr]
    del q  # never closed: its finalizer stops the workers
    gc.collect()
    assert not any(alive(pid) for pid in pids)
    assert children() <= before


def test_an_unclosed_thread_pipeline_lets_its_threads_go() -> None:
    def input_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("dlrm-vrgd-input")}

    before = input_threads()
    p = pipeline(Recorder(), "threads", workers=3, depth=3)
    p.get((0, 0))
    mine = input_threads() - before
    assert len(mine) == 3
    del p  # never closed: its finalizer stops the threads (they do not hold the pipeline)
    gc.collect()
    for t in mine:
        t.join(10)
    assert not any(t.is_alive() for t in mine)
