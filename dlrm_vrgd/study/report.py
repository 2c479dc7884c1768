"""A study's figures: per cell; per (batch size, optimizer, k) under two protocols — *tuned* (the
LR multiplier chosen on validation) and *rule* (the study's fixed ``rule_multiplier``: the
scaling rule's LR, validation never consulted) — and per VR-vs-base pair under each; written as
JSON, CSV, Markdown tables and PNG plots. Both protocols read the same cells."""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from pathlib import Path
from typing import Any

from dlrm_vrgd.study.config import Cell, StudyConfig, StudyOptimizer
from dlrm_vrgd.train.rundir import RESULT, atomic_write_bytes, atomic_write_json, read_jsonl

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
    "wall_s": 1,
    "auc_change": 4,
}


def cell_figures(study: StudyConfig, cell: Cell, run_dir: Path, target: float) -> dict[str, Any]:
    """What one finished cell measured."""
    result = json.loads((run_dir / RESULT).read_text())
    records = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r for r in records if r.get("kind") == "eval" and r.get("split") == "val"]
    reached = next((r for r in evals if r["auc"] >= target), None)
    dense_ratio, dense_clip, table_ratio, table_clip = _gsnr_means(run_dir / "gsnr.jsonl")
    cfg = result["config"]
    return {
        "cell": cell.id,
        "global_batch": cell.global_batch,
        "optimizer": cell.optimizer,
        "lr_multiplier": cell.lr_multiplier,
        "seed": cell.seed,
        # k: micro-batches (gradient groups) per step, on the groups axis or not
        "groups": cell.groups or cell.global_batch // cfg["run"]["micro_batch"],
        "dense_lr": cfg["optim"]["dense"]["lr"],
        "sparse_lr": cfg["optim"]["sparse"]["lr"],
        "steps": result["steps"],
        "rows": result["samples"],
        "val_auc": result["val"]["auc"],
        "test_auc": result["test"]["auc"],
        "oracle_test_auc": result["test"].get("oracle_auc"),
        "oracle_val_auc": result["val"].get("oracle_auc"),
        "train_auc": (result.get("train") or {}).get("auc"),
        "wall_s": result["timings"]["train_seconds"],
        "rows_to_target": reached["samples"] if reached else None,
        "steps_to_target": reached["step"] if reached else None,
        "gsnr_dense": dense_ratio,
        "gsnr_dense_clipped": dense_clip,
        "gsnr_tables": table_ratio,
        "gsnr_tables_clipped": table_clip,
        "val_curve": [(r["samples"], r["auc"]) for r in evals],
    }


def _gsnr_means(path: Path) -> tuple[float | None, float | None, float | None, float | None]:
    """Mean over steps of the element-weighted dense ratio / fraction clipped, and of the
    touched-row-weighted table ratio / fraction clipped (None where not measured)."""
    dense_r, dense_c, table_r, table_c = [], [], [], []
    for rec in read_jsonl(path):
        measured = [d for d in rec.get("dense", []) if d.get("raw_gsnr") is not None]
        n = sum(d["numel"] for d in measured)
        if n:
            dense_r.append(sum(d["ratio"] * d["numel"] for d in measured) / n)
            dense_c.append(sum(d["frac_clipped"] * d["numel"] for d in measured) / n)
        tables = [t for t in rec.get("tables", []) if t.get("ratio") is not None]
        n = sum(t["touched_rows"] for t in tables)
        if n:
            table_r.append(sum(t["ratio"] * t["touched_rows"] for t in tables) / n)
            table_c.append(sum(t["frac_clipped"] * t["touched_rows"] for t in tables) / n)

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    return mean(dense_r), mean(dense_c), mean(table_r), mean(table_c)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _r(value: float | None, key: str) -> float | None:
    return None if value is None else round(value, DIGITS.get(key, 6))


Protocol = str  # "tuned" or "rule"
PROTOCOLS: tuple[Protocol, ...] = ("tuned", "rule")


