"""Batch-size advice from a run's gradient noise scale (DESIGN.md 4.6): ``dlrm-vrgd advise``,
the ``noise_scale`` field of ``result.json`` and the service's ``GET /jobs/{id}/advice`` (whose
``text`` is what the CLI prints, and what the dashboard shows).

It reads the ``noise_scale`` records of ``gsnr.jsonl`` (finished or still running), keeps those
of the last part of training (``last`` = the fraction of the steps recorded so far, 0.5 by
default: the noise scale grows as the loss falls, and the late value is the one that bounds
the batch), and for each scope — the whole model as one vector (``model``), the dense layers
(``dense``), the tables (``tables``) — reports one number (issue 48): ``b_simple``, the
window's ratio of means ``Σ S_raw / Σ |G|²_raw`` of the per-step estimates (B_simple's own
estimator, with flat weights over the window instead of the EMA's), with its 95% interval
(:func:`dlrm_vrgd.bootstrap.batch_means_ratio_interval`: batch-means Fieller with t
quantiles; none where the window holds too few independent batches to trust one). The
verdict (G above or below B_simple), the critical batch and the trade-off table all come from
that estimate; the smoothed (EMA) series' median and 10th/90th percentiles are kept beside it
(``smoothed``) as its drift, not as an interval.

Against it the run's own global batch ``G``, and McCandlish et al.'s (2018, eq. 2.11-2.12)
trade-off for a batch ``B`` at noise scale ``B_noise`` (taken as ``B_simple``): to reach a
given loss, steps ``S/S_min = 1 + B_noise/B`` and rows processed ``E/E_min = 1 + B/B_noise``.
That is the paper's model of SGD (it assumes, among others, the learning rate tuned for each
``B``, a well-conditioned Hessian for ``B_simple ≈ B_noise``), not a promise about this model:
the study (``dlrm-vrgd study``) measures the AUC at each batch. Where the window estimate is
undefined (``Σ |G|²_raw ≤ 0``) or outside its interval, no trade-off is given and the advice
says why. The caveats are judged on the interval: the verdict flips where G lies inside it;
the unreliable regime (B_simple ≳ 4 x b x k, where the estimator reads low) is warned of where
the interval reaches it.

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
    """The advice (see the module doc) from ``(step, noise_scale)`` records, with ``text``:
    :func:`render` of it (what ``dlrm-vrgd advise`` prints and the dashboard shows)."""
    out = _advice(records, last)
    out["text"] = render(out)
    return out


def _advice(records: Iterable[tuple[int, dict[str, Any]]], last: float) -> dict[str, Any]:
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
    k, b = final.get("k"), final.get("rows_per_group")
    bk = k * b if isinstance(k, int) and isinstance(b, int) and k > 0 and b > 0 else None
    scopes: dict[str, Any] = {}
    for scope in SCOPES:
        entry = _smoothed(window, scope)
        pairs = [
            (s, g2)
            for _, r in window
            if isinstance(r.get(scope), dict)
            and (s := finite(r[scope].get("s_raw"))) is not None
            and (g2 := finite(r[scope].get("g2_raw"))) is not None
        ]
        if pairs:
            num, den = (np.asarray(x) for x in zip(*pairs, strict=True))
            entry.update(judge(num, den, global_batch, bk))
        elif entry:
            entry.update(
                b_simple=None,
                raw_records=0,
                estimate_reason="no per-step estimates (s_raw, g2_raw) in the window",
            )
        if entry:
            scopes[scope] = entry
    out["scopes"] = scopes
    if not scopes:
        out["reason"] = "no record of the last part of training has a B_simple (|G|² <= 0)"
        return out
    # the paper's critical batch B_crit = E_min / S_min equals B_noise, estimated by the whole
    # model's B_simple: one number for the batch, with the interval of that estimate
    head = next(s for s in SCOPES if s in scopes)
    e = scopes[head]
    iv = e.get("interval")
    out["critical_batch"] = {
        "scope": head,
        "estimate": e.get("b_simple"),
        "ci95": [iv["lo"], iv["hi"]] if iv else None,
        "shape": iv["shape"] if iv else None,
        "verdict": e.get("verdict"),
        "verdict_flips": e.get("verdict_flips"),
        "unreliable": e.get("unreliable"),
    }
    return out


def _smoothed(window: list[tuple[int, dict[str, Any]]], scope: str) -> dict[str, Any]:
    """The smoothed (EMA) B_simple's median and 10th/90th percentiles over the window: its
    drift, not an interval; {} where no record has one."""
    values = sorted(
        v
        for _, r in window
        if isinstance(r.get(scope), dict) and (v := finite(r[scope].get("b_simple"))) is not None
    )
    if not values:
        return {}
    return {
        "smoothed": {
            "median": quantile(values, 0.5),
            "p10": quantile(values, 0.1),
            "p90": quantile(values, 0.9),
            "records": len(values),
            "records_without_estimate": len(window) - len(values),
        }
    }


#: Above this many times ``b x k`` (the rows of one step), B_simple reads low: the per-step
#: signal ``|G|²`` is then below the noise of its estimate (issue 41's outside check: -26% at
#: 16 x b x k, with estimates missing).
UNRELIABLE_RATIO = 4.0


def judge(
    num: np.ndarray, den: np.ndarray, global_batch: int | None, bk: int | None
) -> dict[str, Any]:
    """A scope's one number and what follows from it, from the window's per-step ``S_raw``
    (``num``) and ``|G|²_raw`` (``den``), ``n`` each.

    ``b_simple``: ``Σ S_raw / Σ |G|²_raw`` (None where ``Σ |G|²_raw ≤ 0``: ``estimate_reason``
    says so). ``interval``: its 95% batch-means Fieller interval
    (:func:`~dlrm_vrgd.bootstrap.batch_means_ratio_interval`; ``shape`` ``bounded``,
    ``at_least`` — ``hi`` None —, ``no_finite`` — no finite B_simple: no gradient signal
    detected —, or ``any``), with the ``batches`` and ``batch_records`` it used; absent where
    the window cannot carry a trustworthy one (``interval_reason``). ``verdict``: G above or
    below ``b_simple``; ``verdict_flips``: G inside the interval (None without one: not
    settled). ``unreliable``: ``yes`` where the interval reaches :data:`UNRELIABLE_RATIO` x b x
    k (without an interval: where the estimate does, or is undefined), ``unknown`` without an
    interval below it, else ``no``. ``tradeoff`` (with ``g_over_b_simple``) where the estimate
    is defined and inside its interval; else ``tradeoff_reason``. ``nonpositive_g2``: the share
    of the per-step ``|G|²`` at or below 0 (the signal lost in the noise)."""
    from dlrm_vrgd.bootstrap import batch_means_ratio_interval

    iv = batch_means_ratio_interval(num, den)
    est = iv["estimate"]
    out: dict[str, Any] = {
        "b_simple": est,
        "raw_records": len(num),
        "nonpositive_g2": float(np.mean(den <= 0)),
    }
    if est is None:
        out["estimate_reason"] = (
            f"Σ |G|² <= 0 over the window's {len(num)} per-step estimates "
            f"({out['nonpositive_g2']:.0%} of them <= 0): the signal is below their noise"
        )
    if iv["trustworthy"]:
        out["interval"] = {
            k: iv[k] for k in ("lo", "hi", "shape", "level", "records", "batches", "batch_records")
        }
        out["interval"]["lag1_upper"] = iv["lag1_upper"]
        out["interval"]["method"] = (
            "batch-means Fieller, t quantiles on batches - 1 d.f. (dlrm_vrgd/bootstrap.py)"
        )
    else:
        out["interval_reason"] = f"not trustworthy here: {iv['reason']}"
    lo, hi = _bounds(iv) if iv["trustworthy"] else (math.nan, math.nan)
    if bk is not None:
        out["b_times_k"] = bk
        regime = UNRELIABLE_RATIO * bk
        if iv["trustworthy"]:
            out["unreliable"] = "yes" if hi >= regime else "no"
        elif est is None or est >= regime:
            out["unreliable"] = "yes"
        else:
            out["unreliable"] = "unknown"
    if global_batch is not None and est is not None:
        out["verdict"] = "above" if global_batch > est else "below"
        out["verdict_flips"] = bool(lo <= global_batch <= hi) if iv["trustworthy"] else None
    if est is None:
        out["tradeoff_reason"] = "the window estimate is undefined"
    elif iv["trustworthy"] and not lo <= est <= hi:
        out["tradeoff_reason"] = "the window estimate lies outside its own interval"
    elif global_batch is not None:
        out["g_over_b_simple"] = global_batch / est
        out["tradeoff"] = tradeoff(global_batch, est)
    return out


def _bounds(iv: dict[str, Any]) -> tuple[float, float]:
    """A trustworthy interval's ends as numbers (+∞ where unbounded; both +∞: no finite one)."""
    if iv["shape"] == "no_finite":
        return math.inf, math.inf
    return iv["lo"], math.inf if iv["hi"] is None else iv["hi"]


