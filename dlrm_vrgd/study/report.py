"""A study's figures: per cell; per (batch size, optimizer, k) under two protocols — *tuned* (the
LR multiplier chosen on validation) and *rule* (the study's fixed ``rule_multiplier``: the
scaling rule's LR, validation never consulted) — and per VR-vs-base pair under each; written as
JSON, CSV, Markdown tables (:mod:`dlrm_vrgd.study.markdown`) and PNG plots. Both protocols read
the same cells; the paired comparisons and the primary endpoints with Holm's adjustment are
:mod:`dlrm_vrgd.study.endpoints`'s."""

from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path
from typing import Any

from dlrm_vrgd.rundir import atomic_write_bytes, atomic_write_json
from dlrm_vrgd.study.config import StudyConfig, StudyOptimizer
from dlrm_vrgd.study.endpoints import batch_effects, compare_pairs, interactions, primary
from dlrm_vrgd.study.ledger import Ledger
from dlrm_vrgd.study.markdown import DIGITS, markdown
from dlrm_vrgd.study.protocol import Plan, finished_val_aucs
from dlrm_vrgd.study.protocol import plan as plan_cells
from dlrm_vrgd.study.stats import clopper_pearson

__all__ = [
    "batch_effects",
    "compare_pairs",
    "interactions",
    "markdown",
    "primary",
    "summarize",
    "write_report",
]


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


def tuned_only(study: StudyConfig, plan: Plan | None) -> list[dict[str, Any]]:
    """The (batch, optimizer, k) groups a two-stage study tunes but does not confirm
    (``confirm_batches``): their grid, the tuning seeds' mean validation AUC per multiplier,
    the pick and its edge flag. No test figure: these are tuning cells."""
    if plan is None:
        return []
    confirmed = set(study.confirmed_batches)
    return [
        {
            "global_batch": g,
            "optimizer": o,
            "groups": k,
            "grid": gp.grid,
            "val_auc_by_lr": {str(m): _r(v, "val_auc") for m, v in gp.val_by_lr.items()},
            "lr_multiplier": gp.pick,
            "edge": gp.edge,
        }
        for (g, o, k), gp in plan.groups.items()
        if g not in confirmed
    ]


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
    family = primary(study, summary)
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
        "exploratory": study.exploratory,
        "preregistration": study.preregistration,
        # the primary endpoints, raw and Holm-adjusted p, and which survive
        "primary": family,
        "summary": summary,
        "tuned_only": tuned_only(study, plan),
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
    text = markdown(study, summary, target, summary_rule, plan, family, results["tuned_only"])
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
