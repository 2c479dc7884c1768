"""Raw Criteo text for ``dlrm-vrgd score``: opened, parsed, numbered and scored.

Read exactly as ``preprocess`` reads it (:mod:`dlrm_vrgd.data.criteo.format`): TSV or CSV,
labelled (40 fields) or not (39: Kaggle ``test.txt``), Kaggle CSV with a header and an ``Id``
column, plain or gzip, LF or CRLF. The same parser (:func:`parse_block`) and the same bad-row
rules: the first malformed row stops the run with ``FILE:LINE: reason``, or with
``skip_bad_rows`` is left out and counted.

Text is read in blocks of ``block_bytes`` by a reader thread into a bounded queue
(:func:`~dlrm_vrgd.serve.pipeline.prefetch`), parsed and mapped onto the model's tables
(:mod:`dlrm_vrgd.serve.features`) in pieces by ``workers`` threads (at most ``workers + 2``
pieces in flight), and scored by the calling thread; the sink's thread writes. Gzip input is
decompressed at most a block ahead (:func:`dlrm_vrgd.data.criteo.format.gzip_pieces`, as for
preprocess): a line too long after decompression stops the run with ``FILE:LINE`` as it does
uncompressed.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dlrm_vrgd.data.criteo.format import (
    BlockReader,
    CriteoFormatError,
    Format,
    LabelsMode,
    Layout,
    MalformedRowError,
    detect_layout,
)
from dlrm_vrgd.data.criteo.parse import ParsedBlock, ParseOptions, parse_block
from dlrm_vrgd.serve.features import FeatureMapper
from dlrm_vrgd.serve.pipeline import prefetch
from dlrm_vrgd.serve.score.engine import Predict
from dlrm_vrgd.serve.score.progress import Progress
from dlrm_vrgd.serve.score.sinks import ScoredBlock, Sink

#: Raw text read at a time (as ``preprocess``): a line up to this long is a bad row that
#: ``skip_bad_rows`` can skip; a longer one stops the run.
BLOCK_BYTES = 16 << 20
#: Each block is parsed in pieces of about this much, cut at line ends (a longer line whole):
#: ~17k rows of Criteo text, about one forward pass of ``batch_rows``; small enough that the
#: first piece is parsed soon and the pieces in flight (at most ``workers + 2``) are a few tens
#: of MB, large enough that per-piece costs are small.
PIECE_BYTES = 4 << 20
_BAD_ROW_EXAMPLES = 20

#: What to do instead of scoring one .npy file.
NPY_INPUT = (
    "a NumPy array (.npy), not raw Criteo text: give score the directory that holds the day "
    "files and their manifest.json (`dlrm-vrgd preprocess` writes them), not one of its files"
)


@dataclass
class RawInput:
    """A raw Criteo file and its layout."""

    path: Path
    layout: Layout
    root: Path | None = None  # inputs are confined to it (see data.criteo.format.open_input)

    @property
    def has_id(self) -> bool:
        return self.layout.has_id

    @property
    def labeled(self) -> bool:
        return self.layout.labeled

    @property
    def nbytes(self) -> int:
        """Bytes to read (the file's size; for the progress bar)."""
        return self.path.stat().st_size


def open_raw(
    path: Path, fmt: Format, labels: LabelsMode, block_bytes: int, root: Path | None = None
) -> RawInput:
    """``path`` with its layout, detected from its first block; an empty file or a ``.npy``
    array is refused."""
    if path.suffix == ".npy":
        raise CriteoFormatError(f"{path}: {NPY_INPUT}")
    reader = BlockReader(path, block_bytes, root)
    first = bytes(next(iter(reader.blocks()), bytearray()))
    if not first.strip():
        raise CriteoFormatError(f"{path}: empty input")
    return RawInput(path, detect_layout(str(path), first, fmt, labels, reader.gzip), root)


def _line_bounds(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)``: the offset of each line of the bytes ``b`` and of its ``\\n``."""
    ends = np.flatnonzero(b == ord("\n"))
    starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)
    return starts, ends


def block_lines(block: bytes | bytearray, parsed: ParsedBlock) -> np.ndarray:
    """0-based line (within ``block``) of each row of ``parsed``: the block's non-empty lines
    less those ``parse_block`` rejected."""
    b = np.frombuffer(block, dtype=np.uint8)
    starts, ends = _line_bounds(b)
    length = ends - starts
    cr = np.zeros(len(ends), dtype=bool)
    has = length > 0
    cr[has] = b[ends[has] - 1] == ord("\r")
    keep = (length - cr) > 0  # the non-empty lines
    if parsed.bad_rows:
        keep[np.asarray([r.line - 1 for r in parsed.bad_rows], dtype=np.int64)] = False
    lines = np.flatnonzero(keep)
    if len(lines) != len(parsed):
        raise RuntimeError(f"{len(parsed)} rows parsed from {len(lines)} lines")
    return lines


def first_fields(block: bytes | bytearray, lines: np.ndarray, delimiter: str) -> pa.Array:
    """The first field (Kaggle's ``Id``) of the given 0-based lines of ``block``."""
    b = np.frombuffer(block, dtype=np.uint8)
    starts, ends = _line_bounds(b)
    starts = starts[lines]
    stops = ends[lines].astype(np.int64)
    delims = np.flatnonzero(b == ord(delimiter))
    at = np.searchsorted(delims, starts)
    cut = np.where(at < len(delims), delims[np.minimum(at, max(len(delims) - 1, 0))], stops)
    stops = np.minimum(cut, stops) if len(delims) else stops
    lengths = stops - starts
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    pos = np.repeat(starts - offsets[:-1], lengths) + np.arange(int(offsets[-1]))
    data = b[pos].tobytes()
    ids = pa.StringArray.from_buffers(len(lines), pa.py_buffer(offsets.tobytes()),
                                      pa.py_buffer(data))  # fmt: skip
    return pc.utf8_trim(ids, ' "\r')


def pieces(block: bytearray, size: int) -> Iterator[bytearray]:
    """``block`` (whole lines) cut after the first line end at or past every ``size`` bytes:
    pieces of whole lines, about ``size`` each (a longer line whole), in order."""
    start = 0
    while start < len(block):
        end = block.find(b"\n", min(start + size, len(block)) - 1) + 1 or len(block)
        yield block if start == 0 and end == len(block) else block[start:end]
        start = end


def score_raw(
    src: RawInput,
    opts: ParseOptions,
    mapper: FeatureMapper,
    predict: Predict,
    sink: Sink,
    state: Progress,
    workers: int | None,
    block_bytes: int,
) -> None:
    """Every row of ``src`` scored into ``sink`` in order, numbered by its line in the file
    (header included, 1-based); malformed rows counted in ``state`` (or raised)."""
    layout = src.layout
    name = str(src.path)
    workers = workers or len(os.sched_getaffinity(0))

    def work(block: bytearray) -> tuple[ParsedBlock, np.ndarray, pa.Array | None, np.ndarray]:
        """A parsing thread's work: a block's rows, their lines, Ids and table rows."""
        parsed = parse_block(block, layout, opts)
        lines = block_lines(block, parsed)
        ids = first_fields(block, lines, layout.delimiter) if layout.has_id else None
        sparse = mapper.model_ids(mapper.raw_ids(parsed.sparse)) if len(parsed) else None
        return parsed, lines, ids, sparse

    next_line = 2 if layout.has_header else 1
    seen = 0
    reader = BlockReader(src.path, block_bytes, src.root)
    pending: deque[tuple[Future[Any], int]] = deque()

    def consume() -> None:
        """This thread's work: the model on a parsed block, its rows handed to the sink."""
        nonlocal next_line, seen
        fut, position = pending.popleft()
        try:
            parsed, lines, ids, sparse = fut.result()
        except MalformedRowError as err:  # numbered from the block: renumber in the file
            raise MalformedRowError(err.path, err.line + next_line - 1, err.reason) from None
        offset = next_line
        next_line += parsed.lines
        for b in parsed.bad_rows[: max(0, _BAD_ROW_EXAMPLES - len(state.bad_examples))]:
            state.bad_examples.append({"path": name, "line": b.line + offset - 1,
                                       "reason": b.reason})  # fmt: skip
        state.bad_rows += len(parsed.bad_rows)
        if len(parsed):
            probs = predict(parsed.dense, sparse)
            labels = parsed.labels if layout.labeled else None
            sink.put(ScoredBlock(name, lines + offset, ids, labels, probs))
        state.advance(position - seen, len(parsed))
        seen = position

    def submitted(pool: ThreadPoolExecutor) -> Iterator[tuple[Future[Any], int]]:
        """The reader thread's work: read each block, hand its pieces to parsing threads."""
        first = True
        before = 0  # file position before the block (progress: pieces by their share)
        for block in reader.blocks():
            if first and layout.has_header:
                del block[: block.find(b"\n") + 1]
            first = False
            done, size, read = 0, len(block), reader.position - before
            for piece in pieces(block, PIECE_BYTES):
                done += len(piece)
                yield pool.submit(work, piece), before + read * done // max(size, 1)
            before = reader.position

    # a reader thread reads blocks and submits their pieces for parsing and mapping, at most
    # `workers` ahead of this thread, which runs the model; the sink's thread writes: all
    # overlap, and one block and at most `workers + 2` pieces are in flight, whatever the
    # input length
    with ThreadPoolExecutor(workers, thread_name_prefix="score-parse") as pool:
        try:
            ahead = prefetch(submitted(pool), workers, lambda item: item[0].cancel(),
                             name="score-read")  # fmt: skip
            with closing(ahead):
                for item in ahead:
                    pending.append(item)
                    consume()
        except BaseException:
            for fut, _ in pending:
                fut.cancel()
            raise
