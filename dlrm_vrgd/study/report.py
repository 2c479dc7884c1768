"""A study's figures: per cell; per (batch size, optimizer, k) under two protocols — *tuned* (the
LR multiplier chosen on validation) and *rule* (the study's fixed ``rule_multiplier``: the
scaling rule's LR, validation never consulted) — and per VR-vs-base pair under each; written as
JSON, CSV, Markdown tables and PNG plots. Both protocols read the same cells."""

from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path
from typing import Any

from dlrm_vrgd.rundir import atomic_write_bytes, atomic_write_json
from dlrm_vrgd.study.config import StudyConfig, StudyOptimizer
from dlrm_vrgd.study.ledger import Ledger
from dlrm_vrgd.study.protocol import Plan, finished_val_aucs
from dlrm_vrgd.study.protocol import plan as plan_cells
from dlrm_vrgd.study.stats import clopper_pearson, fisher_exact, paired

#: Digits of each summary figure in results.md (results.json holds the same, rounded alike).
DIGITS = {
    "test_auc": 4,
    "test_auc_sd": 4,
    "oracle_gap": 4,
    "train_test_gap": 4,
    "val_auc": 4,
    "gsnr_dense": 3,
    "gsnr_tables": 3,
    "gsnr_dense_clipped": 3,
    "gsnr_tables_clipped": 3,
    "cowclip_clipped": 3,
    "wall_s": 1,
    "auc_change": 4,
}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _r(value: float | None, key: str) -> float | None:
    return None if value is None else round(value, DIGITS.get(key, 6))


Protocol = str  # "tuned" or "rule"
PROTOCOLS: tuple[Protocol, ...] = ("tuned", "rule")


