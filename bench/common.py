"""Helpers shared by the benchmarks: interleaved timing, medians and their intervals, tables,
and the machine-readable results that ``bench/run_all.py --save`` collects."""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scipy import stats

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# torchrec's import trips torch.fx's "is_fx_tracing" notice; it says nothing about our runs.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


def interleaved_medians(
    variants: dict[str, Callable[[], object]], reps: int, warmup: int = 2
) -> dict[str, float]:
    """Median wall time (s) of each variant over :func:`interleaved_times`."""
    times = interleaved_times(variants, reps, warmup)
    return {name: statistics.median(ts) for name, ts in times.items()}


def interleaved_times(
    variants: dict[str, Callable[[], object]], reps: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Wall times (s) of each variant, ``reps`` of each: every repetition runs every variant
    once, in the given order on even repetitions and reversed on odd ones (A B C, C B A, ...),
    so that drift and a variant's after-effects on the next hit every variant alike, and
    repetition ``i`` of two variants can be compared as a pair."""
    names = list(variants)
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(reps):
        for name in names if i % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
    return times


@dataclass(frozen=True)
class Interval:
    """The median of ``n`` values with a distribution-free confidence interval: the order
    statistics ``[x_(l), x_(n+1-l)]`` whose coverage ``1 - 2·P(Binom(n, 1/2) < l)`` is the
    largest ``l`` still at or above ``confidence`` (the sign-test interval for the median)."""

    median: float
    low: float
    high: float
    coverage: float
    n: int

    @property
    def half_width(self) -> float:
        """The interval's larger side, relative to the median (0.03 = ±3%)."""
        return max(self.high / self.median - 1.0, 1.0 - self.low / self.median)

    def __str__(self) -> str:
        return (
            f"{self.median:.3f} [{self.low:.3f}, {self.high:.3f}] "
            f"({self.coverage:.0%}, ±{self.half_width:.1%}, n = {self.n})"
        )


def median_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """:class:`Interval` of ``values``. With too few values for ``confidence`` (n < 6 at 95%)
    the interval is ``[min, max]`` and its coverage says how much less it is."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("no values")
    lo = 1  # 1-based rank of the lower bound
    while lo < n / 2 and 1.0 - 2.0 * stats.binom.cdf(lo, n, 0.5) >= confidence:
        lo += 1  # P(B < lo + 1) still leaves the coverage at or above the target
    coverage = 1.0 - 2.0 * stats.binom.cdf(lo - 1, n, 0.5)
    return Interval(statistics.median(xs), xs[lo - 1], xs[n - lo], float(coverage), n)


def paired_ratios(times: dict[str, list[float]], of: str, to: str) -> Interval:
    """Median and interval of ``times[of][i] / times[to][i]`` over the repetitions ``i``
    (each pair ran in the same repetition of :func:`interleaved_times`)."""
    return median_interval([a / b for a, b in zip(times[of], times[to], strict=True)])


def machine() -> dict[str, Any]:
    """The machine and its load, for a saved result: cpu count, load averages, versions."""
    import platform

    import torch

    return {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "threads": threads(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def write_result(path: str | None, name: str, figures: dict[str, Any]) -> None:
    """Write one bench's figures (plain JSON values; :class:`Interval` allowed) to ``path``
    (``--json``; nothing when None), with the machine and its load at the end of the bench."""
    if path is None:
        return

    def plain(value: Any) -> Any:
        if isinstance(value, Interval):
            return {**asdict(value), "half_width": value.half_width}
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        return value

    out = {"bench": name, "machine": machine(), "figures": plain(figures)}
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(path)


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
