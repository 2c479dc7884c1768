"""preprocess and score read gzip through one reader (``BlockReader``): a small gzip of a huge
decompressed line is decompressed at most a block ahead and stops at ``FILE:LINE`` like the
same bytes uncompressed, in memory set by the block, not by the compression ratio."""

from __future__ import annotations

import gzip
import tracemalloc
from pathlib import Path

import pytest

from dlrm_vrgd.data.criteo.format import MAX_LINE_BYTES, BlockReader, CriteoFormatError


def test_a_gzip_of_one_64_mib_line_stops_at_line_1_within_a_few_blocks(tmp_path: Path) -> None:
    path = tmp_path / "day_0.gz"
    path.write_bytes(gzip.compress(b"1\t" + b"7" * (64 << 20), compresslevel=9))  # ~64 KB
    assert path.stat().st_size < 1 << 20
    reader = BlockReader(path, block_bytes=256 << 10)
    tracemalloc.start()
    try:
        with pytest.raises(CriteoFormatError, match=r"day_0.gz:1: a line longer than"):
            for _ in reader.blocks():
                pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the line grows to just past MAX_LINE_BYTES (1 MiB) before the check: a few MiB at most
    assert peak < 8 * MAX_LINE_BYTES, peak  # the old reader held all 64 MiB at once


def test_gzip_blocks_equal_the_plain_file_s(tmp_path: Path) -> None:
    text = b"".join(b"%d\t%d\n" % (i % 2, i) for i in range(50_000)) + b"0\tlast"
    (tmp_path / "plain.txt").write_bytes(text)
    with gzip.open(tmp_path / "two_members.gz", "wb") as f:  # two members, one file
        f.write(text[:100_000])
    with open(tmp_path / "two_members.gz", "ab") as f:
        f.write(gzip.compress(text[100_000:]))
    plain = BlockReader(tmp_path / "plain.txt", block_bytes=4096)
    packed = BlockReader(tmp_path / "two_members.gz", block_bytes=4096)
    plain_blocks, packed_blocks = list(plain.blocks()), list(packed.blocks())
    assert b"".join(plain_blocks) == b"".join(packed_blocks) == text + b"\n"
    assert all(block.endswith(b"\n") for block in packed_blocks)  # whole lines each
    assert max(len(b) for b in packed_blocks) < 2 * 4096 and not packed.ends_with_newline