def summarize(
    study: StudyConfig,
    cells: list[dict[str, Any]],
    protocol: Protocol = "tuned",
    plan: Plan | None = None,
) -> list[dict[str, Any]]:
    """Per (batch size, optimizer, k), the test figures (mean ± sd over seeds) at one LR
    multiplier: under ``tuned`` the one with the best mean *validation* AUC over the selection
    seeds, under ``rule`` the optimizer's fixed rule multiplier (validation is not read to
    choose it). One-stage: selection and report on the same seeds (``seeds``). Two-stage
    (``plan`` given): the picks are the plan's (``tune_seeds``, validation only), the rule's
    multiplier each (optimizer, k)'s pick at the smallest batch, and only ``confirm_seeds``
    cells are reported. ``auc_change`` is the test AUC minus the same optimizer's (and k's) at
    the smallest batch; ``edge`` says whether a tuned pick sits on its grid's edge."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}: {protocol!r}")
    out = []
    for g in sorted(study.batch_sizes):
        for opt in study.optimizers:
            mine = [c for c in cells if c["global_batch"] == g and c["optimizer"] == opt.name]
            ks = sorted({c.get("groups") for c in mine}, key=lambda k: (k is None, k or 0))
            for k in ks:
                row = _summary_row(
                    study, opt, g, k, [c for c in mine if c.get("groups") == k], protocol, plan
                )
                if row is not None:
                    out.append(row)
    first: dict[tuple[str, Any], float] = {}
    for row in out:  # batch sizes ascending: the first row of a series is its smallest batch
        key = (row["optimizer"], row["groups"])
        first.setdefault(key, row["test_auc"])
        row["auc_change"] = _r(row["test_auc"] - first[key], "auc_change")
    return out


def _pick(
    study: StudyConfig,
    opt: StudyOptimizer,
    g: int,
    k: int | None,
    select: dict[float, list[dict[str, Any]]],
    protocol: Protocol,
    plan: Plan | None,
) -> tuple[float | None, str | None]:
    """The multiplier a protocol reports, and its edge flag (tuned only)."""
    if plan is not None:
        key = k if k is not None and k in study.groups_of(opt) else None
        if protocol == "rule":
            return plan.rule.get((opt.name, key)), None
        gp = plan.groups.get((g, opt.name, key))
        return (gp.pick, gp.edge) if gp is not None else (None, None)
    if protocol == "rule":
        return study.rule_multiplier_of(opt), None
    if not select:
        return None, None
    val = {m: _mean([c["val_auc"] for c in cs]) for m, cs in select.items()}
    m = max(val, key=lambda x: val[x])
    grid = sorted(val)
    edge = None
    if len(grid) > 1:
        edge = "low" if m == grid[0] else "high" if m == grid[-1] else None
    return m, edge


def _summary_row(
    study: StudyConfig,
    opt: StudyOptimizer,
    g: int,
    k: int | None,
    mine: list[dict[str, Any]],
    protocol: Protocol,
    plan: Plan | None = None,
) -> dict[str, Any] | None:
    tune = set(study.run_seeds)
    select_cells = [c for c in mine if c["seed"] in tune]
    report_cells = mine if plan is None else [c for c in mine if c["seed"] not in tune]
    select: dict[float, list[dict[str, Any]]] = {}
    for c in sorted(select_cells, key=lambda c: c["lr_multiplier"]):
        select.setdefault(c["lr_multiplier"], []).append(c)
    chosen_m, edge = _pick(study, opt, g, k, select, protocol, plan)
    chosen = [c for c in report_cells if c["lr_multiplier"] == chosen_m]
    if chosen_m is None or not chosen:
        return None
    chosen.sort(key=lambda c: c["seed"])
    test = [c["test_auc"] for c in chosen]
    # a cell restored from its one-line record kept no validation curve: whether it reached
    # the target is unknown, not "no"
    measured = [c for c in chosen if "val_curve" in c or c.get("restored") != "metrics.jsonl"]
    reached = [c["rows_to_target"] for c in measured if c["rows_to_target"] is not None]

    def avg(key: str, cs: list[dict[str, Any]] = chosen) -> float | None:
        xs = [c[key] for c in cs if c.get(key) is not None]
        return _mean(xs) if xs else None

    oracle = avg("oracle_test_auc")
    train_auc = avg("train_auc")
    collapsed = sum(t < study.collapse_auc for t in test)
    row: dict[str, Any] = {
        "protocol": protocol,
        "global_batch": g,
        "optimizer": opt.name,
        "groups": k,
        "baseline": opt.baseline,
        "lr_rule": study.lr_rule_of(opt),
        "steps": chosen[0]["steps"],
        "lr_multiplier": chosen_m,
        "edge": edge,
    }
    if protocol == "tuned":
        row["best_lr_multiplier"] = chosen_m
    row.update(
        {
            "dense_lr": chosen[0]["dense_lr"],
            "sparse_lr": chosen[0]["sparse_lr"],
            "seeds": len(chosen),
            # reported under both protocols; chooses the multiplier only under "tuned"
            "val_auc": _r(avg("val_auc"), "val_auc"),
            "test_auc": _r(_mean(test), "test_auc"),
            "test_auc_sd": _r(_sd(test), "test_auc_sd"),
            "oracle_gap": _r(oracle - _mean(test), "oracle_gap") if oracle else None,
            "train_test_gap": (
                _r(train_auc - _mean(test), "train_test_gap") if train_auc else None
            ),
            "rows_to_target": _mean(reached) if reached else None,
            "reached_target": f"{len(reached)}/{len(measured)}" if measured else None,
            "collapsed": collapsed,
            "collapsed_ci": _rs(clopper_pearson(collapsed, len(test))),
            "wall_s": _r(avg("wall_s"), "wall_s"),
            "gsnr_dense": _r(avg("gsnr_dense"), "gsnr_dense"),
            "gsnr_dense_clipped": _r(avg("gsnr_dense_clipped"), "gsnr_dense"),
            "gsnr_tables": _r(avg("gsnr_tables"), "gsnr_tables"),
            "gsnr_tables_clipped": _r(avg("gsnr_tables_clipped"), "gsnr_tables"),
            "cowclip_clipped": _r(avg("cowclip_clipped"), "cowclip_clipped"),
            # the gradient noise scale, median over the cells: over the last half of training
            # (as `dlrm-vrgd advise`) and over its first tenth (the curve kept in the ledger)
            "b_simple": _median([c["b_simple"] for c in chosen if c.get("b_simple")]),
            "b_simple_early": _median([b for c in chosen if (b := _early_b_simple(c)) is not None]),
            # every reported cell's test AUC, by seed: what the paired statistics are made of
            "test_auc_by_seed": {str(c["seed"]): c["test_auc"] for c in chosen},
        }
    )
    if protocol == "tuned":
        row["val_auc_by_lr"] = {
            str(m): _r(_mean([c["val_auc"] for c in cs]), "val_auc") for m, cs in select.items()
        }
    return row


#: "Early" in training, for the noise scale: this fraction of the steps.
EARLY = 0.1


def _early_b_simple(cell: dict[str, Any]) -> float | None:
    """Median of a cell's smoothed B_simple over the first :data:`EARLY` of its training."""
    return _median([b for x, b in cell.get("b_simple_curve") or [] if x <= EARLY])


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 1) if xs else None


