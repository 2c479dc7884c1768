"""``service.jobs.reading``: what a job's directory may hold instead of a file (a link to a
host file or to /dev/zero, a FIFO, a link on the way, a directory), refused with
:class:`JobFileError` naming it; regular files read within their bounds."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from service.errors import Unavailable
from service.jobs import reading
from service.jobs.reading import JobFileError


@pytest.fixture
def job(tmp_path: Path) -> Path:
    root = tmp_path / "jobs" / "0123456789abcdef"
    (root / "run").mkdir(parents=True)
    (tmp_path / "host.txt").write_text("HOST-SECRET\n")
    return root


@pytest.mark.parametrize(
    ("plant", "why"),
    [
        ("link", "a symbolic link"),
        ("dev-zero", "a symbolic link"),
        ("fifo", "a FIFO"),
        ("dir", "a directory"),
        ("run-link", "run is a link or not a directory"),
    ],
)
def test_anything_but_a_regular_file_is_refused(job: Path, plant: str, why: str) -> None:
    path = job / "run" / "result.json"
    if plant == "link":
        path.symlink_to(job.parent.parent / "host.txt")
    elif plant == "dev-zero":
        path.symlink_to("/dev/zero")
    elif plant == "fifo":
        os.mkfifo(path)
    elif plant == "dir":
        path.mkdir()
    else:
        (job / "run").rmdir()
        (job.parent.parent / "elsewhere").mkdir()
        (job.parent.parent / "elsewhere" / "result.json").write_text("{}")
        (job / "run").symlink_to(job.parent.parent / "elsewhere")
    for read in (
        lambda: reading.read_json(path, job),
        lambda: reading.read_tail(path, 100, job),
        lambda: reading.read_range(path, 0, 100, job),
    ):
        with pytest.raises(JobFileError, match=why) as err:
            read()
        assert "run/result.json" in err.value.message and "HOST-SECRET" not in err.value.message


def test_regular_files_are_read_within_bounds(job: Path) -> None:
    path = job / "train.log"
    path.write_bytes(b"0123456789")
    assert reading.read_tail(path, 4, job) == b"6789"
    assert reading.read_range(path, 3, 4, job) == (b"3456", 10)
    assert reading.read_range(path, 20, 4, job) == (b"", 10)
    assert reading.read_bytes(path, 10, job) == b"0123456789"
    with pytest.raises(JobFileError, match="over 9 bytes"):
        reading.read_bytes(path, 9, job)
    assert reading.read_json(job / "run" / "missing.json", job) is None
    assert reading.read_tail(job / "nothing.log", 4, job) == b""


def test_a_log_opened_for_writing_never_follows_a_link(job: Path) -> None:
    host = job.parent.parent / "host.txt"
    (job / "train.log").symlink_to(host)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    with pytest.raises(JobFileError, match="a symbolic link"):
        reading.open_in(job / "train.log", flags=flags)
    os.unlink(job / "train.log")
    os.mkfifo(job / "train.log")  # no reader: a blocking open would wait forever
    with pytest.raises(JobFileError, match="not a regular file"):
        reading.open_in(job / "train.log", flags=flags)
    assert host.read_text() == "HOST-SECRET\n"


def test_a_read_past_its_deadline_answers_and_frees_the_caller() -> None:
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(Unavailable, match="took over 0.2 s"):
        reading.bounded(0.2, release.wait, 30)
    assert time.monotonic() - start < 10
    release.set()
    assert reading.bounded(5, lambda: 7) == 7
