"""Batch-size advice from a run's gradient noise scale (DESIGN.md 4.6): ``dlrm-vrgd advise``,
the ``noise_scale`` field of ``result.json`` and the service's ``GET /jobs/{id}/advice``.

It reads the ``noise_scale`` records of ``gsnr.jsonl`` (finished or still running), keeps those
of the last part of training (``last`` = the fraction of the steps recorded so far, 0.5 by
default: the noise scale grows as the loss falls, and the late value is the one that bounds
the batch), and for each scope — the whole model as one vector (``model``), the dense layers
(``dense``), the tables (``tables``) — reports the median of the smoothed ``B_simple`` with its
10th and 90th percentiles over those records.

Against it the run's own global batch ``G``, and McCandlish et al.'s (2018, eq. 2.11-2.12)
trade-off for a batch ``B`` at noise scale ``B_noise`` (taken as ``B_simple``): to reach a
given loss, steps ``S/S_min = 1 + B_noise/B`` and rows processed ``E/E_min = 1 + B/B_noise``.
That is the paper's model of SGD (it assumes, among others, the learning rate tuned for each
``B``, a well-conditioned Hessian for ``B_simple ≈ B_noise``), not a promise about this model:
the study (``dlrm-vrgd study``) measures the AUC at each batch.

The 10th-90th percentiles are the drift of a smoothed series, not an interval. The interval
(:func:`uncertainty`) comes from the run's own per-step estimates: ``Σ S_raw / Σ |G|²_raw`` over
the window, with a circular block bootstrap (:mod:`dlrm_vrgd.bootstrap`). The critical batch
(the paper's ``B_crit = E_min / S_min = B_noise``) is the whole model's estimate with that
interval. The advice says when G lies inside the interval (the above/below verdict would flip
within it) and when the run is where the estimator reads low (B_simple ≳ 4 x b x k).

The file is data, not code: a line that is not a well-formed record is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dlrm_vrgd import safejson

SCOPES = ("model", "dense", "tables")
#: Batches of the trade-off table, as multiples of the run's global batch.
MULTIPLES = (0.25, 0.5, 1.0, 2.0, 4.0)
MODEL_NOTE = (
    "McCandlish et al. (2018, arXiv 1812.06162) model SGD's cost to reach a given loss at "
    "batch B as steps S = S_min (1 + B_noise/B) and rows E = E_min (1 + B/B_noise), with "
    "B_noise estimated here by B_simple; it assumes a learning rate tuned for each B and a "
    "well-conditioned curvature. A guide for where to look, not a promise of AUC: measure that "
    "with `dlrm-vrgd study`."
)


def finite(value: Any) -> float | None:
    """``value`` as a float if it is a finite number (not a bool), else None: files are data."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def noise_records(lines: Iterable[bytes | str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(step, noise_scale)`` of each well-formed ``gsnr.jsonl`` line that carries one."""
    for line in lines:
        try:
            record = safejson.loads(line)  # bounded nesting: only ValueError
        except ValueError:
            continue  # a torn last line, not JSON, or nested too deep
        if not isinstance(record, dict):
            continue
        step, noise = record.get("step"), record.get("noise_scale")
        if isinstance(step, int) and not isinstance(step, bool) and isinstance(noise, dict):
            yield step, noise


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of a non-empty sorted list."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (pos - lo) * (sorted_values[hi] - sorted_values[lo])


def tradeoff(global_batch: int, b_noise: float) -> list[dict[str, float]]:
    """The paper's model at ``G/4 … 4G``: steps and rows relative to their minima and to G."""
    at_g = (1 + b_noise / global_batch, 1 + global_batch / b_noise)
    out = []
    for m in MULTIPLES:
        batch = m * global_batch
        steps, rows = 1 + b_noise / batch, 1 + batch / b_noise
        out.append(
            {
                "batch": batch,
                "batch_over_g": m,
                "steps_over_min": steps,
                "rows_over_min": rows,
                "steps_vs_g": steps / at_g[0],
                "rows_vs_g": rows / at_g[1],
            }
        )
    return out


