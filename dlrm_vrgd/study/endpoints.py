"""The study's comparisons, all **paired by seed** (the arms share seeds: initial weights and
data order) and read from the summary rows of one protocol: optimizer − base at each batch,
the interaction ``(opt − base at the largest batch) − (the same at the smallest)``, each arm's
own batch effect, and the *primary* family — the interactions fixed before the study (or, where
none were, every tuned interaction) — with Holm's adjustment over it."""

from __future__ import annotations

from typing import Any

from dlrm_vrgd.study.config import StudyConfig
from dlrm_vrgd.study.stats import ALPHA, fisher_exact, holm, paired


def _stat(diffs: list[float]) -> dict[str, Any]:
    """:func:`paired` rounded for the JSON report (6 digits; p to 4 significant)."""
    st = paired(diffs)
    return {
        "n": st["n"],
        "mean": None if st["mean"] is None else round(st["mean"], 6),
        "sd": None if st["sd"] is None else round(st["sd"], 6),
        "ci95": None if st["lo"] is None else [round(st["lo"], 6), round(st["hi"], 6)],
        "p": None if st["p"] is None else float(f"{st['p']:.4g}"),
    }


def _by_seed(row: dict[str, Any]) -> dict[str, float]:
    return row["test_auc_by_seed"]


def _base_row(
    summary: list[dict[str, Any]], s: dict[str, Any], g: int | None = None
) -> dict[str, Any] | None:
    """The base's row for ``s`` at batch ``g`` (``s``'s own by default): at the same k where
    the base has one, else at its own."""
    g = s["global_batch"] if g is None else g
    rows = [b for b in summary if b["global_batch"] == g and b["optimizer"] == s["baseline"]]
    same_k = [b for b in rows if b.get("groups") == s.get("groups")]
    return (same_k or rows or [None])[0]


def _diffs(a: dict[str, float], b: dict[str, float]) -> list[float]:
    return [a[seed] - b[seed] for seed in sorted(a, key=int) if seed in b]


