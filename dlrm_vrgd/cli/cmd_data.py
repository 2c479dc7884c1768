"""``dlrm-vrgd generate | preprocess``: day files, from a config's synthetic data or from raw
Criteo logs."""

from __future__ import annotations

import argparse
from pathlib import Path

from dlrm_vrgd.cli.common import add_config, examples
from dlrm_vrgd.config import load_config


def add_generate(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser(
        "generate",
        help="write the synthetic data as Criteo day files (data.source: criteo reads them)",
    )
    add_config(g)
    g.add_argument("--out", required=True, help="output directory")
    g.add_argument(
        "--rows-per-day", type=int, metavar="N", help="cut the train split into days of N rows"
    )
    g.add_argument(
        "--workers", type=int, metavar="N", help="generating processes (default: every core)"
    )
    g.add_argument("--overwrite", action="store_true", help="replace an earlier output")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--multi-hot",
        nargs="?",
        const="config",
        metavar="SIZES",
        help="write multi-hot days (MLPerf's day_N_sparse_multi_hot.npz): bag sizes S,S,... "
        "one a table, `mlperf` for MLPerf DLRMv2's, or none given: data.multi_hot_sizes",
    )
    g.add_argument(
        "--split",
        action="append",
        choices=["train", "val", "test"],
        help="instead: write this split as torchrec's {split}_*.npy (repeatable)",
    )
    g.set_defaults(fn=cmd_generate)
    examples(
        g,
        "The synthetic data of a config written as Criteo day files (npy), read like real "
        "data (data.source: criteo). `score` reads raw text or preprocessed directories, not "
        "these.",
        "dlrm-vrgd generate --config configs/demo.yaml --out data/demo_days",
        "dlrm-vrgd generate --config configs/demo.yaml --out data/demo_mh --multi-hot mlperf",
    )


def multi_hot_sizes(text: str | None, configured: list[int] | None) -> list[int] | None:
    """``--multi-hot``'s bag sizes: None (one-hot days), the config's (``config``), MLPerf's
    (``mlperf``) or a comma-separated list."""
    if text is None:
        return None
    if text == "config":
        if configured is None:
            raise ValueError("--multi-hot without sizes needs data.multi_hot_sizes in the config")
        return list(configured)
    if text == "mlperf":
        from dlrm_vrgd.data.multihot import MLPERF_MULTI_HOT_SIZES

        return list(MLPERF_MULTI_HOT_SIZES)
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--multi-hot {text!r}: expected S,S,... (integers), or mlperf") from None
    if min(sizes) < 1:
        raise ValueError(f"--multi-hot {text!r}: bag sizes are at least 1")
    return sizes


def cmd_generate(args: argparse.Namespace) -> int:
    from dlrm_vrgd.data import export

    cfg = load_config(args.config, args.set)
    sizes = multi_hot_sizes(args.multi_hot, getattr(cfg.data, "multi_hot_sizes", None))
    if args.split and sizes is not None:
        raise ValueError("--multi-hot writes day files; it does not combine with --split")
    if args.split:  # torchrec's {split}_*.npy names, one split at a time
        for split in args.split:
            paths = export.export_split(cfg, split, Path(args.out))
            print(f"{split}: " + ", ".join(str(p) for p in paths))
        return 0
    result = export.generate_days(
        cfg,
        args.out,
        rows_per_day=args.rows_per_day,
        workers=args.workers,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        multi_hot=sizes,
    )
    print("\n".join(export.summary_lines(result)))
    return 0


def add_preprocess(sub: argparse._SubParsersAction) -> None:
    pp = sub.add_parser("preprocess", help="raw Criteo logs (TSV/CSV, gzip) -> npy day files")
    pp.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="raw files, or directories (their files in natural order); one day each",
    )
    pp.add_argument("--out", required=True, help="output directory (appears when complete)")
    pp.add_argument(
        "--format",
        choices=["auto", "tsv", "csv"],
        default="auto",
        help="tab- or comma-separated inputs (auto: from the first line)",
    )
    pp.add_argument("--max-rows-per-table", metavar="N[,N...]", help="ids -> id %% N (1 or 26)")
    pp.add_argument(
        "--frequency-threshold",
        type=int,
        default=0,
        metavar="F",
        help="ids seen < F times share row 0 (needs --max-rows-per-table)",
    )
    pp.add_argument("--skip-bad-rows", action="store_true", help="skip malformed rows, count them")
    pp.add_argument("--rows-per-day", type=int, metavar="R", help="cut each input into R-row days")
    pp.add_argument(
        "--split",
        metavar="TRAIN,VAL,TEST",
        help="cut one input into train/val/test days by these fractions (e.g. 0.8,0.1,0.1)",
    )
    pp.add_argument(
        "--labels",
        choices=["auto", "yes", "no"],
        default="auto",
        help="label column? auto: the header, or any 40-field line in the first block",
    )
    pp.add_argument("--dense-floor", type=int, default=-3, metavar="M", help="log(max(x,M)-M+2)")
    pp.add_argument("--overwrite", action="store_true", help="replace an earlier --out")
    pp.add_argument("--workers", type=int, help="parsing threads (default: all cores)")
    pp.add_argument("--no-progress", action="store_true", help="no progress bar")
    pp.set_defaults(fn=cmd_preprocess)
    examples(
        pp,
        "Raw Criteo logs (Kaggle train.txt / test.txt, 1TB day_N, CSV, gzip) into npy day "
        "files and a manifest.json.",
        "dlrm-vrgd preprocess --input data/criteo_10k.txt --out data/criteo_small "
        "--max-rows-per-table 10000 --split 0.8,0.1,0.1",
    )


def cmd_preprocess(args: argparse.Namespace) -> int:
    from dlrm_vrgd.data.criteo.preprocess import parse_split, preprocess, summary_lines

    split = parse_split(args.split) if args.split is not None else None
    result = preprocess(
        args.input,
        args.out,
        fmt=args.format,
        max_rows_per_table=args.max_rows_per_table,
        frequency_threshold=args.frequency_threshold,
        skip_bad_rows=args.skip_bad_rows,
        rows_per_day=args.rows_per_day,
        split=split,
        labels=args.labels,
        dense_floor=args.dense_floor,
        overwrite=args.overwrite,
        workers=args.workers,
        progress=not args.no_progress,
    )
    print("\n".join(summary_lines(result)))
    return 0
