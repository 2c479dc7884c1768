"""Issue 39, items 4, 7 and 10, through the real ``score`` CLI (and the API for the memory
measure): gzip bombs are bounded as plain text is (one 1 GiB line, 1 GiB of NULs: 1 MB of
gzip each, scored under a 2 GiB address-space limit, a FILE:LINE error and no traceback), a
compressible gzip's memory is bounded by the block whatever its length, a model.json nested
100,000 levels deep is one clear error, and a file given twice is refused, not scored twice."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from dlrm_vrgd.data.criteo.format import MAX_LINE_BYTES, format_criteo_text
from dlrm_vrgd.serve.score import score

from ..data.criteo.test_criteo import make_rows
from .test_score import Trained

#: The child's address space: the bomb's line alone is half of it.
ADDRESS_SPACE = 2 << 30
#: Bytes of the bombs' one line, decompressed (1 MB of gzip).
BOMB = 1 << 30
#: The child's peak RSS, scoring a bomb (a few 16 MiB blocks beside torch; old code: 2.4 GB).
RSS_LIMIT = 1 << 30
DEEP = b"[" * 100_000 + b"]" * 100_000

#: Runs argv with RLIMIT_AS set; prints its exit code and its peak RSS (KiB) as JSON, then
#: its stderr: a fresh parent, so RUSAGE_CHILDREN is that child's alone.
_LIMITED = """
import json, resource, subprocess, sys
limit = int(sys.argv[1])
def cap():
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
p = subprocess.run(sys.argv[2:], capture_output=True, text=True, preexec_fn=cap)
print(json.dumps({"rc": p.returncode,
                  "maxrss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
print(p.stderr)
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    return Trained(tmp_path_factory.mktemp("score_bounds"))


def gzip_of(path: Path, byte: bytes, size: int) -> Path:
    """One gzip member of ``size`` bytes of ``byte`` (no newline): ~1000:1."""
    c = zlib.compressobj(6, zlib.DEFLATED, 31)
    chunk = byte * (16 << 20)
    with path.open("wb") as f:
        for _ in range(size // len(chunk)):
            f.write(c.compress(chunk))
        f.write(c.flush())
    return path


def limited_score(model: Path, *args: str) -> tuple[int, int, str]:
    """The score CLI under RLIMIT_AS: (exit status, peak RSS in bytes, stderr)."""
    cmd = [sys.executable, "-m", "dlrm_vrgd.cli", "score", "--model", str(model), *args,
           "--no-progress", "--overwrite"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _LIMITED, str(ADDRESS_SPACE), *cmd],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    head, _, stderr = proc.stdout.partition("\n")
    got = json.loads(head)
    return got["rc"], got["maxrss_kib"] * 1024, stderr


@pytest.mark.parametrize("byte", [b"A", b"\0"], ids=["one-line", "nuls"])
def test_a_gzip_bomb_stops_at_its_first_line_in_bounded_memory(
    trained: Trained, tmp_path: Path, byte: bytes
) -> None:
    bomb = gzip_of(tmp_path / "bomb.gz", byte, BOMB)
    assert bomb.stat().st_size < 2 << 20  # the attack: ~1 MB of gzip
    rc, rss, stderr = limited_score(trained.model, "--input", str(bomb),
                                    "--out", str(tmp_path / "p.csv"))  # fmt: skip
    assert rc == 2, stderr[-2000:]
    assert "Traceback" not in stderr and "MemoryError" not in stderr
    assert f"bomb.gz:1: a line longer than {MAX_LINE_BYTES:,} bytes" in stderr
    assert rss < RSS_LIMIT, f"peak RSS {rss >> 20} MiB"
    assert not (tmp_path / "p.csv").exists()


def test_a_long_line_is_named_alike_plain_and_gzip(trained: Trained, tmp_path: Path) -> None:
    """50 good rows, then a 3 MiB line: the same FILE:LINE error, compressed or not."""
    labels, ints, cats = make_rows(50, 8)
    text = format_criteo_text(labels, ints, cats) + b"7" * (3 << 20) + b"\n"
    plain, packed = tmp_path / "rows.tsv", tmp_path / "rows.tsv.gz"
    plain.write_bytes(text)
    packed.write_bytes(gzip.compress(text, 9))
    errors = []
    for path in (plain, packed):
        rc, _, stderr = limited_score(trained.model, "--input", str(path),
                                      "--out", str(tmp_path / "p.csv"))  # fmt: skip
        assert rc == 2 and "Traceback" not in stderr, stderr[-2000:]
        errors.append(stderr.strip().splitlines()[-1].replace(path.name, "FILE"))
    assert errors[0] == errors[1]
    assert "FILE:51: a line longer than" in errors[0]


def test_a_compressible_gzip_is_scored_in_memory_bounded_by_the_block(
    trained: Trained, tmp_path: Path
) -> None:
    """The same unlabelled row repeated (~1000:1): tracemalloc's peak while streaming N and 4N
    rows in 64 KiB blocks is a few blocks' worth at both lengths; the old reader decompressed
    4 MiB of gzip at a time (4 GB of text here), whatever the block."""
    import tracemalloc

    _, ints, cats = make_rows(1, 3)
    row = format_criteo_text(None, ints, cats)
    block, n = 1 << 16, 100_000

    def streaming_peak(path: Path, out: Path) -> tuple[int, int]:
        started: list[int] = []

        def progress(rows: int, seconds: float, fraction: float) -> None:
            if not started:  # the model is loaded and a block scored: streaming from here
                started.append(rows)
                tracemalloc.reset_peak()

        tracemalloc.start()
        try:
            res = score(trained.model, [path], out, block_bytes=block, workers=2,
                        progress=False, on_progress=progress)  # fmt: skip
            return res.rows, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    peaks = {}
    for k in (n // 4, n):
        path = tmp_path / f"{k}.tsv.gz"
        path.write_bytes(gzip.compress(row * k, 9))
        rows, peaks[k] = streaming_peak(path, tmp_path / f"{k}.csv")
        assert rows == k
    assert len(row) * n > 100 * block  # the input is far larger than the bound below
    assert peaks[n] < 60 * block, peaks  # workers + 2 blocks in flight, the sink's batches
    assert peaks[n] - peaks[n // 4] < 8 * block, peaks  # and it does not grow with the input


def rehash(model: Path, name: str) -> None:
    """Make the manifest agree with ``name`` as it is now (an attacker who rewrites both)."""
    manifest = json.loads((model / "manifest.json").read_text())
    data = (model / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (model / "manifest.json").write_text(json.dumps(manifest))


def test_a_model_json_nested_too_deep_is_one_clear_error(trained: Trained, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(trained.model, model)
    (model / "model.json").write_bytes(DEEP)
    rehash(model, "model.json")
    rows = tmp_path / "rows.tsv"
    rows.write_bytes(format_criteo_text(*make_rows(5, 1)))
    rc, _, stderr = limited_score(model, "--input", str(rows), "--out", str(tmp_path / "p.csv"))
    assert rc == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert "model.json: not valid UTF-8 JSON (nested 100000 levels deep" in stderr


def test_an_input_given_twice_is_refused_not_scored_twice(trained: Trained, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    rows = folder / "a.tsv"
    rows.write_bytes(format_criteo_text(*make_rows(20, 2)))
    (folder / "b.tsv").write_bytes(format_criteo_text(*make_rows(20, 3)))
    for inputs in ([rows, rows], [folder, rows], [rows, tmp_path / "in" / ".." / "in" / "a.tsv"]):
        rc, _, stderr = limited_score(trained.model, "--input", *map(str, inputs),
                                      "--out", str(tmp_path / "p.csv"))  # fmt: skip
        assert rc == 2 and "Traceback" not in stderr, stderr[-2000:]
        assert "given twice" in stderr
        assert not (tmp_path / "p.csv").exists()
    res = score(trained.model, [folder], tmp_path / "q.csv", progress=False)
    assert res.rows == 40