def compare_pairs(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Optimizer − base test AUC at each batch size (and k), **paired by seed** (the arms
    share seeds: initial weights and data order): mean, sd, n, 95% t-interval (df = n − 1),
    p-value; and the arms' collapse counts with Fisher's exact test between them."""
    rows = []
    for s in summary:
        if not s["baseline"]:
            continue
        base = _base_row(summary, s)
        if base is None:
            continue
        diffs = _diffs(_by_seed(s), _by_seed(base))
        fisher = fisher_exact(s["collapsed"], s["seeds"], base["collapsed"], base["seeds"])
        rows.append(
            {
                "protocol": s.get("protocol", "tuned"),
                "global_batch": s["global_batch"],
                "optimizer": s["optimizer"],
                "groups": s.get("groups"),
                "baseline": base["optimizer"],
                "baseline_groups": base.get("groups"),
                "delta_test_auc": _stat(diffs),
                "edge": [x for x in (s["edge"], base["edge"]) if x],
                "collapsed": [s["collapsed"], s["seeds"]],
                "baseline_collapsed": [base["collapsed"], base["seeds"]],
                "collapse_fisher_p": float(f"{fisher:.4g}"),
            }
        )
    return rows


def _same_arm(summary: list[dict[str, Any]], s: dict[str, Any], g: int) -> dict[str, Any] | None:
    """``s``'s arm (optimizer and k) at batch ``g``."""
    return next(
        (
            r
            for r in summary
            if r["global_batch"] == g
            and r["optimizer"] == s["optimizer"]
            and r.get("groups") == s.get("groups")
        ),
        None,
    )


def _interaction(
    summary: list[dict[str, Any]], s: dict[str, Any], baseline: str, small: int, large: int
) -> dict[str, Any] | None:
    """The interaction of the arm whose largest-batch row is ``s`` with ``baseline`` (at the
    same k where the base has one), over the seeds present in all four cells; None where a
    cell is missing."""
    lo = _same_arm(summary, s, small)
    probe = {**s, "baseline": baseline}
    base_hi, base_lo = _base_row(summary, probe), _base_row(summary, probe, small)
    if lo is None or base_hi is None or base_lo is None:
        return None
    seeds = set(_by_seed(s)) & set(_by_seed(lo)) & set(_by_seed(base_hi))
    seeds &= set(_by_seed(base_lo))
    diffs = [
        (_by_seed(s)[x] - _by_seed(base_hi)[x]) - (_by_seed(lo)[x] - _by_seed(base_lo)[x])
        for x in sorted(seeds, key=int)
    ]
    return {
        "protocol": s.get("protocol", "tuned"),
        "optimizer": s["optimizer"],
        "groups": s.get("groups"),
        "baseline": baseline,
        "small": small,
        "large": large,
        "interaction": _stat(diffs),
        "edge": [x for x in (s["edge"], lo["edge"], base_hi["edge"], base_lo["edge"]) if x],
        _EXACT_P: paired(diffs)["p"],
    }


#: Key of an interaction's unrounded p-value (Holm adjusts it; it never reaches a report).
_EXACT_P = "_p"


def _extremes(summary: list[dict[str, Any]]) -> tuple[int, int]:
    return (
        min(s["global_batch"] for s in summary),
        max(s["global_batch"] for s in summary),
    )


def interactions(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per optimizer with a base: ``(opt − base at the largest batch) − (opt − base at the
    smallest)``, paired by seed (seeds present in all four cells): whether the optimizer holds
    AUC as the batch grows better than its base (> 0: it does)."""
    if not summary:
        return []
    small, large = _extremes(summary)
    out = []
    for s in summary:
        if not s["baseline"] or s["global_batch"] != large or small == large:
            continue
        row = _interaction(summary, s, s["baseline"], small, large)
        if row is not None:
            row.pop(_EXACT_P)
            out.append(row)
    return out


def batch_effects(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each arm's own batch effect, test AUC at the largest batch − at the smallest, paired by
    seed."""
    if not summary:
        return []
    small, large = _extremes(summary)
    out = []
    for s in summary:
        if s["global_batch"] != large or small == large:
            continue
        lo = _same_arm(summary, s, small)
        if lo is None:
            continue
        out.append(
            {
                "protocol": s.get("protocol", "tuned"),
                "optimizer": s["optimizer"],
                "groups": s.get("groups"),
                "small": small,
                "large": large,
                "batch_effect": _stat(_diffs(_by_seed(s), _by_seed(lo))),
                "edge": [x for x in (s["edge"], lo["edge"]) if x],
            }
        )
    return out


def primary(study: StudyConfig, summary: list[dict[str, Any]]) -> dict[str, Any]:
    """The primary endpoints of ``summary`` (the tuned protocol's rows) with raw and
    Holm-adjusted p-values: the study's ``primary_endpoints`` where they were fixed before it
    ran (``registered``), else every tuned interaction of an arm with its base. Each endpoint
    says whether it ``survives`` Holm at :data:`~dlrm_vrgd.study.stats.ALPHA` (None while its
    cells are missing: it still counts in the family's ``m``, as a test never rejected)."""
    rows: list[dict[str, Any]] = []
    small, large = _extremes(summary) if summary else (0, 0)
    if study.primary_endpoints is None:
        for s in summary:
            if s["baseline"] and s["global_batch"] == large and small != large:
                row = _interaction(summary, s, s["baseline"], small, large)
                if row is not None:
                    rows.append(row)
    for e in study.primary_endpoints or []:
        base = e.baseline or study.optimizer(e.optimizer).baseline or ""
        arm = [
            s
            for s in summary
            if s["optimizer"] == e.optimizer
            and (e.groups is None or s.get("groups") == e.groups)
            and s["global_batch"] == large
        ]
        found = _interaction(summary, arm[0], base, small, large) if arm and small < large else None
        rows.append(
            found
            or {
                "protocol": "tuned",
                "optimizer": e.optimizer,
                "groups": e.groups,
                "baseline": base,
                "small": min(study.batch_sizes),
                "large": max(study.batch_sizes),
                "interaction": _stat([]),
                "edge": [],
                _EXACT_P: None,
            }
        )
    adjusted = holm([r[_EXACT_P] for r in rows])
    endpoints = []
    for r, p_holm in zip(rows, adjusted, strict=True):
        r.pop(_EXACT_P)
        endpoints.append(
            {
                **r,
                "p": r["interaction"]["p"],
                "p_holm": None if p_holm is None else float(f"{p_holm:.4g}"),
                "survives": None if p_holm is None else p_holm <= ALPHA,
            }
        )
    return {
        "registered": study.primary_endpoints is not None,
        "correction": "holm",
        "alpha": ALPHA,
        "m": len(endpoints),
        "endpoints": endpoints,
    }