def advise_records(
    records: Iterable[tuple[int, dict[str, Any]]], last: float = 0.5
) -> dict[str, Any]:
    """The advice (see the module doc) from ``(step, noise_scale)`` records."""
    if not 0.0 < last <= 1.0:
        raise ValueError(f"Invalid last fraction: {last} (must be in (0, 1])")
    rows = list(records)
    out: dict[str, Any] = {"last_fraction": last, "note": MODEL_NOTE}
    if not rows:
        return {**out, "reason": "no noise_scale records in gsnr.jsonl yet"}
    final_step, final = max(rows, key=lambda r: r[0])
    g = final.get("global_batch")
    global_batch = int(g) if isinstance(g, int) and not isinstance(g, bool) and g > 0 else None
    out.update(
        global_batch=global_batch,
        k=final.get("k"),
        rows_per_group=final.get("rows_per_group"),
        last_step=final_step,
    )
    if isinstance(final.get("reason"), str) and "dense" not in final:
        return {**out, "reason": final["reason"]}
    start = final_step * (1.0 - last)
    window = [(s, r) for s, r in rows if s > start or s == final_step]
    out["steps"] = [min(s for s, _ in window), final_step]
    scopes: dict[str, Any] = {}
    for scope in SCOPES:
        values = sorted(
            v
            for _, r in window
            if isinstance(r.get(scope), dict)
            and (v := finite(r[scope].get("b_simple"))) is not None
        )
        if not values:
            continue
        median = quantile(values, 0.5)
        entry: dict[str, Any] = {
            "b_simple": median,
            "p10": quantile(values, 0.1),
            "p90": quantile(values, 0.9),
            "records": len(values),
            "records_without_estimate": len(window) - len(values),
        }
        if global_batch is not None and median > 0:
            entry["g_over_b_simple"] = global_batch / median
            entry["tradeoff"] = tradeoff(global_batch, median)
        entry.update(uncertainty(window, scope, global_batch, final))
        scopes[scope] = entry
    out["scopes"] = scopes
    if not scopes:
        out["reason"] = "no record of the last part of training has a B_simple (|G|² <= 0)"
    critical = next((scopes[s] for s in SCOPES if scopes.get(s, {}).get("interval")), None)
    if critical is not None:
        # the paper's critical batch B_crit = E_min / S_min equals B_noise, estimated by the
        # whole model's B_simple: one number for the batch, with the interval of that estimate
        iv = critical["interval"]
        out["critical_batch"] = {
            "scope": next(s for s in SCOPES if scopes.get(s) is critical),
            "estimate": iv["estimate"],
            "ci95": [iv["lo"], iv["hi"]],
            "verdict": critical.get("verdict"),
            "verdict_flips": critical.get("verdict_flips"),
            "unreliable": critical.get("unreliable"),
        }
    return out


#: Fewest records of the window for a bootstrap interval (fewer: none, and the advice says so).
MIN_RECORDS = 8
#: Above this many times ``b x k`` (the rows of one step), B_simple reads low: the per-step
#: signal ``|G|²`` is then below the noise of its estimate (issue 41's outside check: -26% at
#: 16 x b x k, with estimates missing).
UNRELIABLE_RATIO = 4.0