def _rs(values: Any, digits: int = 6) -> Any:
    return [round(v, digits) for v in values]


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


def interactions(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per optimizer with a base: ``(opt − base at the largest batch) − (opt − base at the
    smallest)``, paired by seed (seeds present in all four cells): whether the optimizer holds
    AUC as the batch grows better than its base (> 0: it does)."""
    if not summary:
        return []
    small = min(s["global_batch"] for s in summary)
    large = max(s["global_batch"] for s in summary)
    out = []
    for s in summary:
        if not s["baseline"] or s["global_batch"] != large or small == large:
            continue
        lo = next(
            (
                r
                for r in summary
                if r["global_batch"] == small
                and r["optimizer"] == s["optimizer"]
                and r.get("groups") == s.get("groups")
            ),
            None,
        )
        base_hi, base_lo = _base_row(summary, s), _base_row(summary, s, small)
        if lo is None or base_hi is None or base_lo is None:
            continue
        seeds = set(_by_seed(s)) & set(_by_seed(lo)) & set(_by_seed(base_hi))
        seeds &= set(_by_seed(base_lo))
        diffs = [
            (_by_seed(s)[x] - _by_seed(base_hi)[x]) - (_by_seed(lo)[x] - _by_seed(base_lo)[x])
            for x in sorted(seeds, key=int)
        ]
        out.append(
            {
                "protocol": s.get("protocol", "tuned"),
                "optimizer": s["optimizer"],
                "groups": s.get("groups"),
                "baseline": s["baseline"],
                "small": small,
                "large": large,
                "interaction": _stat(diffs),
                "edge": [x for x in (s["edge"], lo["edge"], base_hi["edge"], base_lo["edge"]) if x],
            }
        )
    return out


def batch_effects(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each arm's own batch effect, test AUC at the largest batch − at the smallest, paired by
    seed."""
    if not summary:
        return []
    small = min(s["global_batch"] for s in summary)
    large = max(s["global_batch"] for s in summary)
    out = []
    for s in summary:
        if s["global_batch"] != large or small == large:
            continue
        lo = next(
            (
                r
                for r in summary
                if r["global_batch"] == small
                and r["optimizer"] == s["optimizer"]
                and r.get("groups") == s.get("groups")
            ),
            None,
        )
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


MD_COLUMNS = [
    ("global_batch", "batch"),
    ("steps", "steps"),
    ("optimizer", "optimizer"),
    ("groups", "k"),
    ("lr_multiplier", "LR x rule"),
    ("val_auc", "val AUC"),
    ("test_auc", "test AUC"),
    ("test_auc_sd", "± sd"),
    ("seeds", "n"),
    ("collapsed", "collapsed (95% CI)"),
    ("auc_change", "Δ vs smallest batch"),
    ("oracle_gap", "oracle gap"),
    ("train_test_gap", "train−test"),
    ("reached_target", "reached target"),
    ("rows_to_target", "rows to target"),
    ("wall_s", "train s"),
    ("gsnr_dense", "GSNR ratio dense"),
    ("gsnr_tables", "GSNR ratio tables"),
    ("gsnr_dense_clipped", "at γ dense"),
    ("gsnr_tables_clipped", "at γ tables"),
    ("cowclip_clipped", "rows CowClip clipped"),
    ("b_simple_early", "B_simple, first 10%"),
    ("b_simple", "B_simple, last half"),
]


def _cell(value: Any, key: str) -> str:
    if value is None:
        return "–"
    if key in ("rows_to_target", "b_simple", "b_simple_early"):
        return f"{value:,.0f}"
    if isinstance(value, float) and key in DIGITS:
        return f"{value:.{DIGITS[key]}f}"
    if isinstance(value, int) and key == "global_batch":
        return f"{value:,}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _summary_cell(s: dict[str, Any], key: str) -> str:
    if key == "lr_multiplier":
        flag = f" **edge ({s['edge']})**" if s.get("edge") else ""
        return f"x{s['lr_multiplier']:g}{flag}"
    if key == "collapsed":
        lo, hi = s["collapsed_ci"]
        return f"{s['collapsed']}/{s['seeds']} [{lo:.2f}, {hi:.2f}]"
    if key == "test_auc_sd" and s.get("seeds", 0) < 2:
        return "–"  # one seed has no spread to report
    return _cell(s[key], key)


def _summary_table(summary: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| " + " | ".join(h for _, h in MD_COLUMNS) + " |",
        "|" + "---|" * len(MD_COLUMNS),
    ]
    for s in summary:
        lines.append("| " + " | ".join(_summary_cell(s, k) for k, _ in MD_COLUMNS) + " |")
    return lines


def _p(p: float | None) -> str:
    if p is None:
        return "–"
    return "<0.0001" if p < 1e-4 else f"{p:.2g}" if p < 0.01 else f"{p:.3f}"


def _stat_cells(st: dict[str, Any]) -> str:
    """``mean | sd | n | [lo, hi] | p`` of a paired statistic."""
    mean = "–" if st["mean"] is None else f"{st['mean']:+.4f}"
    sd = "–" if st["sd"] is None else f"{st['sd']:.4f}"
    ci = "–" if st["ci95"] is None else f"[{st['ci95'][0]:+.4f}, {st['ci95'][1]:+.4f}]"
    return f"{mean} | {sd} | {st['n']} | {ci} | {_p(st['p'])}"


def _edge(flags: list[str]) -> str:
    return "**edge**" if flags else ""


def _pairs_table(pairs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| batch | optimizer | k | base | k base | Δ test AUC | sd | n | 95% CI | p "
        "| collapsed opt / base | Fisher p | pick |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in pairs:
        lines.append(
            f"| {p['global_batch']:,} | {p['optimizer']} | {_cell(p['groups'], 'groups')} | "
            f"{p['baseline']} | {_cell(p['baseline_groups'], 'groups')} | "
            f"{_stat_cells(p['delta_test_auc'])} | "
            f"{p['collapsed'][0]}/{p['collapsed'][1]} / "
            f"{p['baseline_collapsed'][0]}/{p['baseline_collapsed'][1]} | "
            f"{_p(p['collapse_fisher_p'])} | {_edge(p['edge'])} |"
        )
    return lines


def _interaction_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| optimizer | k | base | (opt − base) large − small | sd | n | 95% CI | p | pick |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['optimizer']} | {_cell(r['groups'], 'groups')} | {r['baseline']} | "
            f"{_stat_cells(r['interaction'])} | {_edge(r['edge'])} |"
        )
    return lines


