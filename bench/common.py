"""Helpers shared by the benchmarks: interleaved timing, medians, tables."""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# torchrec's import trips torch.fx's "is_fx_tracing" notice; it says nothing about our runs.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


def interleaved_medians(
    variants: dict[str, Callable[[], object]], reps: int, warmup: int = 2
) -> dict[str, float]:
    """Median wall time (s) of each variant, running them round-robin so that machine drift
    hits every variant alike."""
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, row in enumerate(cells):
        print(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if j == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def threads() -> int:
    return int(os.environ.get("BENCH_THREADS", str(os.cpu_count() or 1)))