def advise(run_dir: str | Path, last: float = 0.5) -> dict[str, Any]:
    """The advice of the run directory ``run_dir`` (its ``gsnr.jsonl``, read line by line)."""
    path = Path(run_dir) / "gsnr.jsonl"
    if not path.is_file():
        return advise_records([], last)
    with path.open("rb") as f:
        return advise_records(noise_records(f), last)


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


NO_SIGNAL = "no finite B_simple: no gradient signal detected in this window"


def interval_words(iv: dict[str, Any]) -> str:
    """A trustworthy interval for people: ``[lo, hi]``, ``[lo, no finite upper bound]`` or
    :data:`NO_SIGNAL`."""
    if iv["shape"] == "no_finite":
        return NO_SIGNAL
    hi = "no finite upper bound" if iv["hi"] is None else _fmt(iv["hi"])
    return f"95% interval [{_fmt(iv['lo'])}, {hi}]"


def _scope_lines(scope: str, e: dict[str, Any], g: int | None) -> list[str]:
    """A scope's one number, its interval and its caveats, for people."""
    iv = e.get("interval")
    head = f"  {scope:<7} "
    if e.get("b_simple") is None:
        why = e.get("estimate_reason", "")
        first = f"{head}B_simple undefined: {why}"
        if iv is not None and iv["shape"] == "no_finite":
            first = f"{head}{NO_SIGNAL} ({why})"
        elif iv is not None:
            first += f"; {interval_words(iv)}"
    else:
        first = (
            f"{head}B_simple {_fmt(e['b_simple'])} (Σ S / Σ |G|² of {e['raw_records']} "
            "per-step estimates)"
        )
        if iv is not None:
            first += f", {interval_words(iv)}"
        if e.get("verdict"):
            side = f"G is {e['verdict']} it ({g / e['b_simple']:.3g} x B_simple)"
            if e.get("verdict_flips") is None:
                side += ", but with no trustworthy interval the side is not settled"
            elif e["verdict_flips"]:
                side = f"G = {g} is inside the interval"
            first += f"; {side}"
    out = [first]
    more = []
    if iv is not None:
        more.append(
            f"interval from {iv['batches']} batches of {iv['batch_records']} consecutive "
            f"records (batch-means Fieller, t on {iv['batches'] - 1} d.f.)"
        )
    elif e.get("interval_reason"):
        more.append(f"no interval: {e['interval_reason']}")
    sm = e.get("smoothed")
    if sm:
        more.append(
            f"smoothed (EMA) series: median {_fmt(sm['median'])}, p10 {_fmt(sm['p10'])}, "
            f"p90 {_fmt(sm['p90'])} of {sm['records']} records: its drift, not an interval"
        )
    if e.get("verdict_flips"):
        more.append(
            f"CAVEAT: G = {g} lies inside the interval: whether G is above or below B_simple "
            "(the verdict) flips within it; the data do not say which side"
        )
    bk = e.get("b_times_k")
    if bk is not None:
        regime = _fmt(UNRELIABLE_RATIO * bk)
        share = e.get("nonpositive_g2", 0.0)
        if e.get("unreliable") == "yes":
            reach = "the interval reaches" if iv is not None else "the estimate is at"
            more.append(
                f"WARNING: unreliable regime: {reach} B_simple >= {UNRELIABLE_RATIO:g} x b x k "
                f"= {regime} rows; {share:.0%} of the per-step |G|² estimates are <= 0 (the "
                "signal is below their noise) and the estimate reads low there: the true "
                "B_simple may be higher. Measure with more groups per step (a larger k x b)"
            )
        elif e.get("unreliable") == "unknown":
            more.append(
                f"caution: with no trustworthy interval, the unreliable regime (B_simple >= "
                f"{UNRELIABLE_RATIO:g} x b x k = {regime} rows) is not ruled out"
            )
    return out + [f"          {line}" for line in more]