def _batch_effect_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| optimizer | k | test AUC large − small | sd | n | 95% CI | p | pick |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['optimizer']} | {_cell(r['groups'], 'groups')} | "
            f"{_stat_cells(r['batch_effect'])} | {_edge(r['edge'])} |"
        )
    return lines


def _arm(optimizer: str, k: int | None) -> str:
    return optimizer if k is None else f"{optimizer} k = {k}"


def _edge_prose(summary: list[dict[str, Any]]) -> list[str]:
    edges = [s for s in summary if s.get("edge")]
    if not edges:
        return ["No tuned pick sits on its grid's edge."]
    picks = "; ".join(
        f"{_arm(s['optimizer'], s.get('groups'))} at {s['global_batch']:,}: "
        f"x{s['lr_multiplier']:g} ({s['edge']} edge)"
        for s in edges
    )
    return [
        f"**{len(edges)} of {len(summary)} tuned picks sit on the grid's edge** — {picks}. "
        "There the optimum may lie beyond the grid: the figure is a bound (a lower bound on "
        "the tuned AUC), not a tuned result, and every comparison that uses it is flagged."
    ]


def _protocol_section(
    title: str, summary: list[dict[str, Any]], intro: list[str], tuned: bool
) -> list[str]:
    pairs = compare_pairs(summary)
    inter = interactions(summary)
    effects = batch_effects(summary)
    lines = ["", f"## {title}", "", *intro, "", *_summary_table(summary)]
    if tuned:
        lines += ["", *_edge_prose(summary)]
    if pairs:
        lines += [
            "",
            "Optimizer − base, test AUC, **paired by seed** (mean of the per-seed differences, "
            "their sd, n seeds, 95% t-interval with n − 1 degrees of freedom, two-sided p); "
            "collapses of each arm with Fisher's exact test between them:",
            "",
            *_pairs_table(pairs),
        ]
    if inter:
        lines += [
            "",
            "Interaction, paired by seed: (optimizer − base at the largest batch) − (the same "
            "at the smallest). Above 0: the optimizer holds AUC as the batch grows better than "
            "its base.",
            "",
            *_interaction_table(inter),
        ]
    if effects:
        lines += [
            "",
            "Each arm's own batch effect (test AUC at the largest batch − at the smallest), "
            "paired by seed:",
            "",
            *_batch_effect_table(effects),
        ]
    return lines


