"""The circular block bootstrap (issue 41): its resampled sums against the distribution
enumerated by hand; its block length against the theory of an AR(1) series; and its coverage of
an AR(1) series' known mean, with a fixed seed — where an i.i.d. bootstrap (blocks of one), the
same code with the correlation thrown away, falls short."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from dlrm_vrgd.bootstrap import block_length, ratio_interval, resampled_sums


def ar1(n: int, phi: float, rng: np.random.Generator, mean: float = 0.0, sd: float = 1.0):
    """A stationary AR(1) series of marginal sd ``sd`` around ``mean`` (200 steps burnt in)."""
    e = rng.normal(0.0, sd * np.sqrt(1 - phi**2), n + 200)
    x = np.zeros(n + 200)
    for t in range(1, n + 200):
        x[t] = phi * x[t - 1] + e[t]
    return mean + x[200:]


def test_resampled_sums_follow_the_distribution_enumerated_by_hand() -> None:
    # x = 1, 2, 4, 8 in blocks of 2, circular: the block sums from each start are 3, 6, 12, 9;
    # a resample is two blocks: its sum is one of the 16 equally likely ordered pairs.
    x = np.array([1.0, 2.0, 4.0, 8.0])
    exact = Counter(a + b for a, b in itertools.product([3, 6, 12, 9], repeat=2))
    draws = 64_000
    got = Counter(resampled_sums(x, 2, draws, np.random.default_rng(0)).tolist())
    assert set(got) == set(exact)
    for total, count in exact.items():
        assert got[total] / draws == pytest.approx(count / 16, abs=0.006), total
    # five rows in blocks of 2: two whole blocks and one cut to a single row (the resample has
    # n rows); every row equally likely, so the mean resampled sum is the sum, 1+2+4+8+16 = 31
    y = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    blocks = [y[i] + y[(i + 1) % 5] for i in range(5)]
    support = {a + b + c for a, b in itertools.product(blocks, repeat=2) for c in y}
    sums = resampled_sums(y, 2, 50_000, np.random.default_rng(1))
    assert set(sums.tolist()) <= support
    assert sums.mean() == pytest.approx(31.0, rel=0.01)
    # block = n: every resample is the series rotated, whose sum is the sum
    assert set(resampled_sums(y, 5, 100, np.random.default_rng(2)).tolist()) == {31.0}
    with pytest.raises(ValueError, match="block 6"):
        resampled_sums(y, 6, 10, np.random.default_rng(0))


def test_block_length_tracks_the_autocorrelation() -> None:
    """The Politis-White length for the circular bootstrap of an AR(1) mean is
    ``(3/2 (2φ / (1 − φ²))²)^(1/3) n^(1/3)``: 13.1 at φ = 0.7, n = 200, and ~1 for white noise."""
    rng = np.random.default_rng(3)
    median = {
        phi: np.median([block_length(ar1(200, phi, rng)) for _ in range(40)])
        for phi in (0.0, 0.7, 0.9)
    }
    theory = (1.5 * (2 * 0.7 / (1 - 0.49)) ** 2) ** (1 / 3) * 200 ** (1 / 3)
    assert theory == pytest.approx(13.1, abs=0.1)
    assert median[0.0] <= 3
    assert theory / 2 <= median[0.7] <= theory * 1.5
    assert median[0.9] > median[0.7]
    assert block_length(np.ones(50)) == 1 and block_length(np.array([1.0, 2.0])) == 1


def _coverage(block: int | None, reps: int = 200) -> float:
    """Share of ``reps`` AR(1) series (φ = 0.6, n = 200, mean 5) whose 95% percentile interval
    of the mean holds 5 (fixed seeds: the same number every run)."""
    rng = np.random.default_rng(2024)
    hits = 0
    for r in range(reps):
        x = ar1(200, 0.6, rng, mean=5.0)
        b = block_length(x) if block is None else block
        means = resampled_sums(x, b, 1000, np.random.default_rng(r)) / len(x)
        lo, hi = np.quantile(means, [0.025, 0.975])
        hits += lo <= 5.0 <= hi
    return hits / reps


def test_the_interval_covers_an_ar1_mean_and_an_iid_bootstrap_does_not() -> None:
    """At φ = 0.6 the mean's sd is 2x what independent rows would give; blocks keep that.
    Measured with these seeds: 0.875 with the chosen blocks, 0.625 with blocks of one (the
    percentile interval of a block bootstrap is a little short at n = 200)."""
    assert _coverage(None) >= 0.85
    assert _coverage(1) <= 0.72  # broken on purpose: the correlation thrown away


def test_the_ratio_interval_covers_a_known_ratio_and_says_when_it_is_unbounded() -> None:
    rng = np.random.default_rng(5)
    hits = 0
    for r in range(150):
        num = ar1(120, 0.5, rng, mean=100.0, sd=40.0)
        den = ar1(120, 0.5, rng, mean=1.0, sd=0.8)
        iv = ratio_interval(num, den, resamples=1000, seed=r)
        hi = np.inf if iv["hi"] is None else iv["hi"]
        hits += iv["lo"] <= 100.0 <= hi
    assert hits / 150 >= 0.84
    # a signal lost in the noise: Σ den <= 0 in most resamples: no finite upper bound
    iv = ratio_interval(np.full(20, 5.0), np.r_[np.full(10, 1.0), np.full(10, -1.05)])
    assert iv["estimate"] is None and iv["hi"] is None and iv["unbounded_share"] > 0.025
    again = ratio_interval(np.arange(1.0, 21.0), np.full(20, 2.0))
    assert again == ratio_interval(np.arange(1.0, 21.0), np.full(20, 2.0))  # seeded
    assert again["estimate"] == pytest.approx(210 / 40)
