"""The circular block bootstrap of a time series (Politis & Romano 1992), with its block length
chosen from the series itself (Politis & White 2004, corrected by Patton, Politis & White 2009).

A run's per-step estimates (``gsnr.jsonl``'s raw ``|G|²`` and ``S``) come from independent
micro-batches, but what they estimate drifts as the loss falls and the learning rate decays, so
neighbouring steps are correlated and an i.i.d. bootstrap would understate the spread. The
circular block bootstrap resamples whole blocks of consecutive steps (wrapping around the end,
so every step is equally likely to be drawn and the resampled sum is unbiased for the sum),
which keeps the correlation within a block. The block length trades bias against variance:
:func:`block_length` estimates the optimal one for the circular bootstrap of a mean, ``b* =
(2 G² / D)^(1/3) n^(1/3)`` with ``G = Σ_k |k| γ(k)`` and ``D = (4/3) (Σ_k γ(k))²``, from the
flat-top lag-window estimates of the autocovariances γ, the window's width chosen by the first
run of ``K_n`` insignificant autocorrelations.

Pure numpy; the resampled sums are formed from precomputed block sums, so memory is
``resamples x blocks``, not ``resamples x n``.
"""

from __future__ import annotations

import math

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
