"""The study's statistics: Student-t intervals and p-values for paired differences,
Clopper–Pearson intervals for a count, Fisher's exact test for two counts (``scipy.stats``),
and Holm's step-down adjustment of a family of p-values."""

from __future__ import annotations

import math
import statistics
from typing import Any

from scipy import stats as sps

#: Two-sided confidence level of every interval in the reports.
LEVEL = 0.95


def t_ppf(q: float, df: int) -> float:
    """Student-t quantile (``0 < q < 1``) with ``df`` degrees of freedom."""
    return float(sps.t.ppf(q, df))


def paired(diffs: list[float], level: float = LEVEL) -> dict[str, Any]:
    """Mean, sd, n, the ``level`` t-interval (df = n − 1) and the two-sided p-value of the
    one-sample t-test of ``diffs`` (per-seed differences) against 0. With n < 2 there is no
    interval (None); with sd = 0 the interval is the point and p is 0 (or 1 at a zero mean)."""
    n = len(diffs)
    out: dict[str, Any] = {"n": n, "mean": None, "sd": None, "lo": None, "hi": None, "p": None}
    if n == 0:
        return out
    mean = sum(diffs) / n
    out["mean"] = mean
    if n < 2:
        return out
    sd = statistics.stdev(diffs)
    half = t_ppf(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    out.update(sd=sd, lo=mean - half, hi=mean + half)
    if sd == 0.0:
        out["p"] = 1.0 if mean == 0.0 else 0.0
    else:
        t = mean / (sd / math.sqrt(n))
        out["p"] = float(2.0 * sps.t.sf(abs(t), n - 1))
    return out


def clopper_pearson(x: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The exact (Clopper–Pearson) ``level`` interval of a proportion ``x / n``."""
    if n <= 0:
        raise ValueError("clopper_pearson needs n >= 1")
    alpha = 1.0 - level
    lo = 0.0 if x == 0 else float(sps.beta.ppf(alpha / 2.0, x, n - x + 1))
    hi = 1.0 if x == n else float(sps.beta.ppf(1.0 - alpha / 2.0, x + 1, n - x))
    return lo, hi


def fisher_exact(a: int, n1: int, b: int, n2: int) -> float:
    """Two-sided p-value of Fisher's exact test: ``a`` of ``n1`` against ``b`` of ``n2``."""
    return float(sps.fisher_exact([[a, n1 - a], [b, n2 - b]]).pvalue)


#: Family-wise error rate at which a primary endpoint "survives" Holm's correction.
ALPHA = 0.05


def holm(ps: list[float | None]) -> list[float | None]:
    """Holm's (1979) step-down adjusted p-values of a family of ``m = len(ps)`` tests.

    Sorted ascending, ``p_(i)`` (i = 1..m) becomes ``max_{j <= i} min(1, (m - j + 1) p_(j))``;
    a test is rejected at family-wise level α iff its adjusted p is ≤ α. A missing p (an
    endpoint whose cells have not run) counts in ``m`` as a test that is never rejected (p = 1),
    so the family is the one registered, not the one that happened to finish; its adjusted p is
    None."""
    filled = [1.0 if p is None else float(p) for p in ps]
    for p in filled:
        if not 0.0 <= p <= 1.0:  # NaN fails both comparisons
            raise ValueError(f"holm: p-value {p} is not in [0, 1]")
    m = len(filled)
    out: list[float | None] = [None] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: filled[i])):
        running = max(running, min(1.0, (m - rank) * filled[i]))
        out[i] = None if ps[i] is None else running
    return out
