"""Intervals for the ratio of the means of two paired series: a run's per-step ``S`` and
``|G|²`` estimates (``gsnr.jsonl``), whose ratio of window means is ``dlrm-vrgd advise``'s
B_simple.

:func:`batch_means_ratio_interval` is what ``advise`` uses (issue 48): Fieller's interval for a
ratio of means from the means of ``m`` consecutive batches, with Student-t quantiles on
``m − 1`` degrees of freedom. Neighbouring steps are correlated, so the batches must be long
enough for their means to be nearly independent: the batch length comes from a conservative
(upper) estimate of the lag-1 autocorrelation of the ratio's linearized series, and the
remaining correlation of neighbouring batch means (under an AR(1) at that upper estimate)
widens the interval, whose variance is never below that AR(1)'s long-run variance. Where the
window has fewer than :data:`MIN_RECORDS` records, or fewer than :data:`MIN_BATCHES` batches of
that length fit in it, the records cannot carry a trustworthy interval and none is given.
Measured coverage: ``tests/test_interval_coverage.py`` and docs/noise_scale.md.

The circular block bootstrap (Politis & Romano 1992) with Politis & White's (2004; Patton,
Politis & White 2009) block length, :func:`ratio_interval`, was ``advise``'s method before: its
percentile interval from a handful of independent blocks is too narrow (it covered 0.85 on
62-record windows, 0.44–0.65 at a lag-1 correlation of 0.9). It stays as the comparator that
``tests/test_interval_coverage.py`` shows failing.

:func:`block_length` estimates the optimal block for the circular bootstrap of a mean, ``b* =
(2 G² / D)^(1/3) n^(1/3)`` with ``G = Σ_k |k| γ(k)`` and ``D = (4/3) (Σ_k γ(k))²``, from the
flat-top lag-window estimates of the autocovariances γ, the window's width chosen by the first
run of ``K_n`` insignificant autocorrelations. The resampled sums are formed from precomputed
block sums, so memory is ``resamples x blocks``, not ``resamples x n``. Pure numpy (and scipy's
t quantile).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def block_length(x: np.ndarray) -> int:
    """Politis & White's (2004; Patton et al. 2009) optimal block length of the circular block
    bootstrap for the mean of ``x`` (a 1-D series), rounded up, in ``[1, max(1, n // 3)]``."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    if n < 4:
        return 1
    e = x - x.mean()
    kn = max(5, math.ceil(math.sqrt(math.log10(n))))
    m_max = min(n - 1, math.ceil(math.sqrt(n)) + kn)
    b_max = max(1, min(math.ceil(3 * math.sqrt(n)), n // 3))
    acv = np.array([e[k:] @ e[: n - k] / n for k in range(m_max + 1)])
    if acv[0] <= 0:  # a constant series: nothing to resample
        return 1
    rho = np.abs(acv / acv[0])
    threshold = 2.0 * math.sqrt(math.log10(n) / n)
    m_hat = None
    for m in range(0, m_max - kn + 1):  # the first m whose next kn autocorrelations are small
        if np.all(rho[m + 1 : m + 1 + kn] < threshold):
            m_hat = m
            break
    big_m = m_max if m_hat is None else min(2 * max(m_hat, 1), m_max)
    g = 0.0
    long_run = acv[0]
    for k in range(1, big_m + 1):
        lam = 1.0 if k / big_m <= 0.5 else 2.0 * (1.0 - k / big_m)  # the flat-top window
        g += 2.0 * lam * k * acv[k]
        long_run += 2.0 * lam * acv[k]
    d = (4.0 / 3.0) * long_run**2
    if d <= 0 or g == 0:
        return 1
    b = (2.0 * g**2 / d) ** (1.0 / 3.0) * n ** (1.0 / 3.0)
    return int(min(max(1, math.ceil(b)), b_max))


def resampled_sums(
    series: np.ndarray, block: int, resamples: int, rng: np.random.Generator
) -> np.ndarray:
    """Column sums of ``resamples`` circular-block-bootstrap resamples of ``series`` (``n`` or
    ``n x d``): each resample is ``ceil(n / block)`` blocks of ``block`` consecutive rows
    starting at uniform positions, wrapping around, the last block cut so that the resample
    has ``n`` rows. Returns ``resamples`` (or ``resamples x d``)."""
    x = np.asarray(series, dtype=np.float64)
    flat = x.ndim == 1
    if flat:
        x = x[:, None]
    n = len(x)
    if n == 0:
        raise ValueError("resampled_sums: an empty series")
    if not 1 <= block <= n:
        raise ValueError(f"resampled_sums: block {block} not in [1, {n}]")
    blocks = -(-n // block)
    tail = n - (blocks - 1) * block  # rows of the last, cut block (1..block)
    doubled = np.concatenate([x, x[:block]])
    cum = np.concatenate([np.zeros((1, x.shape[1])), np.cumsum(doubled, axis=0)])
    starts = np.arange(n)
    full = cum[starts + block] - cum[starts]  # the sum of the block starting at each row
    cut = cum[starts + tail] - cum[starts]
    picks = rng.integers(0, n, size=(resamples, blocks))
    sums = full[picks[:, :-1]].sum(axis=1) + cut[picks[:, -1]]
    return sums[:, 0] if flat else sums


def ratio_interval(
    num: np.ndarray,
    den: np.ndarray,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    block: int | None = None,
) -> dict[str, object]:
    """``Σ num / Σ den`` of paired series and its circular-block-bootstrap percentile interval
    at ``level``. The block length is ``block``, or :func:`block_length` of the ratio's
    linearized series ``num − R·den`` (its influence on the ratio). A resample whose ``Σ den``
    is not positive has no finite ratio (the signal is not detected): it counts as +∞, so where
    more than ``(1 − level) / 2`` of them do the upper bound is None (unbounded). The
    ``seed`` fixes the draws: the same series gives the same interval."""
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    if num.shape != den.shape or num.ndim != 1:
        raise ValueError("ratio_interval: num and den must be 1-D series of the same length")
    n = len(num)
    total = den.sum()
    point = float(num.sum() / total) if total > 0 else None
    if block is None:
        block = block_length(num - (point or 0.0) * den) if n >= 4 else 1
    rng = np.random.default_rng(seed)
    sums = resampled_sums(np.stack([num, den], axis=1), block, resamples, rng)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(sums[:, 1] > 0, sums[:, 0] / sums[:, 1], np.inf)
    alpha = (1.0 - level) / 2.0
    # order statistics, not interpolated between them (an infinite ratio stays one)
    lo_q, hi_q = np.quantile(ratios, [alpha, 1.0 - alpha], method="inverted_cdf")
    return {
        "estimate": point,
        "lo": float(lo_q) if np.isfinite(lo_q) else None,
        "hi": float(hi_q) if np.isfinite(hi_q) else None,
        "level": level,
        "block": block,
        "resamples": resamples,
        "records": n,
        "unbounded_share": float(np.mean(~np.isfinite(ratios))),
    }


#: Fewest records for an interval: a shorter window cannot measure its own correlation (the
#: lag-1 autocorrelation's standard error is ``1/√n``: 0.18 at 30 records, where a window of
#: an AR(1) at 0.5 or 0.9 passes for an uncorrelated one often enough to break coverage).
MIN_RECORDS = 50
#: Fewest batches for an interval: with fewer, the window is too short for its correlation and
#: the advice gives no interval (the coverage study, ``tests/test_interval_coverage.py``).
MIN_BATCHES = 5
#: Most batches: more add little once the t quantile is near the normal one.
MAX_BATCHES = 30
#: Batch length ``b ≥ BATCH_FACTOR · φ / (1 − φ²)`` at the upper estimate ``φ`` of the lag-1
#: autocorrelation: under an AR(1), neighbouring batch means then correlate at most
#: ``φ / (b (1 − φ²)) ≈ 1 / BATCH_FACTOR``.
BATCH_FACTOR = 15.0
#: The upper estimate of the lag-1 autocorrelation: its (bias-corrected) estimate plus this
#: many standard errors ``√((1 − φ²) / n)``.
LAG1_Z = 2.0
#: The upper estimate is capped here (a unit root has no mean to estimate).
LAG1_CAP = 0.99


def lag1_upper(z: np.ndarray) -> float:
    """A conservative (upper) estimate of the lag-1 autocorrelation of the series ``z``, in
    ``[0, LAG1_CAP]``: the sample autocorrelation ``r₁`` with Kendall's bias correction
    ``r₁ + (1 + 3 r₁) / n``, plus :data:`LAG1_Z` standard errors ``√((1 − φ²) / n)``."""
    z = np.asarray(z, dtype=np.float64)
    n = len(z)
    e = z - z.mean()
    g0 = float(e @ e)
    r1 = float(e[1:] @ e[:-1]) / g0 if g0 > 0 and n > 1 else 0.0
    phi = min(max(r1 + (1.0 + 3.0 * r1) / max(n, 1), -1.0), 1.0)
    up = phi + LAG1_Z * math.sqrt((1.0 - phi * phi) / max(n, 1))
    return min(max(up, 0.0), LAG1_CAP)


def ar1_inflation(phi: float, batch: int, batches: int) -> float:
    """``Var(grand mean) / (E[s²] / m)`` for ``m = batches`` consecutive means of ``batch``
    steps of a stationary AR(1) with coefficient ``phi`` (``s²``: the batch means' sample
    variance): how much the batch-means variance of the mean understates the true one when
    neighbouring batches are still correlated. 1 at ``phi = 0``; ``≈ 1 + 2φ / (b (1 − φ²))``
    for long batches."""
    if phi <= 0.0:
        return 1.0
    b, m = batch, batches
    k = np.arange(1, b)
    var_sum = b + 2.0 * float(((b - k) * phi**k).sum())  # Var(one batch's sum) / γ(0)
    d = np.arange(1, m)
    # Cov(sums of batches d apart) / γ(0): every pair of steps across them, φ^lag
    cov = phi ** ((d - 1) * b + 1) * (1.0 - phi**b) ** 2 / (1.0 - phi) ** 2
    total = m * var_sum + 2.0 * float(((m - d) * cov).sum())  # Var(Σ of all batch sums)
    expected_s2 = (m * var_sum - total / m) / (m - 1)
    return (total / m) / expected_s2


def batch_means_ratio_interval(
    num: np.ndarray, den: np.ndarray, level: float = 0.95
) -> dict[str, Any]:
    """``R = Σ num / Σ den`` of paired series (``n`` each) and Fieller's ``level`` interval for
    the ratio of their means from batch means.

    The batch length ``b`` is the least that :data:`BATCH_FACTOR` asks at the upper lag-1
    autocorrelation φ (:func:`lag1_upper`) of the linearized series ``den − ρ̂ num`` (``ρ̂ =
    1/R``), and at least ``n / MAX_BATCHES``; ``m = n // b`` batches of near-equal length
    (``b`` or ``b + 1``). With ``x̄_j, ȳ_j`` the batch means of ``num, den``, ``n_j`` their
    lengths and ``V_xy = Σ_j n_j (x̄_j − x̄)(ȳ_j − ȳ) / (m − 1)`` (``V`` estimates ``n`` times
    the covariance of the means), Fieller's set for ``ρ = mean den / mean num`` is

        (ȳ − ρ x̄)² ≤ λ f t² / n · (V_yy − 2ρ V_xy + ρ² V_xx)

    with ``t`` the t quantile on ``m − 1`` d.f., ``f`` = :func:`ar1_inflation` at φ (the
    correlation left between neighbouring batch means) and ``λ ≥ 1`` the floor: at ``ρ̂`` the
    variance is never below the AR(1) long-run variance ``γ₀ (1 + φ) / (1 − φ)`` of the
    linearized series (a window whose correlation reads low is also one whose few batch means
    spread little: without it, the windows that pass the batch count are the ones that miss).
    It is a quadratic inequality in ρ; ``R = 1/ρ`` with ``ρ ≥ 0`` (``|G|²`` cannot be
    negative), so ``shape`` is

    - ``bounded``: ``lo ≤ R ≤ hi``;
    - ``at_least``: ``R ≥ lo``, no finite upper bound (``ρ = 0`` is in the set: no signal is
      an answer the data allow); ``hi`` is None;
    - ``no_finite``: no positive ρ is in the set: no finite R (no signal detected); ``lo``
      and ``hi`` are None;
    - ``any``: ``mean num`` is not clearly positive: ``[0, ∞)``, ``hi`` None.

    With fewer than :data:`MIN_RECORDS` records or :data:`MIN_BATCHES` batches,
    ``trustworthy`` is False, ``shape``/``lo``/``hi`` are None and ``reason`` says why.
    Always: ``batches``, ``batch_records`` (their length), ``lag1_upper``. Deterministic: no
    resampling."""
    from scipy.stats import t as student_t

    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    if num.shape != den.shape or num.ndim != 1:
        raise ValueError(
            "batch_means_ratio_interval: num and den must be 1-D series of the same length"
        )
    if not 0.0 < level < 1.0:
        raise ValueError(f"batch_means_ratio_interval: level {level} not in (0, 1)")
    n = len(num)
    x_bar = float(num.mean()) if n else 0.0
    y_bar = float(den.mean()) if n else 0.0
    out: dict[str, Any] = {
        "estimate": float(num.sum() / den.sum()) if n and den.sum() > 0 else None,
        "lo": None,
        "hi": None,
        "shape": None,
        "level": level,
        "records": n,
        "method": "batch-means Fieller",
    }
    rho_hat = y_bar / x_bar if x_bar > 0 else 0.0
    lin = den - rho_hat * num  # the ratio's linearized series (its influence, up to scale)
    phi = lag1_upper(lin) if n else LAG1_CAP
    need = max(math.ceil(BATCH_FACTOR * phi / (1.0 - phi * phi)), 1)
    batch = max(need, math.ceil(n / MAX_BATCHES), 1)
    m = n // batch
    out.update(lag1_upper=phi, batch_records=batch, batches=m)
    if n < MIN_RECORDS:
        reason = f"{n} records, fewer than {MIN_RECORDS}: too few to measure their own correlation"
        return {**out, "trustworthy": False, "reason": reason}
    if m < MIN_BATCHES:
        reason = (
            f"{n} records hold {m} batch{'es' if m != 1 else ''} of the {batch} consecutive "
            f"records their correlation asks (lag-1 up to {phi:.2f}), fewer than {MIN_BATCHES}"
        )
        return {**out, "trustworthy": False, "reason": reason}
    parts = np.array_split(np.arange(n), m)
    sizes = np.array([len(p) for p in parts], dtype=np.float64)
    xs = np.array([num[p].mean() for p in parts]) - x_bar
    ys = np.array([den[p].mean() for p in parts]) - y_bar
    v_xx, v_yy, v_xy = ((sizes * u * w).sum() / (m - 1) for u, w in ((xs, xs), (ys, ys), (xs, ys)))
    inflation = ar1_inflation(phi, n // m, m)
    at_hat = inflation * (v_yy - 2.0 * rho_hat * v_xy + rho_hat * rho_hat * v_xx)
    long_run = float(((lin - lin.mean()) ** 2).mean()) * (1.0 + phi) / (1.0 - phi)
    floor = max(1.0, long_run / at_hat) if at_hat > 0 else 1.0
    t = float(student_t.ppf(0.5 + level / 2.0, m - 1))
    c = floor * inflation * t * t / n
    qa = x_bar * x_bar - c * v_xx  # q(ρ) = qa ρ² − 2 qb ρ + qc ≤ 0
    qb = x_bar * y_bar - c * v_xy
    qc = y_bar * y_bar - c * v_yy
    out.update(trustworthy=True, inflation=inflation, floor=floor, t=t)
    if qa <= 0:  # mean num not clearly above 0: the set is unbounded in ρ
        return {**out, "shape": "any", "lo": 0.0}
    root = math.sqrt(max(qb * qb - qa * qc, 0.0))
    r_lo, r_hi = (qb - root) / qa, (qb + root) / qa
    if r_hi <= 0:
        return {**out, "shape": "no_finite"}
    if r_lo <= 0:
        return {**out, "shape": "at_least", "lo": 1.0 / r_hi}
    return {**out, "shape": "bounded", "lo": 1.0 / r_hi, "hi": 1.0 / r_lo}
