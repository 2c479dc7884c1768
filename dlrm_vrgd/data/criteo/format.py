"""Raw Criteo click logs: the text layouts we accept, how a file is recognized, which files a
``--input`` names, how a file is read as blocks of whole lines in bounded memory, and the one
set of pyarrow CSV options every parsing path uses.

Accepted layouts (one example per line; every field may be empty = missing):

* **TSV** (Kaggle ``train.txt`` / ``test.txt``, Criteo 1TB ``day_0`` … ``day_23``):
  ``label \\t I1..I13 \\t C1..C26`` (40 fields), or without the label (39 fields: Kaggle
  ``test.txt``). ``I*`` are integer counts (negative allowed), ``C*`` hexadecimal ids.
* **CSV** (the Kaggle competition files): the same fields separated by commas, usually with a
  header ``Id,Label,I1,...,C26`` (test: ``Id,I1,...,C26``); the ``Id`` column is dropped.
* Either one gzip-compressed (recognized by its magic bytes, not its name; multi-member files
  too), with LF or CRLF line endings, with or without a header line.

Whether a file has labels is read from its header when it has one; otherwise a file is labeled
when any line of its first block has all 40 fields (rows may have lost trailing empty fields, so a
39-field line alone proves nothing). ``--labels yes|no`` overrides the guess.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

logger = logging.getLogger(__name__)

NUM_INT = 13
NUM_CAT = 26
INT_NAMES = tuple(f"I{i}" for i in range(1, NUM_INT + 1))
CAT_NAMES = tuple(f"C{i}" for i in range(1, NUM_CAT + 1))
_GZIP_MAGIC = b"\x1f\x8b"
#: Pad blocks up front when at least this fraction of a file's first block is short rows.
_PREPAD_FRACTION = 0.01
#: A line longer than this is not Criteo data (the longest real lines are ~400 bytes).
MAX_LINE_BYTES = 1 << 20

Format = Literal["auto", "tsv", "csv"]
LabelsMode = Literal["auto", "yes", "no"]


class CriteoFormatError(ValueError):
    """An input that cannot be read as Criteo data (bad gzip stream, unknown header, ...)."""


class InputPathError(CriteoFormatError):
    """An input outside the allowed root, a link, or not a regular file."""


class MalformedRowError(CriteoFormatError):
    """One row that breaks the parsing rules; names the file and the 1-based line."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(
            f"{path}:{line}: {reason} (pass --skip-bad-rows to skip and count such rows)"
        )
        self.path = path
        self.line = line
        self.reason = reason


@dataclass(frozen=True)
class BadRow:
    """A row skipped under ``--skip-bad-rows``."""

    line: int
    reason: str


@dataclass(frozen=True)
class Layout:
    """How the fields of one input file are laid out."""

    path: str
    delimiter: str
    has_header: bool
    has_id: bool
    labeled: bool
    gzip: bool
    #: Rows often lack trailing empty fields: pad every block before parsing (else only the
    #: rows the CSV reader reports).
    prepad: bool = False

    @property
    def format(self) -> str:
        return "tsv" if self.delimiter == "\t" else "csv"

    @property
    def names(self) -> list[str]:
        """Column names of every field, in file order."""
        return (
            (["Id"] if self.has_id else [])
            + (["label"] if self.labeled else [])
            + list(INT_NAMES)
            + list(CAT_NAMES)
        )

    @property
    def num_fields(self) -> int:
        return len(self.names)

    def describe(self) -> str:
        labels = "label, " if self.labeled else "no label, "
        return f"{self.num_fields} fields ({'Id, ' if self.has_id else ''}{labels}I1-I13, C1-C26)"


# ------------------------------------------------------------------------------ detection
_LABEL_HEADERS = {"label", "clicked", "click"}
_INT_HEADER = re.compile(r"^(i\d+|int_\d+)$")
_CAT_HEADER = re.compile(r"^(c\d+|cat_\d+)$")


def parse_header(path: str, fields: list[str]) -> tuple[bool, bool]:
    """``(has_id, labeled)`` from a header line's fields, e.g. Kaggle's ``Id,Label,I1..C26``
    or torchrec's ``label,int_0..cat_25``; raises :class:`CriteoFormatError` otherwise."""
    names = [f.strip().strip('"').lower() for f in fields]
    has_id = bool(names) and names[0] == "id"
    rest = names[1:] if has_id else names
    labeled = bool(rest) and rest[0] in _LABEL_HEADERS
    rest = rest[1:] if labeled else rest
    ok = (
        len(rest) == NUM_INT + NUM_CAT
        and all(_INT_HEADER.match(n) for n in rest[:NUM_INT])
        and all(_CAT_HEADER.match(n) for n in rest[NUM_INT:])
    )
    if not ok:
        raise CriteoFormatError(  # its fields are not echoed: the file may be anyone's
            f"{path}:1: unrecognized header ({len(fields)} fields); expected "
            "[Id,][Label,]I1..I13,C1..C26 (or torchrec's label,int_0..,cat_0..)"
        )
    return has_id, labeled


