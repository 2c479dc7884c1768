"""srun's task labels of log lines (``srun --label``: ``1: ...``) and reading a log by offset.
The filter is by srun task (one per node under Slurm), never by training rank: which task
hosts which training rank is up to torchrun's rendezvous, and the log does not say."""

from __future__ import annotations

from pathlib import Path

from service.jobs.logs import TaskFilter, read_from, task_lines, task_of

LINES = [
    "dlrm-vrgd: Slurm job 7 on n[1-2]",
    "0: step 10/80 loss 0.6931 auc - 12.0k rows/s",
    "1: RuntimeError: boom",
    "1: [rank0]: RuntimeError: training rank 0 runs on task 1 here",
    "0: [default0]:torchrun's own label (its local rank) inside task 0",
    "[default1]:local worker 1, no task",
    "[rank1]: a training rank's error under the local backend, no task",
]


def test_a_lines_task_is_srun_label_whatever_rank_label_follows() -> None:
    assert [task_of(ln) for ln in LINES] == [None, 0, 1, 1, 0, None, None]
    assert task_lines(LINES, 1) == [LINES[2], LINES[3]]
    assert task_lines(LINES, 0) == [LINES[1], LINES[4]]
    assert task_lines(LINES, 2) == []


def test_the_task_filter_waits_for_a_lines_end() -> None:
    f = TaskFilter(1)
    assert f.feed(b"0: a\n1: b") == b""  # "1: b" is not whole yet
    assert f.feed(b"c\n0: d\n1: [rank0]: e\n") == b"1: bc\n1: [rank0]: e\n"
    assert f.feed(b"1: e", final=True) == b"1: e"
    assert TaskFilter(None).feed(b"anything") == b"anything"


def test_read_from_returns_whole_lines_of_a_large_read_and_the_next_offset(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    assert read_from(log, 5) == (b"", 5)  # no log yet
    log.write_bytes(b"one\ntwo\nthr")
    assert read_from(log, 0) == (b"one\ntwo\nthr", 11)  # below the limit: all of it
    assert read_from(log, 0, limit=6) == (b"one\n", 4)  # at the limit: up to a line end
    assert read_from(log, 4) == (b"two\nthr", 11)
    assert read_from(log, 11) == (b"", 11) and read_from(log, 40) == (b"", 40)
