"""One block of raw Criteo lines -> numpy arrays in torchrec's layout (no Python loop per row).

The fast path is one call of pyarrow's CSV reader (single-threaded: blocks run in parallel one
level up) plus vectorized numpy: hex ids are decoded two characters at a time through a 65,536
entry table. Anything unusual drops to a slower path that is exact rather than fast:

* a row with fewer fields than the layout's (trailing empty fields stripped) is padded with
  empty fields; a row with more is malformed;
* a value that fails conversion is located by re-reading the block as text and checking every
  column against the accepted syntax; its row is malformed;
* where pyarrow cannot even hand a row with the wrong field count to its handler (it decodes
  the row as UTF-8 to do so), every line's fields are counted here instead.

Accepted syntax, per field (empty = missing in every column):

* label: an integer equal to 0 or 1 (missing -> 0, torchrec's rule; counted);
* I1..I13: a 64-bit integer as pyarrow's CSV reader accepts it (decimal with an optional ``-``
  and surrounding spaces, or a ``0x`` hex literal), or an integral float in decimal notation
  (``260.0``, ``-1.``: DeepCTR-style CSVs write counts so); the label likewise (``1.0``);
  ``1.5`` or ``2e3`` is not an integer;
* C1..C26: 1 to 16 hexadecimal digits (Criteo writes 8); missing -> 0 (torchrec's rule).

Dense transform (torchrec's ``dense -= dense.min() - 2; log(dense)`` with a fixed minimum so
that it can stream): ``x -> log(max(x, floor) - floor + 2)`` in float32, missing counts as 0,
``floor = -3`` by default (the smallest count in Criteo Kaggle's ``train.txt``). On any file
whose minimum equals ``floor`` this is exactly torchrec's output; values below ``floor`` are
clamped to it and counted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from dlrm_vrgd.data.criteo.format import (
    CAT_NAMES,
    INT_NAMES,
    MAX_LINE_BYTES,
    NUM_CAT,
    BadRow,
    Layout,
    MalformedRowError,
    fast_types,
    read_table,
)
from dlrm_vrgd.data.criteo.validate import bad_values, conversion_error

DEFAULT_DENSE_FLOOR = -3
_DENSE_MAX = 1 << 62
_ONLY_NEWLINES = re.compile(rb"\n*")
_ROW_ERROR = re.compile(r"Expected \d+ columns, got \d+")
_MAX_ROUNDS = 64
_INTEGRAL_FLOAT = re.compile(rb"^( *-?[0-9]+)\.0*( *)$")


def _hex_tables() -> tuple[np.ndarray, np.ndarray]:
    """``nibble[c]``: value of hex character ``c`` (255 if not hex); ``pair[u16]``: the byte
    value of two hex characters read as one little-endian uint16 (256 if either is not hex)."""
    nibble = np.full(256, 255, dtype=np.uint8)
    for i, c in enumerate(b"0123456789abcdef"):
        nibble[c] = i
    for i, c in enumerate(b"ABCDEF"):
        nibble[c] = 10 + i
    codes = np.arange(1 << 16)
    hi, lo = nibble[codes & 0xFF].astype(np.uint16), nibble[codes >> 8].astype(np.uint16)
    pair = np.where((hi < 16) & (lo < 16), hi * 16 + lo, 256).astype(np.uint16)
    return nibble, pair


_NIBBLE, _PAIR = _hex_tables()
_PAIR_INVALID = np.uint64(0xFF00FF00FF00FF00)


def parse_caps(spec: int | str | Sequence[int] | None) -> np.ndarray | None:
    """``N`` or ``"N1,...,N26"`` (or a sequence) -> 26 uint64 table caps; None = no cap."""
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            values = [int(v) for v in spec.split(",")]
        except ValueError:
            raise ValueError(f"--max-rows-per-table: {spec!r} is not N or N1,...,N26") from None
    elif isinstance(spec, int):
        values = [spec]
    else:
        values = [int(v) for v in spec]
    if len(values) == 1:
        values *= NUM_CAT
    if len(values) != NUM_CAT or min(values) < 1:
        raise ValueError(
            f"--max-rows-per-table: expected one positive N or {NUM_CAT}, got {len(values)} values"
        )
    return np.asarray(values, dtype=np.uint64)


@dataclass(frozen=True)
class ParseOptions:
    """Per-run parsing options: ``caps`` (26 table sizes; ids become ``id % cap``) or None,
    the dense ``floor`` and whether bad rows are skipped (else the first one raises)."""

    caps: np.ndarray | None = None
    dense_floor: int = DEFAULT_DENSE_FLOOR
    skip_bad_rows: bool = False


@dataclass
class ParsedBlock:
    """``N`` parsed rows: ``labels`` N int32 (-1 for unlabeled files), ``dense`` N x 13 float32
    (transformed), ``sparse`` N x 26 int64 (hashed / capped ids); bookkeeping for the manifest."""

    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray
    bad_rows: list[BadRow]
    padded_rows: int
    missing_labels: int
    clamped_values: int
    id_max: np.ndarray  # 26 uint64: the largest id per column (uncapped runs only, else 0)
    lines: int = 0  # lines in the block (newlines), for numbering the next block's lines

    def __len__(self) -> int:
        return len(self.labels)


class _Invalid(Exception):
    """The fast path met a value it cannot convert; the exact path takes over."""


def _ints(table: pa.Table, name: str) -> np.ndarray:
    """An integer column as N int64, missing -> 0."""
    return pc.fill_null(table.column(name), 0).to_numpy()


def _hex(table: pa.Table, name: str) -> np.ndarray:
    """A hex id column as N uint64, missing -> 0 (one decode of the combined chunks: the
    per-call cost of many small chunks outweighs the copy)."""
    return decode_hex(table.column(name).combine_chunks())


def decode_hex(arr: pa.Array) -> np.ndarray:
    """Hex strings (binary array, nulls = missing) -> N uint64; raises ``_Invalid`` on a value
    that is not 1-16 hex digits. Eight-digit values (Criteo's) take a table-lookup fast path."""
    n = len(arr)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    _, off_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(off_buf, dtype=np.int32, count=n + 1, offset=4 * arr.offset)
    data = (
        np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    )
    lens = np.diff(offsets)
    start, stop = int(offsets[0]), int(offsets[-1])
    if not np.any((lens | 8) != 8):  # every value has 0 or 8 characters
        pairs = np.take(_PAIR, data[start:stop].view(np.uint16))
        if np.any(pairs.view(np.uint64) & _PAIR_INVALID):
            raise _Invalid
        values = pairs.astype(np.uint8).view(">u4").astype(np.uint64)
        if len(values) == n:
            return values
        out = np.zeros(n, dtype=np.uint64)
        out[lens == 8] = values
        return out
    if np.any(lens > 16):
        raise _Invalid
    # General path: right-align every value in 16 characters, left-padded with '0'.
    pos = np.arange(16)
    idx = offsets[:-1, None] + lens[:, None] - 16 + pos
    chars = np.where(
        pos >= 16 - lens[:, None], data[np.clip(idx, 0, max(len(data) - 1, 0))], ord("0")
    )
    nib = _NIBBLE[chars]
    if np.any(nib == 255):
        raise _Invalid
    packed = (nib[:, 0::2] << 4) | nib[:, 1::2]
    return np.ascontiguousarray(packed).view(">u8").reshape(n).astype(np.uint64)


def _convert(table: pa.Table, layout: Layout, opts: ParseOptions) -> ParsedBlock:
    n = table.num_rows
    missing_labels = 0
    if layout.labeled:
        missing_labels = table.column("label").null_count
        labels = _ints(table, "label").astype(np.int32)
        if np.any((labels != 0) & (labels != 1)):
            raise _Invalid
    else:
        labels = np.full(n, -1, dtype=np.int32)
    ints = np.empty((len(INT_NAMES), n), dtype=np.int64)  # 13 x N
    for j, name in enumerate(INT_NAMES):
        ints[j] = _ints(table, name)
    floor = opts.dense_floor
    clamped = int(np.count_nonzero(ints < floor))
    np.clip(ints, floor, _DENSE_MAX, out=ints)  # the top clip only keeps x - floor from wrapping
    ints -= floor - 2
    dense = ints.T.astype(np.float32, order="C")
    np.log(dense, out=dense)
    ids = np.empty((NUM_CAT, n), dtype=np.uint64)  # 26 x N
    for j, name in enumerate(CAT_NAMES):
        ids[j] = _hex(table, name)
    id_max = np.zeros(NUM_CAT, dtype=np.uint64)  # only uncapped ids need it (cardinalities)
    if opts.caps is not None:
        ids %= opts.caps[:, None]
    elif n:
        id_max = ids.max(axis=1)
        if np.any(id_max >= np.uint64(1 << 63)):
            raise _Invalid
    sparse = ids.T.astype(np.int64, order="C")
    return ParsedBlock(labels, dense, sparse, [], 0, missing_labels, clamped, id_max)


# --------------------------------------------------------------------------- the block
def integral_floats_as_ints(block: bytes | bytearray, layout: Layout) -> bytes | bytearray:
    """Rewrite every integral float (``260.0``, ``-1.``) in the label and I1..I13 fields of
    ``block`` as the integer it is (``260``, ``-1``); other fields and values are left for the
    parser to accept or reject. A Python pass over the lines holding a ``.``: Criteo's own
    files have none, so they never take it."""
    names = layout.names
    columns = [j for j, n in enumerate(names) if n == "label" or n in INT_NAMES]
    delim = layout.delimiter.encode()
    lines = block.split(b"\n")
    for i, line in enumerate(lines):
        if b"." not in line:
            continue
        fields = line.split(delim)
        for j in columns:
            if j < len(fields) and b"." in fields[j]:
                m = _INTEGRAL_FLOAT.match(fields[j])
                if m is not None:
                    fields[j] = m.group(1) + m.group(2)
        lines[i] = delim.join(fields)
    return b"\n".join(lines)


def pad_short_lines(block: bytes | bytearray, layout: Layout) -> tuple[bytes | bytearray, int]:
    """Append the missing delimiters to every non-empty line with too few fields (vectorized;
    for files whose rows lost their trailing empty fields). Returns the block and the count."""
    b = np.frombuffer(block, dtype=np.uint8)
    ends = np.flatnonzero(b == ord("\n"))
    if len(ends) == 0:
        return block, 0
    delims = np.flatnonzero(b == ord(layout.delimiter))
    per_line = np.diff(np.searchsorted(delims, ends), prepend=0)
    starts = np.concatenate(([0], ends[:-1] + 1))
    missing = np.where(ends > starts, layout.num_fields - 1 - per_line, 0).clip(min=0)
    count = int(np.count_nonzero(missing))
    if count == 0:
        return block, 0
    return np.insert(b, np.repeat(ends, missing), ord(layout.delimiter)).tobytes(), count


def _empty(layout: Layout, bad: list[BadRow], opts: ParseOptions) -> ParsedBlock:
    if bad and not opts.skip_bad_rows:
        first = min(bad, key=lambda b: b.line)
        raise MalformedRowError(layout.path, first.line, first.reason)
    return ParsedBlock(
        labels=np.zeros(0, dtype=np.int32),
        dense=np.zeros((0, len(INT_NAMES)), dtype=np.float32),
        sparse=np.zeros((0, NUM_CAT), dtype=np.int64),
        bad_rows=sorted(bad, key=lambda b: b.line),
        padded_rows=0,
        missing_labels=0,
        clamped_values=0,
        id_max=np.zeros(NUM_CAT, dtype=np.uint64),
    )


def _too_many(layout: Layout, actual: int) -> str:
    reason = f"expected {layout.describe()}, found {actual} fields"
    if not layout.labeled and not layout.has_header and actual == layout.num_fields + 1:
        reason += "; if this file has labels, pass --labels yes"
    return reason


def parse_block(
    block: bytes | bytearray, layout: Layout, opts: ParseOptions, first_line: int = 1
) -> ParsedBlock:
    """Parse the lines of ``block`` (line ``first_line`` of ``layout.path`` onwards; blocks
    parsed ahead of time use 1 and renumber with ``ParsedBlock.lines``).

    Raises :class:`MalformedRowError` for the first malformed line, or with
    ``opts.skip_bad_rows`` leaves such rows out and lists them in ``bad_rows``.
    """
    result = _parse(block, layout, opts, first_line)
    result.lines = block.count(b"\n")
    return result


def _parse(
    block: bytes | bytearray, layout: Layout, opts: ParseOptions, first_line: int
) -> ParsedBlock:
    lines: list[bytes] | list[bytearray] | None = None
    edits: dict[int, bytes] = {}
    bad: list[BadRow] = []
    padded = 0

    def get_lines() -> list[bytes] | list[bytearray]:
        nonlocal lines
        if lines is None:
            lines = block.split(b"\n")
        return lines

    def reject(i: int, reason: str) -> None:
        bad.append(BadRow(first_line + i, reason))
        edits[i] = b""  # an empty line: the CSV reader skips it

    if b"\r" in block:
        block = block.replace(b"\r\n", b"\n")
    if layout.prepad:
        block, padded = pad_short_lines(block, layout)
    if b"." in block:
        block = integral_floats_as_ints(block, layout)
    if len(block) > MAX_LINE_BYTES:  # pyarrow cannot parse a line longer than its block
        b = np.frombuffer(block, dtype=np.uint8)
        ends = np.flatnonzero(b == ord("\n"))
        starts = np.concatenate(([0], ends[:-1] + 1))
        for i in np.flatnonzero(ends - starts > MAX_LINE_BYTES).tolist():
            reject(i, f"a line longer than {MAX_LINE_BYTES:,} bytes (not Criteo text)")
    if b"\r" in block:
        for i, line in enumerate(get_lines()):
            if b"\r" in line and i not in edits:
                reject(i, "carriage return inside a line")
    delim = layout.delimiter.encode()
    if layout.has_id and not block.isascii():  # the Id column is kept as text: UTF-8 only
        for i, line in enumerate(get_lines()):
            if i not in edits and not line.split(delim, 1)[0].isascii():
                try:
                    bytes(line.split(delim, 1)[0]).decode("utf-8")
                except UnicodeDecodeError:
                    reject(i, "field Id is not UTF-8 text")

    types = fast_types(layout)

    def fix_field_counts(src: list[bytes] | list[bytearray]) -> int:
        """Pad or reject every line with the wrong number of fields; how many there were."""
        nonlocal padded
        fixed = 0
        for i, line in enumerate(src):
            if i in edits:
                continue
            actual = line.count(delim) + 1 if line else layout.num_fields
            if actual < layout.num_fields:
                edits[i] = bytes(line) + delim * (layout.num_fields - actual)
                padded += 1
                fixed += 1
            elif actual > layout.num_fields:
                reject(i, _too_many(layout, actual))
                fixed += 1
        return fixed

    if not block.isascii():  # pyarrow's row handler would fail on a row that is not UTF-8
        fix_field_counts(get_lines())
    for _ in range(_MAX_ROUNDS):
        arrow_error: tuple[str, bytes] | None = None
        if edits:
            current = list(get_lines())
            for i, text in edits.items():
                current[i] = text
            buf = b"\n".join(current)
        else:
            current, buf = None, block
        if _ONLY_NEWLINES.fullmatch(buf):  # nothing but empty lines
            return _empty(layout, bad, opts)
        invalid: list[tuple[int, int]] = []

        def handler(row: pcsv.InvalidRow, sink: list[tuple[int, int]] = invalid) -> str:
            sink.append((row.number, row.actual_columns))
            return "skip"

        try:
            table = read_table(buf, layout, types, handler)
            result = None if invalid else _convert(table, layout, opts)
        except (pa.ArrowInvalid, _Invalid) as err:
            result = None
            if isinstance(err, pa.ArrowInvalid):
                if _ROW_ERROR.search(str(err)) and fix_field_counts(
                    current if current is not None else get_lines()
                ):  # the row handler itself failed
                    continue
                arrow_error = conversion_error(err, layout)
        if result is not None:
            if bad and not opts.skip_bad_rows:
                first = min(bad, key=lambda b: b.line)
                raise MalformedRowError(layout.path, first.line, first.reason)
            result.bad_rows = sorted(bad, key=lambda b: b.line)
            result.padded_rows = padded
            return result
        src = current if current is not None else get_lines()
        nonblank = [i for i, line in enumerate(src) if line]
        if invalid:
            for number, actual in invalid:
                i = nonblank[number - 1]
                if actual < layout.num_fields:
                    edits[i] = src[i] + delim * (layout.num_fields - actual)
                    padded += 1
                else:
                    reject(i, _too_many(layout, actual))
            continue
        found = bad_values(buf, layout, opts.caps is None, arrow_error)
        if not found:
            raise RuntimeError(f"{layout.path}:{first_line}: conversion failed, cause not found")
        for row, reason in found:
            reject(nonblank[row], reason)
    raise RuntimeError(f"{layout.path}:{first_line}: block not parsed after {_MAX_ROUNDS} rounds")