def _is_header(first_field: str) -> bool:
    """A data line starts with a label or a count (digits, maybe signed) or is empty there."""
    text = first_field.strip()
    return bool(text) and not re.fullmatch(r"-?(\d+|0[xX][0-9a-fA-F]+)", text)


def detect_layout(
    path: str, first_block: bytes, fmt: Format, labels: LabelsMode, gzip: bool
) -> Layout:
    """Recognize a file from its first block of lines (see the module docstring)."""
    lines = [ln.rstrip(b"\r") for ln in first_block.split(b"\n")[:-1]]
    first = next((ln for ln in lines if ln), b"")
    if fmt == "auto":
        if b"\t" in first:
            fmt = "tsv"
        elif b"," in first:
            fmt = "csv"
        else:
            raise CriteoFormatError(
                f"{path}: cannot tell TSV from CSV: its first line has neither tabs nor commas"
            )
    delim = "\t" if fmt == "tsv" else ","
    first_fields = first.decode("utf-8", "replace").split(delim)
    counts = [ln.count(delim.encode()) + 1 for ln in lines if ln]
    if lines and lines[0] and _is_header(first_fields[0]):
        has_id, labeled = parse_header(path, first_fields)
        if labels != "auto" and labeled != (labels == "yes"):
            raise CriteoFormatError(
                f"{path}: --labels {labels} contradicts the header ({'has' if labeled else 'no'} "
                "label column)"
            )
        layout = Layout(path, delim, True, has_id, labeled, gzip)
        counts = counts[1:]
    else:
        if labels == "auto":
            full = 1 + NUM_INT + NUM_CAT
            labeled = full in counts
            logger.info(
                "%s: %s (%s line of all %d fields in its first %d lines)",
                path,
                "labeled" if labeled else "unlabeled",
                "found a" if labeled else "no",
                full,
                len(lines),
            )
        else:
            labeled = labels == "yes"
        layout = Layout(path, delim, False, False, labeled, gzip)
    fields = layout.num_fields  # a property that builds the names: once, not once a line
    short = sum(c < fields for c in counts)
    if short >= _PREPAD_FRACTION * max(len(counts), 1):
        logger.info("%s: %d of the first %d rows lack trailing fields", path, short, len(counts))
        layout = replace(layout, prepad=True)
    return layout


# -------------------------------------------------------------------------------- inputs
def _natural_key(path: Path) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def check_in_root(path: Path, root: Path | None) -> None:
    """With a ``root``: ``path`` is no symlink and its real path lies inside ``root`` (else
    :class:`InputPathError`); nothing to check without one."""
    if root is None:
        return
    if path.is_symlink():
        raise InputPathError(f"{path}: a symlink; inputs under the input root must not be links")
    if not Path(os.path.realpath(path)).is_relative_to(Path(os.path.realpath(root))):
        raise InputPathError(f"{path}: outside the input root")


def open_input(path: Path, root: Path | None = None) -> BinaryIO:
    """``path`` opened for reading. With a ``root`` (the service's data root), the last
    component is opened with ``O_NOFOLLOW`` and the real path of the file actually opened
    (``/proc/self/fd``) must lie inside ``root`` and be a regular file: a link swapped in after
    the inputs were listed is refused too."""
    if root is None:
        return Path(path).open("rb")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise InputPathError(
                f"{path}: a symlink; inputs are opened without following links"
            ) from None
        raise
    try:
        real = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if not real.is_relative_to(Path(os.path.realpath(root))):
            raise InputPathError(f"{path}: outside the input root")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputPathError(f"{path}: not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def expand_inputs(paths: Sequence[str | Path], root: Path | None = None) -> list[Path]:
    """Input files in the order given; a directory stands for its files in natural order
    (``day_2`` before ``day_10``). With a ``root``, every path and every file of a directory
    is checked with :func:`check_in_root` (a link is refused, not skipped)."""
    files: list[Path] = []
    for p in map(Path, paths):
        check_in_root(p, root)
        if p.is_dir():
            listed = [f for f in p.iterdir() if not f.name.startswith(".")]
            for f in listed:
                check_in_root(f, root)
            files += sorted((f for f in listed if f.is_file()), key=_natural_key)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"input not found: {p}")
    if not files:
        raise FileNotFoundError("no input files")
    resolved = [f.resolve() for f in files]
    dup = next((f for i, f in enumerate(resolved) if f in resolved[:i]), None)
    if dup is not None:
        raise ValueError(f"input given twice: {dup}")
    if sorted(files, key=_natural_key) != files:
        logger.warning(
            "inputs are not in natural order (%s); days are numbered in the order given",
            ", ".join(f.name for f in files[:4]) + (", ..." if len(files) > 4 else ""),
        )
    return files


