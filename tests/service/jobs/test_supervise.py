"""``service.jobs.supervise``: the child's output reaches the log line by line with the
environment's secret values masked, progress redraws pass, and a planted exit file (a link,
a FIFO) is not read."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from service.jobs import supervise

SECRET = "hunter2-secret-pw"


def copied(chunks: list[bytes], hold: int = 1 << 20) -> bytes:
    r, w = os.pipe()
    out_r, out_w = os.pipe()
    got: list[bytes] = []
    reader = threading.Thread(
        target=lambda: got.append(b"".join(iter(lambda: os.read(out_r, 1 << 16), b"")))
    )
    reader.start()
    copier = threading.Thread(target=supervise.copy_masked, args=(r, out_w, hold))
    copier.start()
    for chunk in chunks:
        os.write(w, chunk)
    os.close(w)
    copier.join()
    os.close(out_w)
    reader.join()
    os.close(r)
    os.close(out_r)
    return got[0]


def test_secrets_are_masked_across_reads_and_lines_pass_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)
    half = len(SECRET) // 2
    out = copied([b"step 1\rstep 2\r", b"error: " + SECRET[:half].encode(),
                  SECRET[half:].encode() + b" denied\n", b"last without newline"])  # fmt: skip
    assert out == b"step 1\rstep 2\rerror: *** denied\nlast without newline"


def test_a_line_longer_than_the_hold_passes_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)
    out = copied([b"x" * 5000 + b"\n" + SECRET.encode() + b"\n"], hold=1024)
    assert out == b"x" * 5000 + b"\n***\n"


def test_the_log_of_a_supervised_job_is_masked(tmp_path: Path) -> None:
    exit_file = tmp_path / "exit.json"
    cmd = supervise.wrap([sys.executable, "-c", f"print('token={SECRET}', flush=True)"], exit_file)
    with (tmp_path / "train.log").open("wb") as log:
        env = {**os.environ, "MLFLOW_TRACKING_PASSWORD": SECRET}
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=60)
    assert code.returncode == 0
    assert (tmp_path / "train.log").read_text() == "token=***\n"
    assert supervise.read_exit_code(exit_file) == 0


@pytest.mark.parametrize("plant", ["link", "fifo", "big"])
def test_a_planted_exit_file_is_not_read(tmp_path: Path, plant: str) -> None:
    exit_file = tmp_path / "exit.json"
    if plant == "link":
        (tmp_path / "elsewhere.json").write_text('{"exit_code": 0}')
        exit_file.symlink_to(tmp_path / "elsewhere.json")
    elif plant == "fifo":
        os.mkfifo(exit_file)  # a blocking open would wait forever for a writer
    else:
        exit_file.write_text('{"exit_code": 0, "pad": "' + "x" * 10_000 + '"}')
    assert supervise.read_exit_code(exit_file) is None