def uncertainty(
    window: list[tuple[int, dict[str, Any]]],
    scope: str,
    global_batch: int | None,
    final: dict[str, Any],
) -> dict[str, Any]:
    """A scope's interval and caveats from the window's own per-step (raw) estimates.

    ``interval``: ``Σ S_raw / Σ |G|²_raw`` over the window's records — the estimator of
    B_simple with flat weights over the window instead of the EMA's — and its 95% circular
    block bootstrap interval (:mod:`dlrm_vrgd.bootstrap`: blocks of consecutive records, the
    length chosen by Politis & White's rule from the series itself, since the true ``|G|²``
    and ``tr Σ`` drift through training and neighbouring records are correlated; an i.i.d.
    bootstrap would understate the spread). ``verdict``: G above or below that estimate;
    ``verdict_flips``: G inside the interval (the data do not say which side). ``unreliable``:
    ``yes`` where the estimate is at least :data:`UNRELIABLE_RATIO` x b x k, ``possible``
    where only the interval's upper end is, else ``no``; ``nonpositive_g2``: the share of the
    window's raw ``|G|²`` estimates at or below 0 (the signal lost in the noise)."""
    from dlrm_vrgd.bootstrap import ratio_interval

    pairs = [
        (s, g2)
        for _, r in window
        if isinstance(r.get(scope), dict)
        and (s := finite(r[scope].get("s_raw"))) is not None
        and (g2 := finite(r[scope].get("g2_raw"))) is not None
    ]
    out: dict[str, Any] = {"raw_records": len(pairs)}
    if not pairs:
        return out
    out["nonpositive_g2"] = sum(g2 <= 0 for _, g2 in pairs) / len(pairs)
    if len(pairs) < MIN_RECORDS:
        out["interval_reason"] = (
            f"{len(pairs)} records with raw estimates, fewer than {MIN_RECORDS}"
        )
        return out
    num, den = zip(*pairs, strict=True)
    iv = ratio_interval(np.asarray(num), np.asarray(den))
    out["interval"] = {
        "estimate": iv["estimate"],
        "lo": iv["lo"],
        "hi": iv["hi"],
        "level": iv["level"],
        "block": iv["block"],
        "records": iv["records"],
        "method": "circular block bootstrap of the raw per-step estimates (Politis-White block)",
    }
    est, lo, hi = iv["estimate"], iv["lo"], iv["hi"]
    k, b = final.get("k"), final.get("rows_per_group")
    if isinstance(k, int) and isinstance(b, int) and k > 0 and b > 0:
        bk = k * b
        out["b_times_k"] = bk
        if est is None or est >= UNRELIABLE_RATIO * bk:
            out["unreliable"] = "yes"
        elif hi is None or hi >= UNRELIABLE_RATIO * bk:
            out["unreliable"] = "possible"
        else:
            out["unreliable"] = "no"
    if global_batch is not None and est is not None:
        out["verdict"] = "above" if global_batch > est else "below"
        # a bound is None where it is unbounded (more than 2.5% of the resamples found no
        # signal: B_simple infinite)
        lo_v = math.inf if lo is None else lo
        hi_v = math.inf if hi is None else hi
        out["verdict_flips"] = lo_v <= global_batch <= hi_v
    return out


def advise(run_dir: str | Path, last: float = 0.5) -> dict[str, Any]:
    """The advice of the run directory ``run_dir`` (its ``gsnr.jsonl``, read line by line)."""
    path = Path(run_dir) / "gsnr.jsonl"
    if not path.is_file():
        return advise_records([], last)
    with path.open("rb") as f:
        return advise_records(noise_records(f), last)


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _bound(x: float | None) -> str:
    return "unbounded" if x is None else _fmt(x)


