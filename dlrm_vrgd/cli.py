"""``dlrm-vrgd``: train, generate synthetic data, run the demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
from pathlib import Path
from typing import Any

from dlrm_vrgd.config import ConfigError, TrainConfig, load_config

REPO = Path(__file__).resolve().parent.parent


class ProgressLine:
    """A live progress bar for the terminal: step, loss, last AUC (and oracle), rows/s, and the
    share of the step spent waiting for input (``input wait 12%``: the GPU starving) where the
    step waited at least 0.5% of its time.

    Not on a terminal (a log file: the service's jobs, Slurm's output), it writes a plain line
    at most every ``PROGRESS_EVERY_S`` seconds (``DLRM_VRGD_PROGRESS_EVERY_S``, default 10)
    instead of carriage-return redraws, so that every line of a log is whole (and keeps its
    rank label under ``srun --label``)."""

    def __init__(self, stream: Any = None) -> None:
        import os

        self.stream = stream or sys.stderr
        self.bar: Any = None
        self.last_auc: str = "-"
        isatty = getattr(self.stream, "isatty", None)
        self.plain = not (isatty and isatty())
        self.every_s = float(os.environ.get("DLRM_VRGD_PROGRESS_EVERY_S", "10"))
        self._printed = -float("inf")
        self._total = 0

    def on_start(self, info: dict[str, Any]) -> None:
        self._total = info["total_steps"]
        if self.plain:
            return
        from tqdm import tqdm

        self.bar = tqdm(
            total=info["total_steps"],
            initial=info["start_step"],
            unit="step",
            file=self.stream,
            dynamic_ncols=True,
            desc=f"G={info['global_batch']} ({info['accumulation']}x{info['micro_batch']})",
        )

    def on_step(self, record: dict[str, Any]) -> None:
        if self.plain:
            import time

            now = time.monotonic()
            if now - self._printed >= self.every_s or record["step"] == self._total:
                self._printed = now
                self._line(
                    f"step {record['step']}/{self._total} loss {record['loss']:.4f} "
                    f"auc {self.last_auc} {record['rows_per_s'] / 1000:.1f}k rows/s"
                    + input_wait(record)
                )
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(
                f"loss {record['loss']:.4f} auc {self.last_auc} "
                f"{record['rows_per_s'] / 1000:.1f}k rows/s" + input_wait(record),
                refresh=False,
            )

    def on_eval(self, record: dict[str, Any]) -> None:
        oracle = record.get("oracle_auc")
        self.last_auc = f"{record['auc']:.4f}" + (f"/{oracle:.4f}" if oracle else "")
        if self.plain:
            self._line(f"{record['split']} auc {self.last_auc}")
        elif self.bar is not None:
            self.bar.set_postfix_str(f"{record['split']} auc {self.last_auc}")

    def on_end(self, result: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _line(self, text: str) -> None:
        """One whole line in one write (unbuffered, as in a job, ``print`` writes the text and
        its newline apart, and another writer's bytes may land between them)."""
        self.stream.write(text + "\n")
        self.stream.flush()


def input_wait(record: dict[str, Any]) -> str:
    """`` input wait 12%``: the share of a step spent waiting for its micro-batches (``""``
    below 0.5%, or when the record does not say)."""
    wait, step = record.get("data_wait_s"), record.get("step_seconds")
    if not isinstance(wait, int | float) or not isinstance(step, int | float) or step <= 0:
        return ""
    share = wait / step
    return f" input wait {share:.0%}" if share >= 0.005 else ""


def _print_result(result: Any) -> None:
    val, test = result.val, result.test
    if result.already_finished:
        print(
            f"{result.out_dir} finished all {result.steps} steps before ({result.samples:,} "
            "rows): nothing to resume, its result.json is unchanged"
        )
    else:
        print(
            f"trained {result.steps} steps, {result.samples:,} rows at "
            f"{result.rows_per_second:,.0f} rows/s"
        )
    for name, m in (("val", val), ("test", test)):
        line = f"  {name:4s} AUC {m['auc']:.4f}  logloss {m['logloss']:.4f}  NE {m['ne']:.4f}"
        if "oracle_auc" in m:
            gap = m["oracle_auc"] - m["auc"]
            line += f"   oracle AUC {m['oracle_auc']:.4f} (gap {gap:+.4f})"
        print(line)
    if result.out_dir is not None:
        print(f"run directory: {result.out_dir}")
    for warning in result_warnings(result):
        print(f"warning: {warning}", file=sys.stderr)


#: A run whose steps waited this share of their time or more for input is told so at its end.
INPUT_WAIT_WARN = 0.10


def result_warnings(result: Any) -> list[str]:
    """What a user should not miss in a run's final figures: a final model worse than the best
    checkpoint's (overfitting, a learning rate too high), an NE above 1 (worse than predicting
    the click rate for every row), steps that waited for their input (a starved device)."""
    out = []
    share = result.input_wait_share
    if share is not None and share >= INPUT_WAIT_WARN:
        out.append(
            f"the steps waited for their input {share:.0%} of their time (after the first "
            "step): the input, not the model, set the pace. Day files made once "
            "(dlrm-vrgd generate or preprocess) read far faster than live synthetic rows, and "
            "run.input.workers adds builders (docs: Feeding the trainer)"
        )
    best, val = result.best_val, result.val
    if best is not None and val.get("auc") is not None and val["auc"] < best["auc"]:
        line = (
            f"the final model's validation AUC {val['auc']:.4f} is below the best checkpoint's "
            f"{best['auc']:.4f} (step {best['step']}), as the periodic evals measured it (on "
            "run.eval_rows rows of validation)"
        )
        if result.out_dir is not None:
            line += f": export that one with dlrm-vrgd export --run {result.out_dir} --best"
        out.append(line)
    for name, m in (("val", val), ("test", result.test)):
        ne = m.get("ne")
        if isinstance(ne, float) and ne > 1:
            out.append(
                f"{name} NE {ne:.4f} > 1: the model predicts {name} clicks worse than the click "
                "rate alone would (too few rows for this model, overfitting, or a learning "
                "rate too high)"
            )
    return out


def cmd_train(args: argparse.Namespace) -> int:
    from dlrm_vrgd.resources import check_fits
    from dlrm_vrgd.train import distributed

    cfg = load_config(args.config, args.set)
    check_fits(cfg)  # a job too big for this host is refused before anything starts
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
    _print_result(result)
    return 0


def _launch_torchrun(cfg: TrainConfig, args: argparse.Namespace) -> int:
    """Check what can be checked once, then run torchrun (every rank) and wait for it
    (:mod:`dlrm_vrgd.train.stop`: Ctrl-C and SIGTERM reach the ranks, which stop together)."""
    import os
    import secrets

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
        _print_result(stored_result(done, Path(args.out)))
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
    import json

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
                _print_result(result)
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


#: Commands that live in the control service, as ``"module:function"``. The trainer package
#: never imports the service (tests/test_layering.py): each is imported by name only when run,
#: so ``dlrm-vrgd train`` works where the service is not installed.
SERVICE_COMMANDS = {
    "demo": "service.demo:run_demo",
    "serve": "service.cli:serve_main",
    "jobs": "service.jobs_cli:main",
}


def run_service_command(command: str, *args: Any, **kwargs: Any) -> int:
    """Import the function registered for ``command`` (:data:`SERVICE_COMMANDS`) and call it."""
    import importlib

    module, _, name = SERVICE_COMMANDS[command].partition(":")
    return getattr(importlib.import_module(module), name)(*args, **kwargs)


def cmd_demo(args: argparse.Namespace) -> int:
    """The demo job through the control service (see service/demo.py)."""
    return run_service_command(
        "demo",
        REPO / "configs" / "demo.yaml",
        args.set,
        Path(args.data_dir or REPO / "runs" / "service"),
        keep_serving=args.keep_serving,
        vr=not args.no_vr,
        port=args.port,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """The control service under uvicorn (see service/cli.py)."""
    return run_service_command(
        "serve", args.host, args.port, args.data_dir, args.max_jobs, args.job_timeout
    )


def cmd_jobs(args: argparse.Namespace) -> int:
    """Jobs of a running service (service/jobs_cli/)."""
    return run_service_command("jobs", args.jobs_args)


def cmd_study_report(args: argparse.Namespace) -> int:
    """Rewrite a study's reports from its finished cells with today's report code."""
    from dlrm_vrgd.study import rewrite_report

    if args.dir is None:
        print("error: study report: the study directory is required", file=sys.stderr)
        return 2
    results = rewrite_report(Path(args.dir))
    print(
        f"rewrote {args.dir}/results.json, results.csv, results.md and *.png "
        f"({results['cells_finished']}/{results['cells_total']} cells)"
    )
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    from dlrm_vrgd.resources import check_study_fits
    from dlrm_vrgd.study import load_study, run_study

    if args.action == "report":
        return cmd_study_report(args)
    if args.action is not None or args.dir is not None:
        print(f"error: unknown study action {args.action!r} (only: report DIR)", file=sys.stderr)
        return 2
    if args.config is None:
        print("error: study: --config is required (or: study report DIR)", file=sys.stderr)
        return 2
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
        import time

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


def cmd_generate(args: argparse.Namespace) -> int:
    from dlrm_vrgd.data import export

    cfg = load_config(args.config, args.set)
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
    )
    print("\n".join(export.summary_lines(result)))
    return 0


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


def cmd_export(args: argparse.Namespace) -> int:
    from dlrm_vrgd.serve.export import export_model

    step = args.step
    if args.best:
        from dlrm_vrgd.checkpoint import BEST, CheckpointError, best_checkpoint

        if step is not None:
            print("error: --best and --step name two checkpoints: pass one", file=sys.stderr)
            return 2
        try:
            step = int(best_checkpoint(Path(args.run)).name.removeprefix("step_"))
        except CheckpointError as err:
            print(f"error: --best: {err}", file=sys.stderr)
            return 2
        print(f"the best-validation checkpoint (checkpoints/{BEST}): step {step}")
    target = None
    if args.mlflow or args.register_model:  # checked before anything is written
        target = _mlflow_target(Path(args.run))
        if target is None:
            return 2
    if args.no_program and args.format != "pt2":
        print("error: --no-program writes no program: it takes no --format", file=sys.stderr)
        return 2
    program = not args.no_program and args.format in ("pt2", "all")
    result = export_model(
        args.run, args.out, step, program=program, overwrite=args.overwrite,
        onnx=args.format in ("onnx", "all"),
    )  # fmt: skip
    written = [p for p in Path(result.out).rglob("*") if p.is_file()]  # the manifest too
    size = sum(p.stat().st_size for p in written)
    print(
        f"exported step {result.step} ({result.world_size} rank(s)) of {args.run} -> "
        f"{result.out} ({len(written)} files, {size / 1e6:,.1f} MB)"
    )
    if target is not None:
        return _export_to_mlflow(*target, result.out, args.register_model)
    return 0


def _mlflow_target(run: Path) -> tuple[Any, str] | None:
    """The run's own MLflow run for ``export --mlflow``: its ``config.json``'s ``run.mlflow``
    and ``result.json``'s ``mlflow.run_id`` (None, said on stderr, when it has none)."""
    from pydantic import ValidationError

    from dlrm_vrgd.config import MlflowConfig

    try:
        stored = json.loads((run / "result.json").read_text())
        run_id = stored["mlflow"]["run_id"]
        cfg = MlflowConfig.model_validate(
            json.loads((run / "config.json").read_text())["run"]["mlflow"]
        )
    except (OSError, ValueError, KeyError, TypeError, ValidationError) as err:
        print(
            f"error: --mlflow: {run} has no MLflow run to log to (result.json's mlflow.run_id "
            f"and config.json's run.mlflow; train it with run.mlflow set): {type(err).__name__}",
            file=sys.stderr,
        )
        return None
    if not isinstance(run_id, str):
        print(f"error: --mlflow: {run}/result.json: mlflow.run_id is not a string", file=sys.stderr)
        return None
    return cfg, run_id


def _export_to_mlflow(cfg: Any, run_id: str, model_dir: Path, name: str | None) -> int:
    """``export --mlflow``: the model directory into the run's MLflow run, registered as
    ``name`` (else ``run.mlflow.register_model``)."""
    from dlrm_vrgd.redact import redact
    from dlrm_vrgd.tracking.mlflow_sink import _client, log_model

    try:
        fields = log_model(_client(cfg), run_id, model_dir, name or cfg.register_model)
    except Exception as err:
        print(f"error: MLflow at {redact(cfg.tracking_uri)}: {type(err).__name__}: "
              f"{redact(str(err))}", file=sys.stderr)  # fmt: skip
        return 1
    line = f"MLflow run {run_id}: logged {fields['model_uri']}"
    if "registered_model" in fields:
        reg = fields["registered_model"]
        line += f", registered as {reg['name']!r} version {reg['version']}"
    print(line)
    return 1 if "registry_error" in fields else 0


def cmd_score(args: argparse.Namespace) -> int:
    import time

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


def cmd_tensorboard(args: argparse.Namespace) -> int:
    from dlrm_vrgd.tracking.tensorboard_sink import rebuild, run_dirs

    runs = run_dirs(Path(args.dir))
    for i, run_dir in enumerate(runs, 1):
        path = rebuild(run_dir)
        print(f"[{i}/{len(runs)}] {path.relative_to(Path(args.dir).parent)}", flush=True)
    print(f"tensorboard --logdir {args.dir}")
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from dlrm_vrgd.advice import advise

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"error: {run_dir} is not a directory", file=sys.stderr)
        return 2
    advice = advise(run_dir, args.last)
    # the text is the advice's own (the API and the dashboard show the same words)
    print(json.dumps(advice, indent=2) if args.json else advice["text"])
    return 0


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


