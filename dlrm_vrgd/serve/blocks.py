"""Blocks of whole lines of one score input, plain or gzip, in memory bounded by the block
whatever the compression ratio.

:class:`~dlrm_vrgd.data.criteo.format.BlockReader` hands the decompressor 4 MiB of compressed
bytes at a time and keeps everything it returns: 2 MB of gzip holding one 2 GiB line (or 2 GiB
of NULs) became ~3 GB in memory before the line-length check could run. :class:`BoundedBlockReader`
asks zlib for at most what the block still lacks (``max_length``; the rest of the compressed
input waits in ``unconsumed_tail``), so a block never exceeds ``block_bytes`` plus one
decompressed piece, and a line longer than
:data:`~dlrm_vrgd.data.criteo.format.MAX_LINE_BYTES` after decompression fails with
``FILE:LINE`` exactly as the same bytes uncompressed do. Plain files are read as
``BlockReader`` reads them.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import BinaryIO

from dlrm_vrgd.data.criteo.format import (
    MAX_LINE_BYTES,
    BlockReader,
    CriteoFormatError,
    open_input,
)

#: Compressed bytes read at a time.
READ_BYTES = 1 << 20
#: Most decompressed bytes asked of zlib at a time.
PIECE_BYTES = 4 << 20


def gzip_pieces(raw: BinaryIO, path: str, want: list[int]) -> Iterator[bytes]:
    """The decompressed bytes of every gzip member of ``raw``, each piece at most
    ``min(want[0], PIECE_BYTES)`` bytes (``want[0]``: what the caller still lacks, read before
    each piece). :class:`CriteoFormatError` for a corrupt or truncated stream."""
    d = zlib.decompressobj(wbits=31)
    fed = full = False
    pending = b""
    while True:
        if not pending and not full:
            pending = raw.read(READ_BYTES)
            if not pending:
                break
        limit = max(1, min(want[0], PIECE_BYTES))
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


class BoundedBlockReader(BlockReader):
    """:class:`BlockReader` whose gzip input is decompressed at most one block ahead (see the
    module docstring): blocks of whole lines, about ``block_bytes`` each, each ending in a
    newline; ``position`` (compressed bytes for gzip), ``lines`` and ``ends_with_newline`` as
    ``BlockReader``'s."""

    def blocks(self) -> Iterator[bytearray]:
        if not self.gzip:
            yield from super().blocks()
            return
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
        if buf:
            if b"\n" not in buf:
                self._check_line(buf)
            self.ends_with_newline = buf.endswith(b"\n")
            if not self.ends_with_newline:
                buf += b"\n"
            yield buf

    def _check_line(self, buf: bytearray) -> None:
        """The uncompressed reader's rule: a line past MAX_LINE_BYTES is not Criteo text."""
        if len(buf) > MAX_LINE_BYTES:
            raise CriteoFormatError(
                f"{self.path}:{self.lines + 1}: a line longer than {MAX_LINE_BYTES:,} bytes: "
                "not Criteo text (a binary file?)"
            )
