"""Text from a server, made safe to print on a terminal.

A service (or anyone answering in its place) controls every string the ``dlrm-vrgd jobs``
client prints: job names, errors, log lines, event messages. Printed raw, an escape sequence
in one can move the cursor, rewrite what was printed, set the window title, or (OSC 52) write
the clipboard. :func:`printable` shows every control character instead of sending it: C0
controls but tab and newline, DEL, C1 controls, and the bidirectional overrides that reorder
what a reader sees (``\\x1b`` is shown as ``\\x1b``, U+202E as ``\\u202e``).
"""

from __future__ import annotations

import re
from typing import Any

#: Characters never sent to a terminal as they are.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _shown(m: re.Match[str]) -> str:
    code = ord(m.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, keep_newlines: bool = True) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``); newlines and
    tabs kept (``keep_newlines``: else shown too, for one-line fields)."""
    text = _CONTROL.sub(_shown, text)
    if not keep_newlines:
        text = text.replace("\n", "\\n").replace("\t", "\\t")
    return text


def clean(value: Any) -> Any:
    """A decoded JSON answer with :func:`printable` applied to every string in it (keys too)."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, list):
        return [clean(v) for v in value]
    if isinstance(value, dict):
        return {printable(str(k)): clean(v) for k, v in value.items()}
    return value
