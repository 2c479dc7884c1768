"""`dlrm-vrgd advise` with honest uncertainty (issue 41): an interval for B_simple and the
critical batch from the run's own per-step estimates, a caveat where G lies inside it (the
verdict would flip), and a warning where the run sits in the estimator's unreliable regime."""

from __future__ import annotations

import numpy as np
import pytest

from dlrm_vrgd.advice import UNRELIABLE_RATIO, advise_records, render
from dlrm_vrgd.bootstrap import ratio_interval


def _records(s_raw: np.ndarray, g2_raw: np.ndarray, k: int = 4, b: int = 256) -> list:
    """One record per step: the raw per-step estimates, and a smoothed B_simple (their running
    ratio of sums, standing in for the EMA's) so that the scope has its median."""
    out = []
    for i, (s, g2) in enumerate(zip(s_raw, g2_raw, strict=True), start=1):
        smooth = s_raw[:i].sum() / g2_raw[:i].sum() if g2_raw[:i].sum() > 0 else None
        scope = {"b_simple": smooth, "s_raw": float(s), "g2_raw": float(g2)}
        out.append((i, {"k": k, "rows_per_group": b, "global_batch": k * b, "model": scope}))
    return out


def test_the_interval_is_the_block_bootstrap_of_the_window_s_raw_estimates() -> None:
    rng = np.random.default_rng(0)
    s_raw = 2000.0 + rng.normal(0, 400, 200)
    g2_raw = 1.0 + rng.normal(0, 0.5, 200)
    advice = advise_records(_records(s_raw, g2_raw), last=0.5)
    model = advice["scopes"]["model"]
    iv = model["interval"]
    # the window is the last half (steps 101..200): the same statistic computed here
    ref = ratio_interval(s_raw[100:], g2_raw[100:])
    assert iv["estimate"] == pytest.approx(s_raw[100:].sum() / g2_raw[100:].sum())
    assert (iv["lo"], iv["hi"], iv["block"]) == (ref["lo"], ref["hi"], ref["block"])
    assert iv["lo"] < iv["estimate"] < iv["hi"] and iv["records"] == 100
    assert advice["critical_batch"]["estimate"] == iv["estimate"]
    assert advice["critical_batch"]["ci95"] == [iv["lo"], iv["hi"]]
    assert advise_records(_records(s_raw, g2_raw))["scopes"] == advice["scopes"]  # seeded


def test_a_verdict_that_flips_inside_the_interval_is_said() -> None:
    """G = 1,024 rows; B_simple ≈ 1,000 with a wide interval: G is inside it."""
    rng = np.random.default_rng(1)
    s_raw = 1000.0 + rng.normal(0, 300, 40)
    g2_raw = 1.0 + rng.normal(0, 0.6, 40)
    advice = advise_records(_records(s_raw, g2_raw), last=1.0)
    model = advice["scopes"]["model"]
    assert model["interval"]["lo"] < 1024 < model["interval"]["hi"]
    assert model["verdict_flips"] is True and advice["critical_batch"]["verdict_flips"] is True
    text = render(advice)
    assert "CAVEAT: G = 1024 lies inside the interval" in text
    assert "G's side of it is not settled" in text
    # far from G, the verdict stands and nothing is said
    far = advise_records(_records(s_raw * 20, g2_raw), last=1.0)
    assert far["scopes"]["model"]["verdict"] == "below"
    assert far["scopes"]["model"]["verdict_flips"] is False
    assert "CAVEAT" not in render(far)


def test_the_unreliable_regime_is_read_from_the_run_s_raw_estimates() -> None:
    """b x k = 1,024. A signal below its noise: B_simple ≈ 8,000 ≥ 4 x b x k, many per-step
    |G|² estimates <= 0 — the warning, with that share."""
    rng = np.random.default_rng(2)
    s_raw = 8000.0 + rng.normal(0, 800, 120)
    g2_raw = 1.0 + rng.normal(0, 1.5, 120)
    advice = advise_records(_records(s_raw, g2_raw), last=1.0)
    model = advice["scopes"]["model"]
    share = float(np.mean(g2_raw <= 0))
    assert model["b_times_k"] == 1024 and model["unreliable"] == "yes"
    assert model["nonpositive_g2"] == pytest.approx(share) and share > 0.2
    text = render(advice)
    assert f"WARNING: unreliable regime: B_simple >= {UNRELIABLE_RATIO:g} x b x k = 4,096" in text
    assert f"{share:.0%} of the per-step |G|² estimates are <= 0" in text
    # a clear signal at B_simple ≈ 500 < 4 x 1,024: no warning
    clear = advise_records(_records(500.0 + rng.normal(0, 50, 120), 1.0 + 0 * g2_raw), last=1.0)
    assert clear["scopes"]["model"]["unreliable"] == "no"
    assert "unreliable" not in render(clear)


def test_too_few_records_give_no_interval_and_say_why() -> None:
    advice = advise_records(_records(np.full(5, 100.0), np.full(5, 1.0)), last=1.0)
    model = advice["scopes"]["model"]
    assert "interval" not in model and "fewer than 8" in model["interval_reason"]
    assert "critical_batch" not in advice
    assert "no interval: 5 records with raw estimates, fewer than 8" in render(advice)