def markdown(
    study: StudyConfig,
    summary: list[dict[str, Any]],
    target: float,
    summary_rule: list[dict[str, Any]] | None = None,
    plan: Plan | None = None,
) -> str:
    if study.groups is not None or any(o.groups for o in study.optimizers):
        micro = "G / k, k on the groups axis (column k)"
    elif study.micro_batches:
        micro = f"G / {study.micro_batches} ({study.micro_batches} gradient groups per step)"
    else:
        micro = f"min(G, {study.max_micro_batch:,})"
    rules = sorted({study.lr_rule_of(o) for o in study.optimizers})
    if plan is None:
        seeds = (
            f"{len(study.seeds)} seeds {study.seeds}, the same seeds choose the LR (on "
            "validation) and report it (on test), so tuned figures carry a small selection "
            "bias"
        )
    else:
        seeds = (
            f"two-stage: tune seeds {study.run_seeds} choose the LR on validation AUC only "
            f"(edge picks extended up to {study.edge_extensions} notch(es)); the fresh "
            f"confirmation seeds {study.confirm_seeds} are trained at each pick and are the "
            "only cells reported"
        )
    lines = [
        f"# Study `{study.name}`",
        "",
        f"Regime: {study.train_rows:,} training rows, one epoch per cell; the largest batch "
        f"({max(study.batch_sizes):,}) gets {study.steps_at_largest:,} steps. Micro-batch "
        f"{micro}. LR = base x rule(G / {study.reference_batch:,}) x multiplier, rule "
        f"{'/'.join(rules)} (cowclip: dense by the square root, embedding LR fixed, table "
        f"weight decay ∝ G), multipliers {study.lr_multipliers}; {seeds}; warm-up "
        f"{study.warmup_fraction:.0%} of the steps, {study.decay} decay. Target AUC "
        f"(validation) {target:.4f}. A reported cell with test AUC below "
        f"{study.collapse_auc:g} counts as collapsed (Clopper–Pearson 95% intervals). GSNR "
        "columns (VR optimizers): the mean clipped ratio over training (dense layers weighted "
        "by elements, tables by touched rows) and the fraction at the floor γ. Δ vs smallest "
        "batch: test AUC minus the same optimizer's at the smallest batch, same protocol "
        "(unpaired; the paired batch effect is below). **edge**: the pick is the lowest or "
        "highest multiplier tried.",
    ]
    lines += _protocol_section(
        "Tuned: the LR multiplier chosen per (batch, optimizer, k) on validation AUC",
        summary,
        ["The multiplier with the best validation AUC (mean over the selection seeds); test "
         "figures at it."],
        tuned=True,
    )  # fmt: skip
    if summary_rule is not None:
        if plan is None:
            rule_m = {o.name: study.rule_multiplier_of(o) for o in study.optimizers}
            how = (
                "Every batch size at the same fixed multiplier "
                + ", ".join(f"{n} x{m:g}" for n, m in rule_m.items())
                + ", so the LR follows the rule alone. Validation AUC is shown, never used."
            )
        else:
            how = (
                "Every batch size at each (optimizer, k)'s own pick at the smallest batch ("
                + ", ".join(
                    f"{o}{'' if k is None else f' k = {k}'} x{m:g}"
                    for (o, k), m in plan.rule.items()
                )
                + "), fixed before any larger-batch cell ran, so the LR follows the rule alone."
            )
        lines += _protocol_section(
            "Rule: the scaling rule's LR, never tuned", summary_rule, [how], tuned=False
        )
    grid = sorted({float(m) for s in summary for m in s.get("val_auc_by_lr", {})})
    lines += [
        "",
        "Validation AUC by LR multiplier (mean over the selection seeds; – : not run):",
        "",
        "| batch | optimizer | k | " + " | ".join(f"x{m:g}" for m in grid) + " |",
        "|---|---|---|" + "---|" * len(grid),
    ]
    for s in summary:
        vals = [s["val_auc_by_lr"].get(str(m)) for m in grid]
        lines.append(
            f"| {s['global_batch']:,} | {s['optimizer']} | {_cell(s['groups'], 'groups')} | "
            + " | ".join(_cell(v, "val_auc") for v in vals)
            + " |"
        )
    return "\n".join(lines) + "\n"


