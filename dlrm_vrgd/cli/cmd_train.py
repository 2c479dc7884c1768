"""``dlrm-vrgd train``: one process, or torchrun's ranks (the launcher here re-runs this
command as ``python -m dlrm_vrgd.cli train ...`` on every rank)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from dlrm_vrgd.cli.common import ProgressLine, add_config, examples, print_result
from dlrm_vrgd.config import TrainConfig, load_config


def add_train(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train a model; writes a run directory")
    add_config(t)
    t.add_argument("--out", required=True, help="run directory")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    t.add_argument(
        "--export-model", metavar="DIR", help="at the end, export the model there (see export)"
    )
    t.set_defaults(fn=cmd_train)
    examples(
        t,
        "Train a model from a YAML config; writes a run directory (metrics.jsonl, gsnr.jsonl, "
        "checkpoints of the last and the best step, result.json).",
        "dlrm-vrgd train --config configs/demo.yaml --out runs/demo",
        "dlrm-vrgd train --config configs/demo.yaml --set run.steps=50 --out runs/short",
        "dlrm-vrgd train --config configs/demo.yaml --out runs/demo --resume",
    )


def cmd_train(args: argparse.Namespace) -> int:
    from dlrm_vrgd.resources import check_fits
    from dlrm_vrgd.train import distributed

    cfg = load_config(args.config, args.set)
    distributed.check_sharding(cfg)  # row_wise alone on the CPU: refused before the plan
    # a job too big for this host (or a rank too big for its memory) is refused before anything
    # starts; with several ranks or a GPU the launcher prints every rank's memory
    plan = check_fits(cfg)
    if plan is not None and not distributed.under_torchrun():
        if cfg.run.world_size > 1 or cfg.run.device == "cuda":
            print("\n".join(plan.lines()), file=sys.stderr, flush=True)
    if cfg.run.world_size > 1 and not distributed.under_torchrun():
        return _launch_torchrun(cfg, args)
    if distributed.under_torchrun():
        return _train_rank(cfg, args)
    from dlrm_vrgd.train import stop
    from dlrm_vrgd.train.run import train

    # Ctrl-C / SIGTERM: stop after this step and checkpoint it (a second one: at once)
    stop.install(cooperative=True)
    progress = ProgressLine()
    try:
        result = train(
            cfg, args.out, callbacks=[progress], resume=args.resume, export_to=args.export_model
        )
    finally:
        progress.on_end(None)  # an error message starts on a line of its own
    print_result(result)
    return 0


def _launch_torchrun(cfg: TrainConfig, args: argparse.Namespace) -> int:
    """Check what can be checked once, then run torchrun (every rank) and wait for it
    (:mod:`dlrm_vrgd.train.stop`: Ctrl-C and SIGTERM reach the ranks, which stop together)."""
    from dlrm_vrgd.data import build_splits
    from dlrm_vrgd.data.batch import TrainStream
    from dlrm_vrgd.train import distributed, stop
    from dlrm_vrgd.train.resume import check_resume, finished_run
    from dlrm_vrgd.train.run import stored_result

    check_resume(Path(args.out), cfg, args.resume)
    rows = build_splits(cfg.data).train
    TrainStream(rows, cfg.run.global_batch, cfg.run.micro_batch, 0)
    done = finished_run(Path(args.out), cfg.total_steps(rows.num_rows))
    if args.resume and done is not None:  # nothing to do: no ranks to start
        print_result(stored_result(done, Path(args.out)))
        return 0
    argv = ["train", "--config", str(Path(args.config).resolve()), "--out", str(args.out)]
    argv += [a for item in args.set for a in ("--set", item)]
    argv += ["--resume"] if args.resume else []
    argv += ["--export-model", str(args.export_model)] if args.export_model else []
    cmd = distributed.torchrun_command(cfg, argv)
    # the cores are shared by the ranks of this node (torchrun would otherwise pick 1 and say so)
    threads = cfg.run.threads or max(1, (os.cpu_count() or 1) // cfg.run.nproc_per_node)
    marker = secrets.token_hex(8)
    env = {"OMP_NUM_THREADS": str(threads), **os.environ, stop.LAUNCH_ENV: marker}
    print(f"launching {cfg.run.world_size} ranks: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    code = stop.launch_and_forward(cmd, env, marker)
    status = _read_status(Path(args.out))
    if status.get("state") == "interrupted":
        return 130  # rank 0 said where it stopped and how to resume
    return code if code >= 0 else 128 - code


def _read_status(out: Path) -> dict[str, Any]:
    """The run's status.json (written when a run did not finish), or {}."""
    try:
        status = json.loads((out / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def _train_rank(cfg: TrainConfig, args: argparse.Namespace) -> int:
    """One rank under torchrun; rank 0 shows progress and the result."""
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    from dlrm_vrgd.train import distributed, stop
    from dlrm_vrgd.train.run import RunInterrupted, train

    distributed.die_with_parent()  # a SIGKILLed launcher (torchrun) takes its ranks with it
    stop.install(cooperative=True)  # SIGINT / SIGTERM: every rank stops after the same step

    @record
    def run() -> int:
        env = distributed.init_from_env(cfg)
        try:
            callbacks = [ProgressLine()] if env.is_main else []
            result = train(
                cfg, args.out, callbacks=callbacks, resume=args.resume, env=env,
                export_to=args.export_model,
            )  # fmt: skip
            if env.is_main:
                print_result(result)
        except RunInterrupted as err:
            # one message (rank 0's) and a clean exit, so torchrun reports no failure; the
            # launcher exits 130 from status.json
            if env.is_main:
                for cb in callbacks:
                    cb.on_end(None)
                print(f"\n{err}", file=sys.stderr, flush=True)
            return 0
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return 0

    return run()
