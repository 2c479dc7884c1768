"""Every benchmark figure that docs/benchmarks.md and README.md quote is the saved one.

A quoted figure is marked where it stands, by the saved run and the figure's key in it::

    × 1.083<!-- bench/results/2026-12-02.json#benches.memory.figures.ratio_512k_16k -->

(the comment renders as nothing). The number just before the marker must be the saved value
rounded to the decimals shown (a trailing ``%`` reads the saved fraction as a percentage); in
the sections of docs/benchmarks.md whose heading names a results file, every number of a table's
``measured`` columns must carry a marker; and every saved run states its machine and load.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/benchmarks.md", "README.md")
MARKED = re.compile(
    r"(?P<value>-?\d[\d,]*(?:\.\d+)?)(?P<pct>%?)\s*"
    r"<!--\s*(?P<file>bench/results/[\w.-]+\.json)#(?P<key>[\w.-]+)\s*-->"
)
MARKER = re.compile(r"<!--\s*bench/results/[^>]*-->")


def lookup(saved: Any, key: str) -> Any:
    """``saved`` at a dotted key (``benches.memory.figures.ratio_512k_16k``; a list index is a
    number: ``machine.loadavg.0``)."""
    node = saved
    for part in key.split("."):
        if isinstance(node, list):
            node = node[int(part)]
        else:
            node = node[part]
    return node


def quoted_figures() -> list[tuple[str, int, str, str, str, str]]:
    """``(doc, line, value, pct, file, key)`` of every marked figure."""
    out = []
    for doc in DOCS:
        for n, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
            for m in MARKED.finditer(line):
                out.append((doc, n, m["value"], m["pct"], m["file"], m["key"]))
    return out


def load(file: str) -> dict[str, Any]:
    return json.loads((ROOT / file).read_text())


def test_the_benchmarks_page_quotes_saved_figures() -> None:
    docs = {doc for doc, *_ in quoted_figures()}
    # the benchmarks page quotes the saved run; the README's short table may quote it (checked
    # below when it does) or point to the page's earlier-runs table, which says they are stale
    assert "docs/benchmarks.md" in docs, "no marked figure in docs/benchmarks.md"


@pytest.mark.parametrize(
    ("doc", "line", "value", "pct", "file", "key"),
    quoted_figures(),
    ids=lambda v: str(v) if isinstance(v, int) else None,
)
def test_each_quoted_figure_is_the_saved_one(
    doc: str, line: int, value: str, pct: str, file: str, key: str
) -> None:
    where = f"{doc}:{line}"
    assert (ROOT / file).is_file(), f"{where}: {file} does not exist"
    try:
        saved = lookup(load(file), key)
    except (KeyError, IndexError, ValueError):
        pytest.fail(f"{where}: {file} has no {key}")
    assert isinstance(saved, int | float), f"{where}: {file}#{key} is not a number: {saved!r}"
    if pct:
        saved = saved * 100
    digits = value.partition(".")[2]
    quoted = float(value.replace(",", ""))
    assert round(saved, len(digits)) == pytest.approx(quoted, abs=1e-12), (
        f"{where}: quotes {value}{pct}, {file}#{key} is {saved}"
    )


def saved_sections(text: str) -> list[tuple[str, str]]:
    """``(heading, body)`` of the sections whose heading names a results file."""
    parts = re.split(r"^(#+ .*)$", text, flags=re.M)
    return [
        (head, body)
        for head, body in zip(parts[1::2], parts[2::2], strict=True)
        if "bench/results/" in head
    ]


def test_every_measured_number_in_a_saved_table_is_marked() -> None:
    text = (ROOT / "docs/benchmarks.md").read_text()
    sections = saved_sections(text)
    assert sections, "docs/benchmarks.md has no section naming a bench/results file"
    checked = 0
    for head, body in sections:
        file = re.search(r"bench/results/[\w.-]+\.json", head)[0]  # type: ignore[index]
        assert (ROOT / file).is_file(), f"{head}: {file} does not exist"
        header: list[str] | None = None
        for line in body.splitlines():
            if not line.startswith("|"):
                header = None
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
                continue
            if set("".join(cells)) <= set("-: "):
                continue  # the |---| line
            for name, cell in zip(header, cells, strict=True):
                if not name.lower().startswith("measured"):
                    continue
                bare = MARKER.sub("", MARKED.sub("", cell))
                assert not re.search(r"\d", bare), f"{head}: unmarked figure in {cell!r}"
                checked += 1
    assert checked, "no measured column in the saved sections"


@pytest.mark.parametrize("file", sorted({f for *_, f, _ in quoted_figures()}))
def test_a_saved_run_states_its_machine_and_load(file: str) -> None:
    saved = load(file)
    m = saved["machine"]
    assert m["cpu_count"] >= 1 and len(m["loadavg"]) == 3 and m["torch"]
    assert len(saved["loadavg_after"]) == 3
    for name, bench in saved["benches"].items():
        assert bench["exit"] == 0, f"{file}: {name} failed"
        if "figures" in bench:  # each bench's own machine and load, at its end
            assert len(bench["machine"]["loadavg"]) == 3


def test_a_wrong_figure_fails() -> None:
    """The check can fail: a figure one unit off in its last decimal does not match."""
    figures = quoted_figures()
    doc, line, value, pct, file, key = figures[0]
    saved = lookup(load(file), key) * (100 if pct else 1)
    digits = len(value.partition(".")[2])
    wrong = float(value.replace(",", "")) + 10**-digits
    assert round(saved, digits) != pytest.approx(wrong, abs=1e-12)
