"""``dlrm-vrgd study [report DIR] | advise``: batch-size studies and their reports, and the
batch size one run's gradient noise supports."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from dlrm_vrgd.cli.common import REPO, ProgressLine, add_set, require_extra


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.0 < value < 1e9:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def add_study(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("study", help="run a batch-size study (resumable) and write its report")
    st.add_argument(
        "action", nargs="?", choices=["report"], help="report DIR: rewrite DIR's reports"
    )
    st.add_argument("dir", nargs="?", metavar="DIR", help="with report: a study directory")
    st.add_argument("--config", help="YAML StudyConfig (see configs/study_*.yaml)")
    add_set(st, help="override a study config value, e.g. --set base.run.steps=50 (repeatable)")
    st.add_argument("--out", help="study directory (default runs/study-NAME)")
    st.add_argument(
        "--budget-s",
        type=_positive_seconds,
        metavar="N",
        help="run the cells that fit in N seconds from this process's start, then stop cleanly "
        "(each cell's cost estimated from the cells done so far; the same command resumes)",
    )
    st.add_argument(
        "--reserve-s",
        type=_positive_seconds,
        default=20.0,
        metavar="S",
        help="of the budget, seconds kept for the report and the bundle at the end (default 20)",
    )
    st.add_argument(
        "--bundle",
        metavar="DIR",
        help="copy the files an allocation brings back (ledger, picks, reports, allocation.json:"
        " at most 8) into DIR after every cell",
    )
    st.set_defaults(fn=cmd_study)


def cmd_study(args: argparse.Namespace) -> int:
    """A study's cells (resumed from its ledger), or with ``report DIR`` its reports rewritten.
    (``action`` is ``report`` or None: argparse refuses any other word.)"""
    from dlrm_vrgd.resources import check_study_fits
    from dlrm_vrgd.study import load_study, run_study

    require_extra("study", "study")  # its report's plots: before the cells, not after
    if args.action == "report":
        return _report(args)
    if args.config is None:
        raise ValueError("study: --config is required (or: study report DIR)")
    study = load_study(args.config, args.set)
    check_study_fits(study)
    out = Path(args.out or REPO / "runs" / f"study-{study.name}")
    stage = " (two-stage: tuning grid)" if study.two_stage else ""
    print(
        f"study {study.name}: {len(study.cells())} cells{stage} "
        f"({len(study.batch_sizes)} batch sizes x {len(study.optimizers)} optimizers x "
        f"{len(study.lr_multipliers)} LRs x {len(study.run_seeds)} seeds), "
        f"{study.steps_at_largest:,} steps at the largest batch -> {out}"
    )
    progress = ProgressLine()

    def on_cell(i: int, total: int, cell: Any, status: str, record: Any) -> None:
        if status == "start":
            print(f"[{i + 1}/{total}] {cell.id}", flush=True)
            return
        what = "finished before" if status == "skip" else f"{record['train_seconds']:.0f} s"
        print(
            f"[{record['step']}/{total} done] {cell.id}: val AUC {record['val_auc']:.4f}, "
            f"test AUC {record['test_auc']:.4f} ({what})",
            flush=True,
        )

    budget = None
    if args.budget_s is not None:
        from dlrm_vrgd.study.budget import Budget, process_age_s

        # the interpreter's start and the imports count too: the budget runs from the process's
        budget = Budget(
            args.budget_s,
            reserve_s=min(args.reserve_s, args.budget_s / 2),
            start=time.monotonic() - process_age_s(),
        )
    results = run_study(
        study,
        out,
        on_cell=on_cell,
        train_callbacks=[progress] if study.workers == 1 else [],
        budget=budget,
        bundle=Path(args.bundle) if args.bundle else None,
    )
    if results.get("stopped"):
        print(
            f"stopped within the budget: {results['stopped']}; "
            f"{results['cells_finished']}/{results['cells_total']} cells finished. "
            "The same command resumes (from the ledger, cells.jsonl)."
        )
    else:
        print((out / "results.md").read_text())
    print(
        f"results: {out}/results.json, results.csv, results.md and *.png "
        f"({results['cells_finished']}/{results['cells_total']} cells)"
        + (f"; bundle: {args.bundle}" if args.bundle else "")
    )
    return 0


def _report(args: argparse.Namespace) -> int:
    """Rewrite a study's reports from its finished cells with today's report code."""
    from dlrm_vrgd.study import rewrite_report

    if args.dir is None:
        raise ValueError("study report: the study directory is required")
    results = rewrite_report(Path(args.dir))
    print(
        f"rewrote {args.dir}/results.json, results.csv, results.md and *.png "
        f"({results['cells_finished']}/{results['cells_total']} cells)"
    )
    return 0


def add_advise(sub: argparse._SubParsersAction) -> None:
    ad = sub.add_parser(
        "advise",
        help="the batch size a run's gradient noise supports (B_simple, from its gsnr.jsonl)",
    )
    ad.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (finished or running)")
    ad.add_argument(
        "--last",
        type=_fraction,
        default=0.5,
        help="judge on the last FRACTION of the steps recorded (default 0.5)",
    )
    ad.add_argument("--json", action="store_true", help="print the advice as JSON")
    ad.set_defaults(fn=cmd_advise)


def cmd_advise(args: argparse.Namespace) -> int:
    from dlrm_vrgd.advice import advise

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a directory")
    advice = advise(run_dir, args.last)
    # the text is the advice's own (the API and the dashboard show the same words)
    print(json.dumps(advice, indent=2) if args.json else advice["text"])
    return 0
