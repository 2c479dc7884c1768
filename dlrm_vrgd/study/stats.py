"""The study's statistics, exact and dependency-free: Student-t intervals and p-values for
paired differences, Clopper–Pearson intervals for a count, Fisher's exact test for two counts.

The t and beta distributions go through the regularized incomplete beta function
``I_x(a, b)`` (Lentz's continued fraction, as in Numerical Recipes §6.4); quantiles are found by
bisection on the CDF, to far below the digits the reports print.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

#: Two-sided confidence level of every interval in the reports.
LEVEL = 0.95


def _betacf(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` (the Beta(a, b) CDF at x)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
    ln += b * math.log1p(-x)
    front = math.exp(ln)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _bisect(f: Any, lo: float, hi: float, target: float) -> float:
    """x in [lo, hi] with f(x) = target, f increasing."""
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-14 * max(1.0, abs(mid)):
            break
    return 0.5 * (lo + hi)


def t_cdf(t: float, df: int) -> float:
    """Student-t CDF with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_ppf(q: float, df: int) -> float:
    """Student-t quantile (``0 < q < 1``)."""
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -t_ppf(1.0 - q, df)
    hi = 1.0
    while t_cdf(hi, df) < q:
        hi *= 2.0
    return _bisect(lambda t: t_cdf(t, df), 0.0, hi, q)


def beta_ppf(q: float, a: float, b: float) -> float:
    return _bisect(lambda x: betainc(a, b, x), 0.0, 1.0, q)


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
        out["p"] = 2.0 * (1.0 - t_cdf(abs(t), n - 1))
    return out


def clopper_pearson(x: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The exact (Clopper–Pearson) ``level`` interval of a proportion ``x / n``."""
    if n <= 0:
        raise ValueError("clopper_pearson needs n >= 1")
    alpha = 1.0 - level
    lo = 0.0 if x == 0 else beta_ppf(alpha / 2.0, x, n - x + 1)
    hi = 1.0 if x == n else beta_ppf(1.0 - alpha / 2.0, x + 1, n - x)
    return lo, hi


def fisher_exact(a: int, n1: int, b: int, n2: int) -> float:
    """Two-sided p-value of Fisher's exact test: ``a`` of ``n1`` against ``b`` of ``n2`` (the sum
    of the hypergeometric probabilities of every table no more likely than the observed one)."""
    total, k = n1 + n2, a + b
    denom = math.comb(total, k)

    def prob(x: int) -> float:
        return math.comb(n1, x) * math.comb(n2, k - x) / denom

    observed = prob(a)
    lo, hi = max(0, k - n2), min(k, n1)
    p = sum(prob(x) for x in range(lo, hi + 1) if prob(x) <= observed * (1 + 1e-7))
    return min(1.0, p)
