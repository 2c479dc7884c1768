"""``dlrm-vrgd tensorboard``: a run's (or every run of a study's) tb/ event files rebuilt from
its jsonl records."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_tensorboard(sub: argparse._SubParsersAction) -> None:
    tb = sub.add_parser(
        "tensorboard", help="rebuild tb/ event files from a run's (or study's) jsonl records"
    )
    tb.add_argument("dir", metavar="RUN_OR_STUDY_DIR", help="a run directory or a study directory")
    tb.set_defaults(fn=cmd_tensorboard)


def cmd_tensorboard(args: argparse.Namespace) -> int:
    from dlrm_vrgd.tracking.tensorboard_sink import rebuild, run_dirs

    runs = run_dirs(Path(args.dir))
    for i, run_dir in enumerate(runs, 1):
        path = rebuild(run_dir)
        print(f"[{i}/{len(runs)}] {path.relative_to(Path(args.dir).parent)}", flush=True)
    print(f"tensorboard --logdir {args.dir}")
    return 0
