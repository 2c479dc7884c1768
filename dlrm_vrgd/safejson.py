"""JSON written by someone else, parsed with bounds: nesting depth, and (the caller's) size.

Python's :func:`json.loads` recurses once per nesting level: a line of 100,000 ``[`` raises
:class:`RecursionError` (not :class:`ValueError`), which escapes every ``except ValueError`` of
a reader and, in a server, becomes a 500 or stops a loop. :func:`loads` counts the nesting
first, outside strings, in one vectorised pass, and refuses anything deeper than
:data:`MAX_DEPTH` with :class:`JsonLimitError` (a :class:`ValueError`). The files this project
writes nest a few levels (a ``gsnr.jsonl`` record: 4).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

#: Deepest nesting of arrays and objects accepted.
MAX_DEPTH = 64

#: A JSON string (escapes included), in bytes.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_KEEP = b"[]{}"
_DROP = bytes(b for b in range(256) if b not in _KEEP)


class JsonLimitError(ValueError):
    """JSON nested deeper than allowed."""


def depth(data: bytes | str) -> int:
    """The deepest nesting of ``[``/``{`` in ``data`` outside strings (unbalanced text counts as
    far as it goes)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    brackets = _STRING.sub(b"", raw).translate(None, _DROP)
    if not brackets:
        return 0
    b = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((b == ord("[")) | (b == ord("{")), 1, -1).astype(np.int64)
    return int(np.cumsum(steps).max(initial=0))


def check_depth(data: bytes | str, max_depth: int = MAX_DEPTH) -> None:
    """:class:`JsonLimitError` when ``data`` nests deeper than ``max_depth``."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return  # cannot nest deeper than it has brackets
    found = depth(raw)
    if found > max_depth:
        raise JsonLimitError(f"nested {found} levels deep, over {max_depth}")


def loads(data: bytes | bytearray | str, max_depth: int = MAX_DEPTH) -> Any:
    """:func:`json.loads` of ``data`` nested at most ``max_depth`` levels; only
    :class:`ValueError` (:class:`json.JSONDecodeError`, :class:`JsonLimitError`,
    :class:`UnicodeDecodeError`) for bad input."""
    if isinstance(data, bytearray):
        data = bytes(data)
    check_depth(data, max_depth)
    try:
        return json.loads(data)
    except RecursionError:  # a bound deeper than the interpreter's stack allows
        raise JsonLimitError(f"nested too deep for this interpreter (over {max_depth})") from None


def describe(err: ValueError) -> str:
    """A short reason for ``err`` that repeats nothing of the input."""
    if isinstance(err, JsonLimitError):
        return str(err)
    if isinstance(err, json.JSONDecodeError):
        return f"{err.msg} at line {err.lineno} column {err.colno}"
    if isinstance(err, UnicodeDecodeError):
        return f"not UTF-8 (byte {err.start})"
    return type(err).__name__
