"""``dlrm_vrgd.safejson``: JSON nested past the bound is a ValueError, never a RecursionError,
counted outside strings; what nests within the bound parses as ``json`` parses it."""

from __future__ import annotations

import json

import pytest

from dlrm_vrgd import safejson


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        (b"1", 0),
        (b"[]", 1),
        (b'{"a": [1, {"b": [[]]}]}', 5),
        (b'{"a": "[[[[[[", "b": "\\"[[["}', 1),  # brackets inside strings do not count
        (b'["\\\\", [[]]]', 3),  # an escaped backslash ends before the quote
        (b"[[]][[[]]]", 3),  # the deepest point, not the count
    ],
)
def test_depth_is_counted_outside_strings(text: bytes, depth: int) -> None:
    assert safejson.depth(text) == depth


def test_within_the_bound_it_is_json() -> None:
    value = {"a": [1, 2.5, None, True, {"b": "x[y"}], "c": "\u00e9"}
    text = json.dumps(value)
    assert safejson.loads(text) == value == safejson.loads(text.encode())
    assert safejson.loads(b"[" * 64 + b"]" * 64) is not None


@pytest.mark.parametrize("n", [65, 1000, 100_000, 1_000_000])
def test_past_the_bound_is_a_value_error_not_a_recursion_error(n: int) -> None:
    with pytest.raises(ValueError, match=f"nested {n} levels deep, over 64"):
        safejson.loads(b"[" * n + b"]" * n)
    with pytest.raises(ValueError, match="nested"):
        safejson.loads(b'{"a":' * n + b"1" + b"}" * n)


def test_describe_repeats_nothing_of_the_input() -> None:
    for bad in (b'{"secret-value": ', b"\xff\xfe", b"[" * 100):
        with pytest.raises(ValueError) as err:
            safejson.loads(bad)
        assert "secret" not in safejson.describe(err.value)