def summarize(
    study: StudyConfig, cells: list[dict[str, Any]], protocol: Protocol = "tuned"
) -> list[dict[str, Any]]:
    """Per (batch size, optimizer, k), the test figures (mean ± sd over seeds) at one LR
    multiplier: under ``tuned`` the one with the best mean *validation* AUC over seeds, under
    ``rule`` the optimizer's fixed ``rule_multiplier`` (validation is not read to choose it).
    ``auc_change`` is the test AUC minus the same optimizer's (and k's) at the smallest batch."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}: {protocol!r}")
    out = []
    for g in sorted(study.batch_sizes):
        for opt in study.optimizers:
            mine = [c for c in cells if c["global_batch"] == g and c["optimizer"] == opt.name]
            ks = sorted({c.get("groups") for c in mine}, key=lambda k: (k is None, k or 0))
            for k in ks:
                row = _summary_row(
                    study, opt, g, k, [c for c in mine if c.get("groups") == k], protocol
                )
                if row is not None:
                    out.append(row)
    first: dict[tuple[str, Any], float] = {}
    for row in out:  # batch sizes ascending: the first row of a series is its smallest batch
        key = (row["optimizer"], row["groups"])
        first.setdefault(key, row["test_auc"])
        row["auc_change"] = _r(row["test_auc"] - first[key], "auc_change")
    return out


def _summary_row(
    study: StudyConfig,
    opt: StudyOptimizer,
    g: int,
    k: int | None,
    mine: list[dict[str, Any]],
    protocol: Protocol,
) -> dict[str, Any] | None:
    by_lr = {m: [c for c in mine if c["lr_multiplier"] == m] for m in study.lr_multipliers}
    by_lr = {m: cs for m, cs in by_lr.items() if cs}
    if protocol == "tuned":
        if not by_lr:
            return None
        val_by_lr = {m: _mean([c["val_auc"] for c in cs]) for m, cs in by_lr.items()}
        chosen_m = max(val_by_lr, key=lambda m: val_by_lr[m])
    else:
        chosen_m = study.rule_multiplier_of(opt)
        if chosen_m not in by_lr:
            return None
    chosen = by_lr[chosen_m]
    test = [c["test_auc"] for c in chosen]
    reached = [c["rows_to_target"] for c in chosen if c["rows_to_target"] is not None]

    def avg(key: str, cs: list[dict[str, Any]] = chosen) -> float | None:
        xs = [c[key] for c in cs if c.get(key) is not None]
        return _mean(xs) if xs else None

    oracle = avg("oracle_test_auc")
    train_auc = avg("train_auc")
    row: dict[str, Any] = {
        "protocol": protocol,
        "global_batch": g,
        "optimizer": opt.name,
        "groups": k,
        "baseline": opt.baseline,
        "lr_rule": study.lr_rule_of(opt),
        "steps": chosen[0]["steps"],
        "lr_multiplier": chosen_m,
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
            "reached_target": f"{len(reached)}/{len(chosen)}",
            "wall_s": _r(avg("wall_s"), "wall_s"),
            "gsnr_dense": _r(avg("gsnr_dense"), "gsnr_dense"),
            "gsnr_dense_clipped": _r(avg("gsnr_dense_clipped"), "gsnr_dense"),
            "gsnr_tables": _r(avg("gsnr_tables"), "gsnr_tables"),
            "gsnr_tables_clipped": _r(avg("gsnr_tables_clipped"), "gsnr_tables"),
        }
    )
    if protocol == "tuned":
        row["val_auc_by_lr"] = {
            str(m): _r(_mean([c["val_auc"] for c in cs]), "val_auc") for m, cs in by_lr.items()
        }
    return row


def compare_pairs(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """VR − base test AUC at each batch size (and k), with the standard error of the
    difference; the base at the same k where it has one, else at its own."""
    rows = []
    index = {(s["global_batch"], s["optimizer"], s.get("groups")): s for s in summary}
    for s in summary:
        if not s["baseline"]:
            continue
        base = index.get((s["global_batch"], s["baseline"], s.get("groups")))
        if base is None:
            base = next(
                (
                    b
                    for b in summary
                    if b["global_batch"] == s["global_batch"] and b["optimizer"] == s["baseline"]
                ),
                None,
            )
        if base is None:
            continue
        se = math.sqrt(
            s["test_auc_sd"] ** 2 / s["seeds"] + base["test_auc_sd"] ** 2 / base["seeds"]
        )
        diff = s["test_auc"] - base["test_auc"]
        rows.append(
            {
                "protocol": s.get("protocol", "tuned"),
                "global_batch": s["global_batch"],
                "optimizer": s["optimizer"],
                "groups": s.get("groups"),
                "baseline": base["optimizer"],
                "baseline_groups": base.get("groups"),
                "delta_test_auc": round(diff, 4),
                "se": round(se, 4),
                "z": round(diff / se, 2) if se > 0 else None,
            }
        )
    return rows


MD_COLUMNS = [
    ("global_batch", "batch"),
    ("steps", "steps"),
    ("optimizer", "optimizer"),
    ("groups", "k"),
    ("lr_multiplier", "LR x rule"),
    ("val_auc", "val AUC"),
    ("test_auc", "test AUC"),
    ("test_auc_sd", "± sd"),
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
]


def _cell(value: Any, key: str) -> str:
    if value is None:
        return "–"
    if key == "rows_to_target":
        return f"{value:,.0f}"
    if isinstance(value, float) and key in DIGITS:
        return f"{value:.{DIGITS[key]}f}"
    if isinstance(value, int) and key == "global_batch":
        return f"{value:,}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _summary_table(summary: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| " + " | ".join(h for _, h in MD_COLUMNS) + " |",
        "|" + "---|" * len(MD_COLUMNS),
    ]
    for s in summary:
        lines.append("| " + " | ".join(_cell(s[k], k) for k, _ in MD_COLUMNS) + " |")
    return lines


def _pairs_table(pairs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| batch | VR | k | base | k base | Δ test AUC | se | z |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in pairs:
        z = "–" if p["z"] is None else f"{p['z']:.2f}"
        lines.append(
            f"| {p['global_batch']:,} | {p['optimizer']} | {_cell(p['groups'], 'groups')} | "
            f"{p['baseline']} | {_cell(p['baseline_groups'], 'groups')} | "
            f"{p['delta_test_auc']:+.4f} | {p['se']:.4f} | {z} |"
        )
    return lines


def markdown(
    study: StudyConfig,
    summary: list[dict[str, Any]],
    pairs: list[dict[str, Any]],
    target: float,
    summary_rule: list[dict[str, Any]] | None = None,
    pairs_rule: list[dict[str, Any]] | None = None,
) -> str:
    if study.groups is not None or any(o.groups for o in study.optimizers):
        micro = "G / k, k on the groups axis (column k)"
    elif study.micro_batches:
        micro = f"G / {study.micro_batches} ({study.micro_batches} gradient groups per step)"
    else:
        micro = f"min(G, {study.max_micro_batch:,})"
    rules = sorted({study.lr_rule_of(o) for o in study.optimizers})
    rule_m = {o.name: study.rule_multiplier_of(o) for o in study.optimizers}
    lines = [
        f"# Study `{study.name}`",
        "",
        f"Regime: {study.train_rows:,} training rows, one epoch per cell; the largest batch "
        f"({max(study.batch_sizes):,}) gets {study.steps_at_largest:,} steps. Micro-batch "
        f"{micro}. LR = base x rule(G / {study.reference_batch:,}) x multiplier, rule "
        f"{'/'.join(rules)} (cowclip: dense by the square root, embedding LR fixed, table "
        f"weight decay ∝ G), multipliers {study.lr_multipliers}; "
        f"{len(study.seeds)} seeds; warm-up {study.warmup_fraction:.0%} of the steps, "
        f"{study.decay} decay. Target AUC (validation) {target:.4f}. GSNR "
        "columns (VR optimizers): the mean clipped ratio over training (dense layers weighted "
        "by elements, tables by touched rows) and the fraction at the floor γ. Δ vs smallest "
        "batch: test AUC minus the same optimizer's at the smallest batch, same protocol.",
        "",
        "## Tuned: the LR multiplier chosen per (batch, optimizer, k) on validation AUC",
        "",
        "The multiplier with the best validation AUC (mean over seeds); test figures at it.",
        "",
        *_summary_table(summary),
    ]
    if pairs:
        lines += ["", "VR − base, tuned, test AUC (mean over seeds; se of the difference):", ""]
        lines += _pairs_table(pairs)
    if summary_rule is not None:
        lines += [
            "",
            "## Rule: the scaling rule's LR, never tuned",
            "",
            "Every batch size at the same fixed multiplier "
            + ", ".join(f"{n} x{m:g}" for n, m in rule_m.items())
            + ", so the LR follows the rule alone. Validation AUC is shown, never used.",
            "",
            *_summary_table(summary_rule),
        ]
        if pairs_rule:
            lines += ["", "VR − base, rule, test AUC:", ""]
            lines += _pairs_table(pairs_rule)
    lines += [
        "",
        "Validation AUC by LR multiplier (mean over seeds):",
        "",
        "| batch | optimizer | k | " + " | ".join(f"x{m:g}" for m in study.lr_multipliers) + " |",
        "|---|---|---|" + "---|" * len(study.lr_multipliers),
    ]
    for s in summary:
        vals = [s["val_auc_by_lr"].get(str(m)) for m in study.lr_multipliers]
        lines.append(
            f"| {s['global_batch']:,} | {s['optimizer']} | {_cell(s['groups'], 'groups')} | "
            + " | ".join(_cell(v, "val_auc") for v in vals)
            + " |"
        )
    return "\n".join(lines) + "\n"


def write_report(study: StudyConfig, out: Path) -> dict[str, Any]:
    finished = [(c, out / "cells" / c.id) for c in study.cells()]
    finished = [(c, d) for c, d in finished if (d / RESULT).exists()]
    oracle_val = [
        json.loads((d / RESULT).read_text())["val"].get("oracle_auc") for _, d in finished
    ]
    oracle_val = [v for v in oracle_val if v is not None]
    target = study.target_auc or (_mean(oracle_val) - 0.01 if oracle_val else 0.75)
    cells = [cell_figures(study, c, d, target) for c, d in finished]
    summary = summarize(study, cells, "tuned")
    summary_rule = summarize(study, cells, "rule")
    pairs = compare_pairs(summary)
    pairs_rule = compare_pairs(summary_rule)
    results = {
        "study": study.name,
        "target_auc": target,
        "train_rows": study.train_rows,
        "cells_total": len(study.cells()),
        "cells_finished": len(cells),
        "rule_multipliers": {o.name: study.rule_multiplier_of(o) for o in study.optimizers},
        "summary": summary,
        "pairs": pairs,
        "summary_rule": summary_rule,
        "pairs_rule": pairs_rule,
        "cells": [{k: v for k, v in c.items() if k != "val_curve"} for c in cells],
    }
    atomic_write_json(out / "results.json", results)
    buf = io.StringIO()
    keys: list[str] = []
    for row in summary + summary_rule:
        keys += [k for k in row if k != "val_auc_by_lr" and k not in keys]
    writer = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", restval="")
    writer.writeheader()
    writer.writerows(summary + summary_rule)
    atomic_write_bytes(out / "results.csv", buf.getvalue().encode())
    text = markdown(study, summary, pairs, target, summary_rule, pairs_rule)
    atomic_write_bytes(out / "results.md", text.encode())
    if summary:
        from dlrm_vrgd.study.plots import write_plots

        write_plots(study, summary, cells, out, summary_rule)
    return results