def cmd_show_config(args: argparse.Namespace) -> int:
    import yaml

    cfg: TrainConfig = load_config(args.config, args.set)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


#: The ``--set`` help of the commands that read a TrainConfig.
SET_HELP = (
    "override a config value, e.g. --set run.steps=100 or --set optim.dense.lr=0.1 "
    "(repeatable; the value is YAML: null, [64, 16]; run.steps replaces the file's "
    "run.epochs and the other way round)"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlrm-vrgd", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser, required: bool = True) -> None:
        sp.add_argument("--config", required=required, help="YAML TrainConfig")
        sp.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=SET_HELP,
        )

    t = sub.add_parser("train", help="train a model; writes a run directory")
    with_config(t)
    t.add_argument("--out", required=True, help="run directory")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    t.add_argument(
        "--export-model", metavar="DIR", help="at the end, export the model there (see export)"
    )
    t.set_defaults(fn=cmd_train)

    d = sub.add_parser(
        "demo", help="train configs/demo.yaml through the service; AUC beside the oracle"
    )
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    d.add_argument("--data-dir", help="service data directory (default runs/service)")
    d.add_argument("--port", type=int, help="service port (default: a free one)")
    d.add_argument("--keep-serving", action="store_true", help="keep the service running after")
    d.add_argument("--no-vr", action="store_true", help="keep the config's base optimizers")
    d.set_defaults(fn=cmd_demo)

    s = sub.add_parser("serve", help="run the control service (REST API, see README)")
    s.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default 8000)")
    s.add_argument("--data-dir", help="store and job files (default ~/.local/share/dlrm-vrgd)")
    s.add_argument("--max-jobs", type=int, help="jobs running at once (default 1)")
    s.add_argument("--job-timeout", type=float, help="default per-job timeout in seconds")
    s.set_defaults(fn=cmd_serve)

    j = sub.add_parser(
        "jobs",
        help="submit, list, follow, cancel jobs of a running service (dlrm-vrgd jobs -h)",
        add_help=False,
    )
    j.add_argument("jobs_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    j.set_defaults(fn=cmd_jobs)

    g = sub.add_parser(
        "generate",
        help="write the synthetic data as Criteo day files (data.source: criteo reads them)",
    )
    with_config(g)
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
        "--split",
        action="append",
        choices=["train", "val", "test"],
        help="instead: write this split as torchrec's {split}_*.npy (repeatable)",
    )
    g.set_defaults(fn=cmd_generate)

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

    ex = sub.add_parser("export", help="a run's checkpoint -> a model directory (plain PyTorch)")
    ex.add_argument("--run", required=True, help="run directory (its checkpoints/)")
    ex.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    ex.add_argument(
        "--best", action="store_true", help="the best-validation checkpoint (checkpoints/best.json)"
    )
    ex.add_argument("--out", required=True, help="model directory (appears when complete)")
    ex.add_argument("--overwrite", action="store_true", help="replace an earlier --out")
    ex.add_argument("--no-program", action="store_true", help="skip the torch.export model.pt2")
    ex.add_argument(
        "--format",
        choices=["pt2", "onnx", "all"],
        default="pt2",
        help="programs beside the weights: torch.export .pt2 (default), ONNX + a Triton "
        "model repository, or both",
    )
    ex.add_argument(
        "--mlflow",
        action="store_true",
        help="also log the model to the run's MLflow run (trained with run.mlflow)",
    )
    ex.add_argument(
        "--register-model",
        metavar="NAME",
        help="with --mlflow (implied): register it as NAME (default: run.mlflow.register_model)",
    )
    ex.set_defaults(fn=cmd_export)

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

    st = sub.add_parser("study", help="run a batch-size study (resumable) and write its report")
    st.add_argument(
        "action", nargs="?", choices=["report"], help="report DIR: rewrite DIR's reports"
    )
    st.add_argument("dir", nargs="?", metavar="DIR", help="with report: a study directory")
    st.add_argument("--config", help="YAML StudyConfig (see configs/study_*.yaml)")
    st.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a study config value, e.g. --set base.run.steps=50 (repeatable)",
    )
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

    tb = sub.add_parser(
        "tensorboard", help="rebuild tb/ event files from a run's (or study's) jsonl records"
    )
    tb.add_argument("dir", metavar="RUN_OR_STUDY_DIR", help="a run directory or a study directory")
    tb.set_defaults(fn=cmd_tensorboard)

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

    c = sub.add_parser("config", help="print the resolved config")
    with_config(c, required=False)
    c.set_defaults(fn=cmd_show_config)
    for name, parser in sub.choices.items():
        if name in EXAMPLES:
            parser.description = parser.description or textwrap.fill(EXAMPLES[name][0], 88)
            parser.epilog = "examples:\n" + "\n".join(f"  {e}" for e in EXAMPLES[name][1:])
            parser.formatter_class = argparse.RawDescriptionHelpFormatter
    return p


