"""``dlrm-vrgd score``: click probabilities of raw rows or day files from an exported model;
under the service (``--record DIR``), progress lines and a result.json for its dashboard."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dlrm_vrgd.cli.common import MissingExtra, examples, extra_of, require_extra


def add_score(sub: argparse._SubParsersAction) -> None:
    sc = sub.add_parser("score", help="click probabilities of raw Criteo rows or day files")
    sc.add_argument("--model", required=True, help="model directory (dlrm-vrgd export)")
    sc.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="raw files (TSV/CSV, gzip), directories of them, or preprocessed directories",
    )
    sc.add_argument("--out", required=True, help="predictions (.csv, or .parquet / .pq)")
    sc.add_argument(
        "--output-format",
        choices=["csv", "parquet", "kaggle"],
        help="default: from --out; kaggle: a submission, Id,Predicted (Kaggle CSV inputs)",
    )
    sc.add_argument(
        "--days", metavar="N[,N...]", help="of a preprocessed directory, score only these days"
    )
    sc.add_argument(
        "--split",
        choices=["train", "val", "test"],
        help="of a preprocessed directory, score the rows the model's config used as this split",
    )
    sc.add_argument("--format", choices=["auto", "tsv", "csv"], default="auto", help="inputs")
    sc.add_argument(
        "--labels",
        choices=["auto", "yes", "no"],
        default="auto",
        help="do raw rows start with a label (40 fields, as train.txt) or not (39, as "
        "test.txt)? auto: a header naming Label, else the first row's field count; with "
        "labels, logloss / AUC / NE go to --metrics",
    )
    sc.add_argument("--skip-bad-rows", action="store_true", help="skip malformed rows, count them")
    sc.add_argument("--metrics", help="metrics file with labels (default OUT.metrics.json)")
    sc.add_argument("--batch-rows", type=int, default=16_384, help="rows per forward pass")
    sc.add_argument("--workers", type=int, help="parsing threads (default: all cores)")
    sc.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    sc.add_argument(
        "--engine",
        choices=["auto", "onnxruntime", "torch"],
        default="auto",
        help="the model's forward: auto is onnxruntime where the model has model.onnx (on CPU)",
    )
    sc.add_argument("--overwrite", action="store_true", help="replace an earlier --out")
    sc.add_argument("--no-progress", action="store_true", help="no progress bar")
    sc.add_argument("--record", metavar="DIR", help=argparse.SUPPRESS)  # the service's run dir
    sc.add_argument(
        "--input-root",
        metavar="DIR",
        help="refuse any input that is a link or whose real path is outside DIR",
    )
    sc.set_defaults(fn=cmd_score)
    examples(
        sc,
        "Click probabilities of raw Criteo rows (or preprocessed day files) from an exported "
        "model; with labels, also logloss, AUC and NE.",
        "dlrm-vrgd score --model models/criteo_small --input data/criteo_10k.txt "
        "--out predictions.csv",
        "dlrm-vrgd score --model models/criteo_small --input data/criteo_small --split test "
        "--out test.parquet",
    )


def cmd_score(args: argparse.Namespace) -> int:
    from dlrm_vrgd import rundir
    from dlrm_vrgd.malloc import set_mmap_threshold
    from dlrm_vrgd.serve.score import score, summary_lines

    # blocks and their parsed arrays are MiBs each: from mmap, so freeing one returns it and the
    # peak RSS stays flat in the input length (glibc's adaptive threshold lets it creep)
    set_mmap_threshold(1024)
    record = Path(args.record) if args.record else None
    progress = None
    if record is not None:  # a run directory for the service: progress lines, then result.json
        record.mkdir(parents=True, exist_ok=True)
        (record / rundir.RESULT).unlink(missing_ok=True)
        log = rundir.JsonlWriter(record / rundir.METRICS)
        log.write({"kind": "start", "step": 0})
        last = [0.0]

        def progress(rows: int, seconds: float, fraction: float) -> None:
            if time.monotonic() - last[0] >= 1.0 or fraction >= 1.0:
                last[0] = time.monotonic()
                rate = rows / seconds if seconds > 0 else None
                log.write({"kind": "score", "rows": rows, "rows_per_s": rate, "fraction": fraction})

    if args.engine == "onnxruntime":
        require_extra("score --engine onnxruntime", "onnx", "onnxruntime")
    try:
        result = score(
            args.model,
            args.input,
            args.out,
            fmt=args.output_format,
            input_format=args.format,
            labels=args.labels,
            skip_bad_rows=args.skip_bad_rows,
            overwrite=args.overwrite,
            batch_rows=args.batch_rows,
            workers=args.workers,
            device=args.device,
            metrics_path=args.metrics,
            progress=not args.no_progress,
            on_progress=progress,
            days=_day_list(args.days) if args.days else None,
            split=args.split,
            input_root=args.input_root,
            engine=args.engine,
        )
    except ImportError as err:
        if args.engine != "auto" or extra_of(err) != "onnx":
            raise
        # auto picks onnxruntime for a model with model.onnx: the torch forward needs no extra
        raise MissingExtra("score", "onnx", "or --engine torch") from err
    if record is not None:
        # the last progress line carries the metrics of labelled rows, for the dashboard's tiles
        mm = result.metrics or {}
        log.write(
            {
                "kind": "score",
                "rows": result.rows,
                "rows_per_s": result.rows_per_second,
                "fraction": 1.0,
                "auc": mm.get("auc"),
                "logloss": mm.get("logloss"),
            }
        )
        rundir.atomic_write_json(
            record / rundir.RESULT,
            {
                "rows": result.rows,
                "seconds": result.seconds,
                "rows_per_s": result.rows_per_second,
                "bad_rows": result.bad_rows,
                "predictions": str(result.out),
                "metrics": result.metrics,
                "model": str(Path(args.model).absolute()),
                "training_days": result.training_days,
            },
        )
    if result.training_days:
        print(
            "warning: scored days the model trained on (" + ", ".join(result.training_days)
            + "): their AUC overstates it; --split test scores the rows it was tested on",
            file=sys.stderr,
        )  # fmt: skip
    print("\n".join(summary_lines(result)))
    return 0


def _day_list(text: str) -> list[int]:
    try:
        days = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--days {text!r}: expected day numbers, e.g. 5 or 5,6") from None
    if any(d < 0 for d in days) or len(set(days)) != len(days):
        raise ValueError(f"--days {text!r}: day numbers are distinct and >= 0")
    return days
