"""Coverage of ``dlrm-vrgd advise``'s 95% interval for B_simple (issue 48).

Simulated windows of per-step ``(S, |G|²)`` estimates, with a known truth:

- **AR(1)**: both series stationary AR(1) with coefficient φ ∈ {0, 0.5, 0.9} around
  ``S = 2000``, ``|G|² = 1`` (B_simple = 2,000), marginal sds 600 and 1 (so 16% of the
  per-step ``|G|²`` are ≤ 0, as in the demo's model scope), innovations correlated −0.3;
  windows of n ∈ {30, 62, 200, 1000} records. The truth is 2,000.
- **Drift**: a latent ``|G|²`` that falls from 1.5 to 0.7 across the window with a slow wander
  (an AR(1) at 1 − 3/n, sd 0.25) and a latent ``S`` wandering ±20%, under independent
  per-step (micro-batch) noise of sd 1.5 and 600 that hides the drift. The truth is the
  window's ratio of latent means, ``Σ S_latent / Σ |G|²_latent``: what the interval is for.

The rule, in every cell: among the windows that print an interval (``trustworthy``), the
coverage of the truth is not shown to be below 0.95 (the Clopper–Pearson upper bound of the
share is above 0.95); where at least :data:`MEASURED` windows print one (enough for a coverage
figure to mean something: its standard error is then under 0.022), the share is also ≥ 0.93.
The cells that print fewer are pooled and held to both. The check fails on the
circular-block percentile bootstrap that ``advise`` used before.

``python tests/test_interval_coverage.py [--old] [--reps N]`` prints the whole table (the
docs quote it).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import numpy as np
import pytest
from scipy.signal import lfilter

from dlrm_vrgd.bootstrap import batch_means_ratio_interval, ratio_interval
from dlrm_vrgd.study.stats import clopper_pearson

TRUE_B = 2000.0
BURN = 300
#: Printed windows from which a cell's coverage is held to ≥ 0.93 (fewer: pooled).
MEASURED = 100

Interval = Callable[[np.ndarray, np.ndarray], tuple[float, float] | None]


def _ar1(phi: float, innovations: np.ndarray, sd: float) -> np.ndarray:
    """Stationary AR(1) rows of marginal sd ``sd`` from standard normal ``innovations``
    (``reps x (n + BURN)``), the first BURN steps dropped."""
    x = lfilter([1.0], [1.0, -phi], innovations * sd * math.sqrt(1 - phi**2), axis=1)
    return x[:, BURN:]


def _correlated(rng: np.random.Generator, shape: tuple[int, int], corr: float = -0.3):
    e1 = rng.normal(size=shape)
    return e1, corr * e1 + math.sqrt(1 - corr**2) * rng.normal(size=shape)


def ar_cell(phi: float, n: int, reps: int, seed: int):
    """``(S, |G|², truth)``: ``reps`` windows of ``n`` AR(1) records (see the module doc)."""
    rng = np.random.default_rng(seed)
    e_g, e_s = _correlated(rng, (reps, n + BURN))
    g2 = 1.0 + _ar1(phi, e_g, 1.0)
    s = TRUE_B * (1.0 + _ar1(phi, e_s, 0.3))
    return s, g2, np.full(reps, TRUE_B)


def drift_cell(n: int, reps: int, seed: int):
    """``(S, |G|², truth)``: a latent drift under per-step noise (see the module doc)."""
    rng = np.random.default_rng(seed)
    slow = 1.0 - 3.0 / n
    wander = _ar1(slow, rng.normal(size=(reps, n + BURN)), 0.25)
    g2_latent = 1.5 - 0.8 * np.arange(n) / n + wander
    s_latent = TRUE_B * (1.0 + _ar1(slow, rng.normal(size=(reps, n + BURN)), 0.2))
    e_g, e_s = _correlated(rng, (reps, n))
    truth = s_latent.sum(axis=1) / g2_latent.sum(axis=1)
    return s_latent + 0.3 * TRUE_B * e_s, g2_latent + 1.5 * e_g, truth


def new_method(s: np.ndarray, g2: np.ndarray) -> tuple[float, float] | None:
    """``advise``'s interval as ``(lo, hi)`` (+∞ where unbounded), or None where it gives
    none."""
    iv = batch_means_ratio_interval(s, g2)
    if not iv["trustworthy"]:
        return None
    if iv["shape"] == "no_finite":
        return math.inf, math.inf
    return iv["lo"], math.inf if iv["hi"] is None else iv["hi"]


def old_method(s: np.ndarray, g2: np.ndarray) -> tuple[float, float] | None:
    """The percentile block bootstrap ``advise`` used before issue 48 (always printed)."""
    iv = ratio_interval(s, g2)
    lo = math.inf if iv["lo"] is None else iv["lo"]
    return lo, math.inf if iv["hi"] is None else iv["hi"]


def coverage(method: Interval, cell: tuple[np.ndarray, np.ndarray, np.ndarray]) -> dict:
    """The cell's windows: how many printed an interval, how many of those held the truth."""
    s, g2, truth = cell
    printed = hits = unbounded = 0
    for i in range(len(truth)):
        iv = method(s[i], g2[i])
        if iv is None:
            continue
        printed += 1
        hits += iv[0] <= truth[i] <= iv[1]
        unbounded += math.isinf(iv[1])
    out = {"windows": len(truth), "printed": printed, "hits": hits, "unbounded": unbounded}
    if printed:
        out["coverage"] = hits / printed
        out["cp"] = clopper_pearson(hits, printed)
    return out


