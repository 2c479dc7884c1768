"""A study's ``results.md``: the regime, the primary endpoints with raw and Holm-adjusted
p-values (which survive), and per protocol the summary table, the paired comparisons and the
validation AUC of every learning rate. Numbers come from :mod:`dlrm_vrgd.study.report` and
:mod:`dlrm_vrgd.study.endpoints`; nothing here computes a statistic."""

from __future__ import annotations

from typing import Any

from dlrm_vrgd.study.config import StudyConfig
from dlrm_vrgd.study.endpoints import batch_effects, compare_pairs, interactions
from dlrm_vrgd.study.protocol import Plan

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


def _status(study: StudyConfig, plan: Plan | None) -> list[str]:
    """What kind of evidence the page is, said before any figure."""
    if study.exploratory:
        return [
            "> **Exploratory cells**, not pre-registered: run to explain earlier results or to "
            "test a design's code path, not to test a claim. Every figure on this page is "
            "exploratory and is labelled so wherever it is quoted; none is a tested claim.",
        ]
    if study.preregistration:
        return [
            f"Pre-registered: `{study.preregistration}` fixed the design, the primary endpoints "
            "and their correction before any cell ran.",
        ]
    selection = "" if plan is not None else ", and the same seeds choose the LR and report it"
    return [
        f"Not pre-registered: the design was not fixed in writing before the cells ran{selection}."
    ]


def _primary_section(study: StudyConfig, family: dict[str, Any]) -> list[str]:
    """The primary endpoints: raw and Holm-adjusted p, and which survive."""
    rows = family["endpoints"]
    m, alpha = family["m"], family["alpha"]
    if study.exploratory:
        title = f"Interactions with Holm's adjustment over m = {m} (exploratory)"
        who = (
            "An exploratory study: these interactions are not a test, whatever their p; "
            "Holm's adjustment over them is shown for reference."
        )
    elif family["registered"]:
        title = f"Primary endpoints: Holm over m = {m}"
        who = "The family fixed before the study (`primary_endpoints`)."
    else:
        title = f"Primary endpoints: Holm over m = {m}"
        who = (
            "Not pre-registered: the family is taken as every tuned interaction of an arm with "
            "its base."
        )
    lines = ["", f"## {title}", ""]
    if not rows:
        return [
            *lines,
            "No interaction can be formed here (one batch size, or no arm with a base).",
        ]
    small, large = rows[0]["small"], rows[0]["large"]
    lines += [
        f"{who} Each is the tuned interaction (arm − base at {large:,}) − (arm − base at "
        f"{small:,}), test AUC, paired by seed, 95% t-interval, two-sided p; Holm's step-down "
        f"adjustment over the m = {m} endpoints holds the family-wise error at α = {alpha:g}. "
        "An endpoint whose adjusted p exceeds α is not claimed.",
        "",
        "| endpoint | interaction | sd | n | 95% CI | p raw | p Holm | survives Holm | pick |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        survives = {True: "yes", False: "no", None: "not run"}[r["survives"]]
        lines.append(
            f"| {_arm(r['optimizer'], r['groups'])} − {r['baseline']} | "
            f"{_stat_cells(r['interaction'])} | {_p(r['p_holm'])} | {survives} | "
            f"{_edge(r['edge'])} |"
        )
    yes = [f"{_arm(r['optimizer'], r['groups'])} − {r['baseline']}" for r in rows if r["survives"]]
    no = [
        f"{_arm(r['optimizer'], r['groups'])} − {r['baseline']}"
        for r in rows
        if r["survives"] is False
    ]
    lines += [
        "",
        f"Survive Holm: {', '.join(yes) if yes else 'none'}. Do not survive: "
        f"{', '.join(no) if no else 'none'}.",
    ]
    if any(r["edge"] for r in rows):
        lines[-1] += " An endpoint marked **edge** uses a pick on its grid's edge (a bound)."
    return lines


def markdown(
    study: StudyConfig,
    summary: list[dict[str, Any]],
    target: float,
    summary_rule: list[dict[str, Any]] | None = None,
    plan: Plan | None = None,
    family: dict[str, Any] | None = None,
    tuned_only: list[dict[str, Any]] | None = None,
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
        "",
        *_status(study, plan),
    ]
    if family is not None:
        lines += _primary_section(study, family)
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
    extra = tuned_only or []
    rows = [*summary, *extra]
    grid = sorted({float(m) for s in rows for m in s.get("val_auc_by_lr", {})})
    lines += [
        "",
        "Validation AUC by LR multiplier (mean over the selection seeds; – : not run):",
        "",
        "| batch | optimizer | k | " + " | ".join(f"x{m:g}" for m in grid) + " |",
        "|---|---|---|" + "---|" * len(grid),
    ]
    for s in rows:
        vals = [s["val_auc_by_lr"].get(str(m)) for m in grid]
        name = s["optimizer"] + (" (tuning seeds only, not confirmed)" if s in extra else "")
        lines.append(
            f"| {s['global_batch']:,} | {name} | {_cell(s['groups'], 'groups')} | "
            + " | ".join(_cell(v, "val_auc") for v in vals)
            + " |"
        )
    if extra:
        lines += [
            "",
            f"Batches {sorted({s['global_batch'] for s in extra})} are tuned but not confirmed "
            "(`confirm_batches`): their rows above are the tuning seeds' validation AUC only, "
            "exploratory, with no test figure.",
        ]
    return "\n".join(lines) + "\n"