#: Each subcommand's description and example lines (``dlrm-vrgd CMD -h``).
EXAMPLES: dict[str, tuple[str, ...]] = {
    "train": (
        "Train a model from a YAML config; writes a run directory (metrics.jsonl, gsnr.jsonl, "
        "checkpoints of the last and the best step, result.json).",
        "dlrm-vrgd train --config configs/demo.yaml --out runs/demo",
        "dlrm-vrgd train --config configs/demo.yaml --set run.steps=50 --out runs/short",
        "dlrm-vrgd train --config configs/demo.yaml --out runs/demo --resume",
    ),
    "preprocess": (
        "Raw Criteo logs (Kaggle train.txt / test.txt, 1TB day_N, CSV, gzip) into npy day "
        "files and a manifest.json.",
        "dlrm-vrgd preprocess --input data/criteo_10k.txt --out data/criteo_small "
        "--max-rows-per-table 10000 --split 0.8,0.1,0.1",
    ),
    "generate": (
        "The synthetic data of a config written as Criteo day files (npy), read like real "
        "data (data.source: criteo). `score` reads raw text or preprocessed directories, not "
        "these.",
        "dlrm-vrgd generate --config configs/demo.yaml --out data/demo_days",
    ),
    "export": (
        "A run's checkpoint (the newest, --step N, or --best) as a model directory that "
        "scores without the trainer.",
        "dlrm-vrgd export --run runs/criteo_small --best --out models/criteo_small",
        "dlrm-vrgd export --run runs/demo --out models/demo --format onnx",
    ),
    "score": (
        "Click probabilities of raw Criteo rows (or preprocessed day files) from an exported "
        "model; with labels, also logloss, AUC and NE.",
        "dlrm-vrgd score --model models/criteo_small --input data/criteo_10k.txt "
        "--out predictions.csv",
        "dlrm-vrgd score --model models/criteo_small --input data/criteo_small --split test "
        "--out test.parquet",
    ),
    "config": (
        "The config as the trainer reads it: every default filled in, --set applied.",
        "dlrm-vrgd config --config configs/criteo_small.yaml --set run.steps=30",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["jobs"]:  # its own parser (service/jobs_cli/): every flag is its own
        return cmd_jobs(argparse.Namespace(jobs_args=argv[1:]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # torchrec's import trips torch.fx's "is_fx_tracing" notice: noise for our users; so does
    # the ONNX exporter's "torchvision is not installed" for ops this model never uses.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    try:
        return args.fn(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, a permission, a name too long: the OS said why
        print(f"error: {err}", file=sys.stderr)
        return 1
    except RuntimeError as err:
        from dlrm_vrgd.checkpoint import CheckpointError
        from dlrm_vrgd.train.loop import NonFiniteError

        if not isinstance(err, NonFiniteError | CheckpointError):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        print(f"\n{err}" if str(err) else "\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