# ------------------------------------------------------------------------------- reading
#: pyarrow's own chunk size: ~1 MiB chunks stay in cache (1.6x faster than one 16 MiB chunk).
_ARROW_BLOCK_BYTES = 1 << 20


def read_table(
    buf: bytes | bytearray,
    layout: Layout,
    types: dict[str, pa.DataType],
    handler: Callable[[pcsv.InvalidRow], str] | None = None,
) -> pa.Table:
    """The CSV reader on a block, with the parsing options every path shares."""
    return pcsv.read_csv(
        pa.py_buffer(buf),
        read_options=pcsv.ReadOptions(
            column_names=layout.names, use_threads=False, block_size=_ARROW_BLOCK_BYTES
        ),
        parse_options=pcsv.ParseOptions(
            delimiter=layout.delimiter,
            quote_char=False,
            double_quote=False,
            escape_char=False,
            ignore_empty_lines=True,
            invalid_row_handler=handler,
        ),
        convert_options=pcsv.ConvertOptions(
            column_types=types,
            include_columns=list(types),
            null_values=[""],
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,
        ),
    )


def fast_types(layout: Layout) -> dict[str, pa.DataType]:
    types: dict[str, pa.DataType] = {"label": pa.int64()} if layout.labeled else {}
    types.update({n: pa.int64() for n in INT_NAMES})
    types.update({n: pa.binary() for n in CAT_NAMES})
    return types


#: Compressed bytes read at a time, and most decompressed bytes asked of zlib at a time.
GZIP_READ_BYTES = 1 << 20
GZIP_PIECE_BYTES = 4 << 20


def gzip_pieces(raw: BinaryIO, path: str, want: list[int]) -> Iterator[bytes]:
    """The decompressed bytes of every gzip member of ``raw``, each piece at most
    ``min(want[0], GZIP_PIECE_BYTES)`` bytes (``want[0]``: what the caller still lacks, read
    before each piece): zlib is asked for no more (``max_length``; the rest of the compressed
    input waits in ``unconsumed_tail``), so a small file of a huge decompressed size is never
    decompressed further ahead than the caller reads. :class:`CriteoFormatError` for a corrupt
    or truncated stream (never a silently shorter file)."""
    d = zlib.decompressobj(wbits=31)
    fed = full = False
    pending = b""
    while True:
        if not pending and not full:
            pending = raw.read(GZIP_READ_BYTES)
            if not pending:
                break
        limit = max(1, min(want[0], GZIP_PIECE_BYTES))
        try:
            out = d.decompress(pending, limit)
        except zlib.error as err:
            raise CriteoFormatError(f"{path}: corrupt gzip data: {err}") from None
        fed = True
        full = len(out) >= limit  # zlib may hold more output of the input it took
        if d.eof:  # a member ended: the next one starts in its unused data
            pending = d.unused_data
            d, fed, full = zlib.decompressobj(wbits=31), False, False
        else:
            pending = d.unconsumed_tail
        if out:
            yield out
    if fed and not d.eof:
        raise CriteoFormatError(f"{path}: the gzip stream ends early (truncated file?)")