def render(advice: dict[str, Any]) -> str:
    """The advice as text for people (the CLI prints it; the dashboard shows it)."""
    if "reason" in advice and not advice.get("scopes"):
        return f"no noise-scale estimate: {advice['reason']}"
    g = advice.get("global_batch")
    lo, hi = advice["steps"]
    lines = [
        f"gradient noise scale B_simple over steps {lo}-{hi} (the last "
        f"{advice['last_fraction']:.0%} of the steps recorded), k = {advice.get('k')} groups of "
        f"{advice.get('rows_per_group')} rows; this run's global batch G = {g}"
    ]
    for scope, e in advice["scopes"].items():
        lines += _scope_lines(scope, e, g)
    crit = advice.get("critical_batch")
    if crit is not None:
        e = advice["scopes"][crit["scope"]]
        what = (
            f"critical batch (the paper's B_crit = B_noise, taken as the {crit['scope']}'s "
            "B_simple): "
        )
        iv = e.get("interval")
        if crit["estimate"] is None:
            what += "undefined" if iv is None else interval_words(iv)
        else:
            what += _fmt(crit["estimate"])
            what += f", {interval_words(iv)}" if iv else ", no trustworthy interval"
            if crit.get("verdict_flips"):
                what += "; G's side of it is not settled"
            elif crit.get("verdict") and crit.get("verdict_flips") is False:
                what += f"; G is {crit['verdict']} it"
            elif crit.get("verdict"):
                what += f"; G is {crit['verdict']} it, not settled (no trustworthy interval)"
        lines.append(what)
        if "tradeoff" in e:
            lines.append(
                f"the paper's model at B_noise = B_simple = {_fmt(e['b_simple'])} "
                f"({crit['scope']}):"
            )
            lines.append("  batch         steps/S_min  rows/E_min  steps vs G  rows vs G")
            for t in e["tradeoff"]:
                label = f"{_fmt(t['batch'])} ({t['batch_over_g']:g} G)"
                lines.append(
                    f"  {label:<13} {t['steps_over_min']:>11.2f} {t['rows_over_min']:>11.2f}"
                    f" {t['steps_vs_g']:>11.2f} {t['rows_vs_g']:>10.2f}"
                )
        elif e.get("tradeoff_reason"):
            lines.append(f"no trade-off: {e['tradeoff_reason']} ({crit['scope']})")
    lines.append(advice["note"])
    return "\n".join(lines)
