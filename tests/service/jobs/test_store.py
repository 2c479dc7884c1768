"""The SQLite store: jobs, conditional transitions, records, downsampling, persistence."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from service.jobs.states import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED
from service.jobs.store import Store, pick_indices


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "service.db")
    yield s
    s.close()


def _records(n: int) -> list[dict]:
    out = []
    for step in range(1, n + 1):
        out.append({"kind": "train", "step": step, "loss": 1.0 / step})
        if step % 5 == 0:
            out.append({"kind": "eval", "split": "val", "step": step, "auc": 0.5 + step / 1000})
    return out


def test_jobs_move_through_legal_transitions_only(store: Store) -> None:
    job = store.create_job("a" * 16, "first", "train", {"run": {}}, None)
    assert job.state == QUEUED and job.progress == {}
    assert store.transition(job.id, [RUNNING], SUCCEEDED) is None  # not running yet
    running = store.transition(job.id, [QUEUED], RUNNING, pid=123)
    assert running is not None and running.state == RUNNING and running.pid == 123
    assert store.transition(job.id, [QUEUED], CANCELLED) is None  # lost the race
    done = store.transition(job.id, [RUNNING], FAILED, "boom", error="exit status 1")
    assert done is not None and done.error == "exit status 1"
    with pytest.raises(ValueError):
        store.transition(job.id, [FAILED], RUNNING)
    states = [json.loads(d) for _, stream, d in store.records_after(job.id, 0, 100)]
    assert [(s["seq"], s["state"], s["message"]) for s in states] == [
        (1, QUEUED, None),
        (2, RUNNING, None),
        (3, FAILED, "boom"),
    ]


def test_concurrent_transitions_have_exactly_one_winner(store: Store) -> None:
    job = store.create_job("b" * 16, "race", "train", {}, None)
    wins: list[object] = []

    def attempt(to: str) -> None:
        wins.append(store.transition(job.id, [QUEUED], to))

    threads = [threading.Thread(target=attempt, args=(s,)) for s in [RUNNING, CANCELLED] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(w is not None for w in wins) == 1


def test_ingest_is_atomic_with_offsets_and_survives_reopening(tmp_path: Path) -> None:
    store = Store(tmp_path / "service.db")
    job = store.create_job("c" * 16, "ingest", "train", {}, None)
    added = store.ingest(job.id, _records(10), 500, [{"step": 1, "tables": []}], 40, {"step": 10})
    assert added == 13
    store.close()
    again = Store(tmp_path / "service.db")
    got = again.get_job(job.id)
    assert got is not None and (got.metrics_offset, got.gsnr_offset) == (500, 40)
    assert got.progress == {"step": 10}
    series = again.series(job.id, "metrics")
    rows = [json.loads(d) for d in series.data]
    assert len(rows) == 12 and rows[0]["seq"] == 2 and rows[0]["loss"] == 1.0
    assert [json.loads(d)["step"] for d in again.series(job.id, "gsnr").data] == [1]
    again.close()


def test_series_filters_pages_and_downsamples_each_series_apart(store: Store) -> None:
    job = store.create_job("d" * 16, "series", "train", {}, None)
    store.ingest(job.id, _records(100), 1, [], 0, None)
    evals = [json.loads(d) for d in store.series(job.id, "metrics", kind="eval").data]
    assert [e["step"] for e in evals] == list(range(5, 101, 5))
    sampled = [json.loads(d) for d in store.series(job.id, "metrics", max_points=5).data]
    train = [r["step"] for r in sampled if r["kind"] == "train"]
    val = [r["step"] for r in sampled if r["kind"] == "eval"]
    assert train == [1, 26, 51, 75, 100] and val[0] == 5 and val[-1] == 100 and len(val) == 5
    every = [
        json.loads(d)["step"] for d in store.series(job.id, "metrics", kind="train", every=10).data
    ]
    assert every == list(range(1, 101, 10))
    page = store.series(job.id, "metrics", limit=7)
    assert len(page.data) == 7 and page.next_after == json.loads(page.data[-1])["seq"]
    rest = store.series(job.id, "metrics", after=page.next_after, limit=1000)
    assert rest.next_after is None and len(page.data) + len(rest.data) == 120


def test_pick_indices_keeps_first_and_last() -> None:
    assert pick_indices(10) == list(range(10))
    assert pick_indices(10, max_points=3) == [0, 4, 9]
    assert pick_indices(10, every=3) == [0, 3, 6, 9]
    assert pick_indices(10, every=3, max_points=2) == [0, 9]
    assert pick_indices(5, max_points=1) == [4]
    assert pick_indices(0, every=2, max_points=2) == []


def test_list_delete_and_counts(store: Store) -> None:
    a = store.create_job("e" * 16, "alpha", "train", {}, None)
    b = store.create_job("f" * 16, "beta", "train", {}, None)
    store.ingest(a.id, _records(3), 1, [], 0, None)
    jobs, count = store.list_jobs()
    assert count == 2 and [j.id for j in jobs] == [b.id, a.id]
    assert store.next_queued().id == a.id  # FIFO
    assert store.next_queued(exclude=[a.id]).id == b.id
    assert store.delete_job(a.id, [SUCCEEDED]) is False
    store.transition(a.id, [QUEUED], CANCELLED)
    assert store.delete_job(a.id, [CANCELLED]) is True
    assert store.delete_job(a.id, [CANCELLED]) is None
    assert store.records_after(a.id, 0, 100) == []
    assert store.count_by_state() == {QUEUED: 1}