def _uncertainty_lines(e: dict[str, Any], g: int | None) -> list[str]:
    """A scope's interval and its caveats, for people."""
    iv = e.get("interval")
    if iv is None:
        why = e.get("interval_reason")
        return [f"no interval: {why}"] if why else []
    side = f"; G is {e['verdict']} it" if e.get("verdict") and not e.get("verdict_flips") else ""
    out = [
        f"window estimate {_bound(iv['estimate'])}, 95% interval [{_bound(iv['lo'])}, "
        f"{_bound(iv['hi'])}] (circular block bootstrap of {iv['records']} per-step "
        f"estimates, blocks of {iv['block']}){side}"
    ]
    ratio = e.get("g_over_b_simple")
    if ratio is not None and e.get("verdict") and (ratio > 1) != (e["verdict"] == "above"):
        out.append(
            "CAVEAT: the smoothed series' median puts G on the other side than the window "
            "estimate: the smoothed B_simple was still moving (read the interval)"
        )
    if e.get("verdict_flips"):
        out.append(
            f"CAVEAT: G = {g} lies inside the interval: whether G is above or below B_simple "
            "(the verdict) flips within it; the data do not say which side"
        )
    bk = e.get("b_times_k")
    share = e.get("nonpositive_g2", 0.0)
    if e.get("unreliable") == "yes":
        out.append(
            f"WARNING: unreliable regime: B_simple >= {UNRELIABLE_RATIO:g} x b x k = "
            f"{_fmt(UNRELIABLE_RATIO * bk)} rows; {share:.0%} of the per-step |G|² estimates are "
            "<= 0 (the signal is below their noise) and the estimate reads low here: the true "
            "B_simple is likely higher. Measure with more groups per step (a larger k x b)"
        )
    elif e.get("unreliable") == "possible":
        out.append(
            f"caution: the interval reaches {UNRELIABLE_RATIO:g} x b x k = "
            f"{_fmt(UNRELIABLE_RATIO * bk)} rows, where the estimator reads low"
        )
    return out


def render(advice: dict[str, Any]) -> str:
    """The advice as text for people (the CLI prints it)."""
    lines = []
    if "reason" in advice and not advice.get("scopes"):
        return f"no noise-scale estimate: {advice['reason']}"
    g = advice.get("global_batch")
    lo, hi = advice["steps"]
    lines.append(
        f"gradient noise scale B_simple over steps {lo}-{hi} (the last "
        f"{advice['last_fraction']:.0%} of the steps recorded), k = {advice.get('k')} groups of "
        f"{advice.get('rows_per_group')} rows; this run's global batch G = {g}"
    )
    for scope, e in advice["scopes"].items():
        where = ""
        if "g_over_b_simple" in e:
            ratio = e["g_over_b_simple"]
            side = "below" if ratio < 1 else "above"
            where = f"; G is {ratio:.2g} x B_simple ({side} it)"
        lines.append(
            f"  {scope:<7} B_simple {_fmt(e['b_simple'])} (p10 {_fmt(e['p10'])}, p90 "
            f"{_fmt(e['p90'])} of the smoothed series: its drift, not an interval; "
            f"{e['records']} records){where}"
        )
        lines += [f"          {line}" for line in _uncertainty_lines(e, g)]
    crit = advice.get("critical_batch")
    if crit is not None and crit["estimate"] is not None:
        lo_c, hi_c = crit["ci95"]
        lines.append(
            f"critical batch (the paper's B_crit = B_noise, taken as the {crit['scope']}'s "
            f"B_simple): {_fmt(crit['estimate'])}, 95% interval [{_bound(lo_c)}, {_bound(hi_c)}]"
            + (
                "; G's side of it is not settled"
                if crit.get("verdict_flips")
                else f"; G is {crit['verdict']} it"
                if crit.get("verdict")
                else ""
            )
        )
    head = next((s for s in SCOPES if "tradeoff" in advice["scopes"].get(s, {})), None)
    if head is not None:
        lines.append(f"the paper's model at B_noise = B_simple ({head}):")
        lines.append("  batch         steps/S_min  rows/E_min  steps vs G  rows vs G")
        for t in advice["scopes"][head]["tradeoff"]:
            label = f"{_fmt(t['batch'])} ({t['batch_over_g']:g} G)"
            lines.append(
                f"  {label:<13} {t['steps_over_min']:>11.2f} {t['rows_over_min']:>11.2f}"
                f" {t['steps_vs_g']:>11.2f} {t['rows_vs_g']:>10.2f}"
            )
    lines.append(advice["note"])
    return "\n".join(lines)