class BlockReader:
    """Blocks of whole lines from one file (plain or gzip), about ``block_bytes`` each.

    Yields ``bytearray`` blocks (one copy from the file or the decompressor, none after); every
    block ends with a newline (one is added to a last line without). ``position`` is how far
    into the file on disk (compressed bytes for gzip) reading got; ``ends_with_newline`` tells,
    once the file is read, whether its last line had one. A line longer than
    :data:`MAX_LINE_BYTES` fails with ``FILE:LINE``, compressed or not: gzip input is
    decompressed at most one block ahead (:func:`gzip_pieces`), so 2 MB of gzip holding one
    2 GiB line (or 2 GiB of NULs) costs a block of memory, not 3 GB.
    """

    def __init__(self, path: Path, block_bytes: int = 16 << 20, root: Path | None = None) -> None:
        self.path = Path(path)
        self.block_bytes = block_bytes
        self.root = root  # see open_input
        with open_input(self.path, root) as f:
            self.gzip = f.read(2) == _GZIP_MAGIC
            self.size = os.fstat(f.fileno()).st_size
        self.position = 0
        self.lines = 0  # lines in the blocks yielded so far
        self.ends_with_newline = True

    def blocks(self) -> Iterator[bytearray]:
        if self.gzip:
            yield from self._gzip_blocks()
            return
        buf = bytearray()
        need = self.block_bytes
        with open_input(self.path, self.root) as raw:
            eof = False
            while not eof:
                while len(buf) < need:  # plain bytes, read straight into the block
                    have = len(buf)
                    grown = bytearray(need)
                    grown[:have] = buf
                    n = raw.readinto(memoryview(grown)[have:])
                    del grown[have + n :]
                    buf = grown
                    if n == 0:
                        eof = True
                        break
                    self.position = raw.tell()
                cut = buf.rfind(b"\n") + 1
                if cut == 0:
                    self._check_line(buf)
                    need = 2 * len(buf) + 1
                    continue
                carry = buf[cut:]
                del buf[cut:]
                self.lines += buf.count(b"\n")
                yield buf
                buf, need = carry, self.block_bytes
            self.position = self.size
        yield from self._last(buf)

    def _gzip_blocks(self) -> Iterator[bytearray]:
        """:meth:`blocks` of gzip input, decompressed at most one block ahead."""
        buf = bytearray()
        want = [self.block_bytes]
        with open_input(self.path, self.root) as raw:
            for piece in gzip_pieces(raw, str(self.path), want):
                buf += piece
                self.position = raw.tell()
                if len(buf) < self.block_bytes:
                    want[0] = self.block_bytes - len(buf)
                    continue
                cut = buf.rfind(b"\n") + 1
                if cut == 0:
                    self._check_line(buf)
                    want[0] = self.block_bytes  # a line longer than a block: read on
                    continue
                carry = buf[cut:]
                del buf[cut:]
                self.lines += buf.count(b"\n")
                yield buf
                buf = carry
                want[0] = max(1, self.block_bytes - len(buf))
            self.position = self.size
        yield from self._last(buf)

    def _last(self, buf: bytearray) -> Iterator[bytearray]:
        """The last block (its line gets a newline if it had none)."""
        if not buf:
            return
        if b"\n" not in buf:
            self._check_line(buf)
        self.ends_with_newline = buf.endswith(b"\n")
        if not self.ends_with_newline:
            buf += b"\n"
        yield buf

    def _check_line(self, buf: bytearray) -> None:
        """A line past MAX_LINE_BYTES is not Criteo text (compressed or not)."""
        if len(buf) > MAX_LINE_BYTES:
            raise CriteoFormatError(
                f"{self.path}:{self.lines + 1}: a line longer than {MAX_LINE_BYTES:,} bytes: "
                "not Criteo text (a binary file?)"
            )


# ------------------------------------------------------------------------------- writing
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def format_criteo_text(
    labels: np.ndarray | None,
    ints: np.ma.MaskedArray,
    cats: np.ma.MaskedArray,
    delimiter: str = "\t",
    header: bool = False,
    ids: np.ndarray | None = None,
) -> bytes:
    """Raw Criteo text for ``N`` rows: the inverse of parsing (tests, benchmarks, exports).

    ``labels`` N ints or None (unlabeled), ``ints`` N x 13 masked int64 counts, ``cats`` N x 26
    masked uint32 ids written as 8 hex digits; masked entries are written as empty fields.
    ``ids`` N ints for the CSV ``Id`` column (with ``header``, Kaggle's column names).
    """
    n = ints.shape[0]
    cols: dict[str, pa.Array] = {}
    if ids is not None:
        cols["Id"] = pa.array(np.asarray(ids, dtype=np.int64))
    if labels is not None:
        cols["Label"] = pa.array(np.asarray(labels, dtype=np.int64))
    int_mask = np.ma.getmaskarray(ints)
    for j, name in enumerate(INT_NAMES):
        cols[name] = pa.array(np.ma.getdata(ints)[:, j].astype(np.int64), mask=int_mask[:, j])
    cat_mask = np.ma.getmaskarray(cats)
    shifts = np.arange(28, -4, -4, dtype=np.uint64)
    for j, name in enumerate(CAT_NAMES):
        values = np.ma.getdata(cats)[:, j].astype(np.uint64)
        chars = _HEX_DIGITS[((values[:, None] >> shifts) & np.uint64(15)).astype(np.intp)]
        offsets = pa.py_buffer(np.arange(0, 8 * n + 1, 8, dtype=np.int32).tobytes())
        valid = pa.array(~cat_mask[:, j]).buffers()[1]
        cols[name] = pa.StringArray.from_buffers(
            n, offsets, pa.py_buffer(chars.tobytes()), valid, int(cat_mask[:, j].sum())
        )
    sink = pa.BufferOutputStream()
    pcsv.write_csv(
        pa.table(cols),
        sink,
        pcsv.WriteOptions(include_header=False, delimiter=delimiter, quoting_style="none"),
    )
    head = (delimiter.join(cols) + "\n").encode() if header else b""
    return head + sink.getvalue().to_pybytes()