def failures(c: dict) -> list[str]:
    """What a cell's (or a pool's) figures break of the rule (see the module doc); [] if
    nothing."""
    bad = []
    if c["printed"] and c["cp"][1] <= 0.95:
        bad.append(f"Clopper-Pearson upper {c['cp'][1]:.3f} <= 0.95")
    if c["printed"] >= MEASURED and c["coverage"] < 0.93:
        bad.append(f"coverage {c['coverage']:.3f} < 0.93")
    return bad


def pooled(figures: list[dict]) -> dict:
    """The cells that printed fewer than :data:`MEASURED` windows, as one."""
    few = [c for c in figures if c["printed"] < MEASURED]
    out = {k: sum(c[k] for c in few) for k in ("windows", "printed", "hits", "unbounded")}
    if out["printed"]:
        out["coverage"] = out["hits"] / out["printed"]
        out["cp"] = clopper_pearson(out["hits"], out["printed"])
    return out


def cells(reps: int, which: list[str] | None = None):
    """The grid's cells by name, with fixed seeds (``which``: only those)."""
    grid = [f"ar phi={p} n={n}" for p in (0.0, 0.5, 0.9) for n in (30, 62, 200, 1000)]
    grid += [f"drift n={n}" for n in (62, 200, 1000)]
    for i, name in enumerate(grid):
        if which is not None and name not in which:
            continue
        n = int(name.rsplit("=", 1)[1])
        if name.startswith("ar"):
            yield name, ar_cell(float(name.split()[1][4:]), n, reps, seed=4800 + i)
        else:
            yield name, drift_cell(n, reps, seed=4800 + i)


#: The default run's cells: white noise at the demo's window length (62 records), the same
#: length at φ = 0.5 (an interval in a few windows only: the selection that broke coverage
#: before the floor) and at φ = 0.9 (none), a correlated 200, a strongly correlated 1,000, and
#: the drift.
FAST = ["ar phi=0.0 n=62", "ar phi=0.5 n=62", "ar phi=0.9 n=62", "ar phi=0.5 n=200",
        "ar phi=0.9 n=1000", "drift n=200"]  # fmt: skip


def test_the_interval_covers_where_it_is_printed() -> None:
    got = {name: coverage(new_method, cell) for name, cell in cells(2000, FAST)}
    for name, c in got.items():
        assert failures(c) == [], (name, c)
    assert failures(pooled(list(got.values()))) == []
    # what the figures are made of: the white window nearly always gets an interval, the
    # correlated one of the same length seldom, the strongly correlated one never
    assert got["ar phi=0.0 n=62"]["printed"] >= 1900
    assert 100 <= got["ar phi=0.5 n=62"]["printed"] <= 400
    assert got["ar phi=0.9 n=62"]["printed"] == 0
    assert got["ar phi=0.9 n=1000"]["printed"] == 2000
    # 30 records: too few to measure their own correlation, whatever it is
    assert next(cells(50, ["ar phi=0.0 n=30"]))[1][0].shape == (50, 30)
    assert coverage(new_method, next(cells(50, ["ar phi=0.0 n=30"]))[1])["printed"] == 0


def test_the_percentile_block_bootstrap_fails_the_same_check() -> None:
    """The method before issue 48, on the demo's window length: it prints every time and
    covers far less than it says once the records are correlated."""
    for name in ("ar phi=0.5 n=62", "ar phi=0.9 n=62"):
        c = coverage(old_method, next(cells(300, [name]))[1])
        assert c["printed"] == 300 and failures(c), (name, c)
    strong = coverage(old_method, next(cells(300, ["ar phi=0.9 n=62"]))[1])
    assert strong["coverage"] < 0.75


@pytest.mark.slow
def test_the_whole_grid() -> None:
    figures = {name: coverage(new_method, cell) for name, cell in cells(4000)}
    bad = {name: (failures(c), c) for name, c in figures.items() if failures(c)}
    assert bad == {}
    assert failures(pooled(list(figures.values()))) == []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", action="store_true", help="the percentile block bootstrap")
    ap.add_argument("--reps", type=int, default=4000)
    args = ap.parse_args()
    method = old_method if args.old else new_method
    print(f"{'cell':<18} {'printed':>9} {'coverage':>8}  Clopper-Pearson  unbounded  verdict")
    figures = []
    for name, cell in cells(args.reps):
        c = coverage(method, cell)
        figures.append(c)
        cov = f"{c['coverage']:.3f}" if c["printed"] else "-"
        cp = f"[{c['cp'][0]:.3f}, {c['cp'][1]:.3f}]" if c["printed"] else "-"
        unb = f"{c['unbounded'] / c['printed']:.2f}" if c["printed"] else "-"
        verdict = "; ".join(failures(c)) or "ok"
        print(f"{name:<18} {c['printed']:>4}/{c['windows']:<4} {cov:>8}  {cp:<15}  "
              f"{unb:>9}  {verdict}", flush=True)  # fmt: skip
    few = pooled(figures)
    if few["printed"]:
        print(f"pooled cells with fewer than {MEASURED} printed: {few['hits']}/{few['printed']} "
              f"covered, Clopper-Pearson [{few['cp'][0]:.3f}, {few['cp'][1]:.3f}]; "
              f"{'; '.join(failures(few)) or 'ok'}")  # fmt: skip


if __name__ == "__main__":
    main()