#: Per-cell curves: the ledger and the plots keep them, results.json does not.
CURVES = ("val_curve", "gsnr_curve", "b_simple_curve")


def write_report(study: StudyConfig, out: Path) -> dict[str, Any]:
    """Every figure of the study from its finished cells, with today's report code: results.json,
    results.csv, results.md and the plots (``dlrm-vrgd study report DIR`` calls this alone)."""
    cells, plan, total = _load_cells(study, out)
    oracle_val = [c["oracle_val_auc"] for c in cells if c.get("oracle_val_auc") is not None]
    target = study.target_auc or (_mean(oracle_val) - 0.01 if oracle_val else 0.75)
    for c in cells:  # rows to the target, from each cell's validation curve
        if "val_curve" in c:
            reached = next(((n, st) for n, a, st in c["val_curve"] if a >= target), None)
            c["rows_to_target"], c["steps_to_target"] = reached or (None, None)
    summary = summarize(study, cells, "tuned", plan)
    summary_rule = summarize(study, cells, "rule", plan)
    results = {
        "study": study.name,
        "target_auc": target,
        "train_rows": study.train_rows,
        "protocol": "two-stage" if plan is not None else "one-stage",
        "collapse_auc": study.collapse_auc,
        "cells_total": total,
        "cells_finished": len(cells),
        "rule_multipliers": (
            {o.name: study.rule_multiplier_of(o) for o in study.optimizers}
            if plan is None
            else {f"{o}" + ("" if k is None else f"-k{k}"): m for (o, k), m in plan.rule.items()}
        ),
        "summary": summary,
        "pairs": compare_pairs(summary),
        "interactions": interactions(summary),
        "batch_effects": batch_effects(summary),
        "summary_rule": summary_rule,
        "pairs_rule": compare_pairs(summary_rule),
        "interactions_rule": interactions(summary_rule),
        "batch_effects_rule": batch_effects(summary_rule),
        "cells": [{k: v for k, v in c.items() if k not in CURVES} for c in cells],
    }
    atomic_write_json(out / "results.json", results)
    buf = io.StringIO()
    keys: list[str] = []
    flat = ("val_auc_by_lr", "test_auc_by_seed", "collapsed_ci")
    for row in summary + summary_rule:
        keys += [k for k in row if k not in flat and k not in keys]
    writer = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", restval="")
    writer.writeheader()
    writer.writerows(summary + summary_rule)
    atomic_write_bytes(out / "results.csv", buf.getvalue().encode())
    text = markdown(study, summary, target, summary_rule, plan)
    atomic_write_bytes(out / "results.md", text.encode())
    if summary:
        from dlrm_vrgd.study.plots import write_plots

        write_plots(study, summary, cells, out, summary_rule)
    return results


def _load_cells(study: StudyConfig, out: Path) -> tuple[list[dict[str, Any]], Plan | None, int]:
    """The finished cells' figures (from their run directories or the ledger, ``cells.jsonl``;
    where a committed study kept only its results.json, from the per-cell figures stored
    there), the two-stage plan (None for one stage) and the number of cells planned."""
    plan = None
    ledger = Ledger(study, out)
    if not (out / "cells").is_dir() and not len(ledger) and (out / "results.json").exists():
        stored = {c["cell"]: c for c in json.loads((out / "results.json").read_text())["cells"]}
        if study.two_stage:
            plan = plan_cells(study, {i: c["val_auc"] for i, c in stored.items()})
            planned = list(dict.fromkeys(plan.tune_cells + plan.confirm_cells))
        else:
            planned = study.cells()
        return [stored[c.id] for c in planned if c.id in stored], plan, len(planned)
    if study.two_stage:
        _, plan = finished_val_aucs(study, ledger.val_auc)
        planned = list(dict.fromkeys(plan.tune_cells + plan.confirm_cells))
    else:
        planned = study.cells()
    cells = [ledger.figures(c) for c in planned]
    return [dict(c) for c in cells if c is not None], plan, len(planned)
