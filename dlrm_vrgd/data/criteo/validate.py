"""The exact path of block parsing: which rows of a block hold a value outside the accepted
syntax (see :mod:`dlrm_vrgd.data.criteo.parse`), and why.

Runs only for blocks where the fast path failed. The block is re-read with every column as
text; hex ids are checked with a regex; integers with a regex of what pyarrow's CSV reader
accepts, each distinct value the regex refuses being re-checked by pyarrow itself (and a value
pyarrow names in its error, e.g. an int64 overflow, marked too), so that both paths agree on
every value whichever block it falls in.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from dlrm_vrgd.data.criteo.format import CAT_NAMES, Layout, fast_types, read_table

_INT_SYNTAX = rb"^ *-?(?:[0-9]+|0[xX][0-9a-fA-F]+) *$"
_HEX_SYNTAX = rb"^[0-9a-fA-F]{1,16}$"
_CONVERSION_ERROR = re.compile(r"In CSV column #(\d+):(?: Row #\d+:)? .*invalid value '(.*)'$")


def _arrow_int(value: bytes, layout: Layout) -> int | None:
    """``value`` as pyarrow's CSV reader converts it to int64, or None if it refuses it."""
    try:
        table = pcsv.read_csv(
            pa.py_buffer(value + b"\n"),
            read_options=pcsv.ReadOptions(column_names=["x"], use_threads=False),
            parse_options=pcsv.ParseOptions(delimiter=layout.delimiter, quote_char=False),
            convert_options=pcsv.ConvertOptions(column_types={"x": pa.int64()}, null_values=[""]),
        )
    except pa.ArrowInvalid:
        return None
    return table.column(0)[0].as_py()


def bad_values(
    buf: bytes | bytearray,
    layout: Layout,
    uncapped: bool,
    arrow_error: tuple[str, bytes] | None,
) -> list[tuple[int, str]]:
    """``(row, reason)`` for every row of ``buf`` with a value outside the accepted syntax
    (module docstring); rows are numbered over the non-empty lines of ``buf``.

    Integers are checked against a regex of what pyarrow accepts, and each distinct value the
    regex refuses is re-checked by pyarrow itself, so both paths agree on every value."""
    names = list(fast_types(layout))
    table = read_table(buf, layout, {n: pa.binary() for n in names})
    bad: dict[int, str] = {}
    for name in names:
        col = table.column(name).combine_chunks()
        values: list[bytes | None] = col.to_pylist()

        # reasons name the field, never its value: an input may be anyone's file
        if name in CAT_NAMES:
            ok = pc.fill_null(pc.match_substring_regex(col, _HEX_SYNTAX.decode()), True)
            ok_np = ok.to_numpy(zero_copy_only=False)
            for r in np.flatnonzero(~ok_np).tolist():
                bad.setdefault(r, f"{name}: not a hexadecimal id (1-16 digits)")
            if uncapped:
                for r in np.flatnonzero(ok_np).tolist():
                    v = values[r]
                    if v is not None and len(v) == 16 and int(v[:1], 16) >= 8:
                        bad.setdefault(
                            r, f"{name}: the id does not fit int64; use --max-rows-per-table"
                        )
            continue
        if name == "label":
            label_of = {v: _arrow_int(v, layout) for v in set(values) if v is not None}
            for r, v in enumerate(values):
                if v is not None and label_of[v] not in (0, 1):
                    bad.setdefault(r, "label: not 0 or 1")
            continue
        ok = pc.fill_null(pc.match_substring_regex(col, _INT_SYNTAX.decode()), True)
        ok_np = ok.to_numpy(zero_copy_only=False).copy()
        failing = np.flatnonzero(~ok_np).tolist()
        distinct = list(dict.fromkeys(values[r] for r in failing))[:256]
        accepted = {v for v in distinct if v is not None and _arrow_int(v, layout) is not None}
        for r in failing:
            if values[r] not in accepted:
                bad.setdefault(r, f"{name}: not an integer")
        if arrow_error is not None and arrow_error[0] == name:
            for r, v in enumerate(values):
                if v == arrow_error[1]:
                    bad.setdefault(r, f"{name}: not a 64-bit integer")
    return sorted(bad.items())


def conversion_error(err: pa.ArrowInvalid, layout: Layout) -> tuple[str, bytes] | None:
    """``(column, value)`` named by a pyarrow conversion error, if it names one."""
    m = _CONVERSION_ERROR.search(str(err))
    if m is None:
        return None
    return layout.names[int(m.group(1))], m.group(2).encode()
