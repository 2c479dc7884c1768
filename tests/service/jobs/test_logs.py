"""Rank labels of log lines (srun --label, torchrun's --tee) and reading a log by offset."""

from __future__ import annotations

from pathlib import Path

from service.jobs.logs import RankFilter, rank_lines, rank_of, read_from

LINES = [
    "dlrm-vrgd: Slurm job 7 on n[1-2]",
    "0: step 10/80 loss 0.6931 auc - 12.0k rows/s",
    "1: RuntimeError: boom",
    "1: [default1]:on node 2, local rank 1",
    "0: [default0]:rank zero",
    "[default1]:local worker 1",
]


def test_a_lines_rank_is_its_task_times_the_ranks_per_node_plus_its_local_rank() -> None:
    assert [rank_of(ln) for ln in LINES[:3]] == [None, 0, 1]
    assert rank_of(LINES[3], nproc_per_node=2) == 3  # task 1 (second node), local rank 1
    assert rank_of(LINES[4], nproc_per_node=2) == 0
    assert rank_of(LINES[5], nproc_per_node=2) == 1
    assert rank_lines(LINES, 1) == [LINES[2], LINES[5]]
    assert rank_lines(LINES, 3, nproc_per_node=2) == [LINES[3]]


def test_the_rank_filter_waits_for_a_lines_end() -> None:
    f = RankFilter(1)
    assert f.feed(b"0: a\n1: b") == b""  # "1: b" is not whole yet
    assert f.feed(b"c\n0: d\n") == b"1: bc\n"
    assert f.feed(b"1: e", final=True) == b"1: e"
    assert RankFilter(None).feed(b"anything") == b"anything"


def test_read_from_returns_whole_lines_of_a_large_read_and_the_next_offset(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    assert read_from(log, 5) == (b"", 5)  # no log yet
    log.write_bytes(b"one\ntwo\nthr")
    assert read_from(log, 0) == (b"one\ntwo\nthr", 11)  # below the limit: all of it
    assert read_from(log, 0, limit=6) == (b"one\n", 4)  # at the limit: up to a line end
    assert read_from(log, 4) == (b"two\nthr", 11)
    assert read_from(log, 11) == (b"", 11) and read_from(log, 40) == (b"", 40)
