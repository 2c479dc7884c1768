"""Running a job end to end: :func:`train` drives a :class:`~dlrm_vrgd.train.loop.Trainer`
step after step and keeps the run directory (:mod:`dlrm_vrgd.rundir`) up to date.

Around the steps it decides what :class:`~dlrm_vrgd.train.loop.Trainer` does not: where a run
resumes (:mod:`dlrm_vrgd.train.resume`), when to evaluate (every ``run.eval_every`` steps or
``run.evals_per_epoch`` times an epoch), checkpoint, stop early or at ``run.target_auc``, what to
do on Ctrl-C or SIGTERM (checkpoint the step every rank stopped after), and what a finished run
leaves behind (final evals, the last and best checkpoints, ``result.json``, ``status.json`` when
it did not finish). :class:`Callback` is the live view of it (the CLI's progress line, the
service).
"""

from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlrm_vrgd import checkpoint as ckpt
from dlrm_vrgd import rundir
from dlrm_vrgd.advice import advise
from dlrm_vrgd.config import TrainConfig
from dlrm_vrgd.data import build_splits
from dlrm_vrgd.tracking import Sinks, run_sinks
from dlrm_vrgd.tracking.sink import stamped
from dlrm_vrgd.train import stop
from dlrm_vrgd.train.distributed import DistEnv, barrier, rank0_decides
from dlrm_vrgd.train.loop import NonFiniteError, Trainer
from dlrm_vrgd.train.resume import check_resume, finished_run, load_checkpoint, resume_hint

logger = logging.getLogger(__name__)


class RunInterrupted(KeyboardInterrupt):
    """The run was stopped by SIGINT (Ctrl-C); the message says where and how to resume."""


class Callback:
    """Hooks for live progress (CLI line, service); every method is optional."""

    def on_start(self, info: dict[str, Any]) -> None: ...

    def on_step(self, record: dict[str, Any]) -> None: ...

    def on_eval(self, record: dict[str, Any]) -> None: ...

    def on_end(self, result: RunResult) -> None: ...


@dataclass
class RunResult:
    steps: int
    samples: int
    losses: list[float]
    val: dict[str, float]
    test: dict[str, float]
    best_val: dict[str, Any] | None
    train_seconds: float
    eval_seconds: float
    out_dir: Path | None = None
    train: dict[str, Any] | None = None  # the final eval of training rows, when asked for
    #: True when ``train(resume=True)`` found the run already finished and did nothing: the
    #: figures are those of its result.json, which was left as it was.
    already_finished: bool = False
    #: ``{"step", "best_step", "best_val_auc", "patience"}`` when ``run.early_stop_patience``
    #: ended the run before its last step.
    stopped_early: dict[str, Any] | None = None
    #: Of ``train_seconds``, the time the steps waited for their micro-batches (the sum of the
    #: records' ``data_wait_s``).
    input_wait_seconds: float = 0.0
    #: The share of their time the steps after the first (which also starts the input) waited
    #: for input; None with fewer than two steps.
    input_wait_share: float | None = None
    #: With ``run.target_auc``: whether it was reached and the step, rows, epochs and seconds
    #: it took (:func:`_target_record`); None without a target.
    target: dict[str, Any] | None = None
    #: Wall clock from the first step of this process to the end of the final evals.
    wall_seconds: float = 0.0

    @property
    def rows_per_second(self) -> float:
        return self.samples / self.train_seconds if self.train_seconds > 0 else float("nan")


def stored_result(result: dict[str, Any], out: Path) -> RunResult:
    timings = result.get("timings") or {}
    loss = result.get("final_loss")
    return RunResult(
        steps=result["steps"],
        samples=int(result.get("samples") or 0),
        losses=[loss] if loss is not None else [],
        val=result.get("val") or {},
        test=result.get("test") or {},
        best_val=result.get("best_val"),
        train_seconds=float(timings.get("train_seconds") or 0.0),
        eval_seconds=float(timings.get("eval_seconds") or 0.0),
        out_dir=out,
        train=result.get("train"),
        already_finished=True,
        stopped_early=result.get("stopped_early"),
        target=result.get("target"),
        wall_seconds=float(timings.get("wall_seconds") or 0.0),
    )


def _checkpoint_at_interrupt(trainer: Trainer, out: Path) -> None:
    """Checkpoint the step a run stopped after (Ctrl-C, SIGTERM), so that nothing trained is
    lost. Safe only between steps: every rank stops after the same step (the stop is agreed on
    at each step's end) and a step interrupted midway is never saved. A save that fails (a
    full disk, weights not finite) is said and the older checkpoints stay."""
    try:
        trainer.save_checkpoint(out)
        logger.info("checkpointed step %d at the interrupt", trainer.step)
    except (OSError, ckpt.CheckpointError, NonFiniteError) as err:
        logger.warning("could not checkpoint step %d at the interrupt: %s", trainer.step, err)


def train(
    cfg: TrainConfig,
    out_dir: str | Path | None = None,
    callbacks: list[Callback] | tuple[Callback, ...] = (),
    resume: bool = False,
    env: DistEnv | None = None,
    export_to: str | Path | None = None,
    final_checkpoints: bool = True,
) -> RunResult:
    """Run the job described by ``cfg``; write the run directory when ``out_dir`` is given.

    With ``resume``, continue from the newest checkpoint in ``out_dir`` (records written after
    that checkpoint by the interrupted run are dropped), else ``out_dir`` must not hold a run.
    A run that already finished all its steps is not touched: resuming it returns its stored
    result (``already_finished``) and writes nothing.
    Under torchrun, every rank calls this with its ``env``; rank 0 writes the run directory and
    runs the callbacks, all ranks write their checkpoint shards. With ``export_to``, the last
    step is checkpointed (whatever ``run.checkpoint_every``) and exported there as a model
    directory (:mod:`dlrm_vrgd.serve.export`) before ``result.json`` is written.

    With ``final_checkpoints`` (the default) and ``out_dir``, a finished run always leaves the
    checkpoint of its last step and, with periodic evals and ``run.keep_best_checkpoint``, the
    one of its best validation AUC (checkpointed when it is found), whatever
    ``run.checkpoint_every``: ``dlrm-vrgd export --run`` (``--best``) works on any finished
    run. A study's cells pass False: their figures are in the study's ledger.
    """
    env = env or DistEnv()
    out = Path(out_dir) if out_dir is not None else None
    skipped: list[tuple[Path, str]] = []
    latest = check_resume(out, cfg, resume, skipped) if out is not None else None
    splits = build_splits(cfg.data)
    if resume and out is not None:
        done = finished_run(out, cfg.total_steps(splits.train.num_rows))
        if done is not None:
            logger.info("%s finished all %d steps before: nothing to resume", out, done["steps"])
            return stored_result(done, out)
    # everything that can fail on bad input fails before writes
    trainer = Trainer(cfg, splits, env=env)
    main = env.is_main
    if latest is not None:
        load_checkpoint(trainer, latest)
        logger.info("rank %d resumed from %s", env.rank, latest)
    writing = out is not None and main
    if writing:
        assert out is not None
        out.mkdir(parents=True, exist_ok=True)
        for path in ckpt.remove_stale_staging(out):
            logger.warning("removed %s, a checkpoint an earlier attempt did not finish", path.name)
        for name in (rundir.METRICS, rundir.GSNR):
            rundir.truncate_jsonl_after(out / name, trainer.step)
        if trainer.step >= trainer.total_steps:  # the final evals start again: drop earlier ones
            rundir.drop_evals_at(out / rundir.METRICS, trainer.step)
        (out / rundir.RESULT).unlink(missing_ok=True)
        (out / rundir.STATUS).unlink(missing_ok=True)
        rundir.atomic_write_json(out / rundir.CONFIG, cfg.to_dict())
    barrier(env)
    # rank 0's records go to the run directory and the trackers (tracking/): one sink
    sink = run_sinks(cfg, out, latest is not None) if writing and out is not None else None
    callbacks = callbacks if main else ()
    run = cfg.run
    # steps between periodic evals: run.eval_every, or the epoch's steps / run.evals_per_epoch
    every = run.eval_interval(trainer.splits.train.num_rows)
    info = {
        "total_steps": trainer.total_steps,
        "start_step": trainer.step,
        "global_batch": run.global_batch,
        "micro_batch": run.micro_batch,
        "accumulation": trainer.A,
        "world_size": env.world_size,
        "train_rows": trainer.splits.train.num_rows,
        "eval_every": every,
        "target_auc": run.target_auc,
    }
    if sink:
        sink.start({"kind": "start", "step": trainer.step, **info})
        if skipped:  # say in the run's record why it went back further than its newest
            sink.metrics(
                {
                    "kind": "checkpoint_fallback",
                    "step": trainer.step,
                    "resumed_from": latest.name if latest is not None else None,
                    "skipped": [{"checkpoint": p.name, "reason": r} for p, r in skipped],
                }
            )
    for cb in callbacks:
        cb.on_start(info)

    losses: list[float] = []
    train_s = eval_s = wait_s = 0.0
    steady_s = steady_wait_s = 0.0  # the steps after this process's first
    samples_before = trainer.step * run.global_batch
    periodic = bool(run.checkpoint_every or run.checkpoint_every_s)
    # periodic checkpoints, and (final_checkpoints) each new best validation AUC
    checkpointing = bool(out) and (periodic or final_checkpoints)
    saved_step, saved_at = trainer.step, time.monotonic()
    stopped_early: dict[str, Any] | None = None
    target: dict[str, Any] | None = None  # the target's record once reached
    val_evals = 0  # validation evals checked against the target
    from_step = trainer.step  # this process's first step (after a resume: the checkpoint's)
    started = time.perf_counter()  # MLPerf's time to train counts from here, evals included
    # an interrupt outside a step leaves every tensor at a step's end: it may be checkpointed
    # (with several ranks, only the stop they agreed on: every rank is then past the same step)
    in_step = agreed = False
    try:
        while trainer.step < trainer.total_steps:
            in_step = True
            record = trainer.train_step()
            in_step = False
            train_s += record["step_seconds"]
            wait_s += record["data_wait_s"]
            if losses:  # not this process's first step
                steady_s += record["step_seconds"]
                steady_wait_s += record["data_wait_s"]
            losses.append(record["loss"])
            if sink and (record["step"] % run.log_every == 0 or record["step"] == 1):
                sink.metrics({"kind": "train", **record})
            if out is not None and (record["step"] % run.gsnr_every == 0 or record["step"] == 1):
                gsnr_record = trainer.gsnr_record()  # collective
                if sink:
                    sink.gsnr(gsnr_record)
            for cb in callbacks:
                cb.on_step(record)
            last = trainer.step == trainer.total_steps
            new_best = False
            if every and trainer.step % every == 0 and not last:
                t0 = time.perf_counter()
                ev = _eval_record(trainer, "val", run.eval_rows)
                eval_s += time.perf_counter() - t0
                val_evals += 1
                clock = (from_step, train_s, eval_s, started)
                target = _target_record(trainer, ev, clock, val_evals)
                new_best = trainer.best_val is not None and trainer.best_val["step"] == trainer.step
                if sink:
                    written = stamped(ev)  # its wall_time is its PR curve's too
                    sink.metrics(written)
                    _eval_details(sink, trainer, [written])
                for cb in callbacks:
                    cb.on_eval(ev)
                stopped_early = None if target is not None else _early_stop(trainer, every)
            if checkpointing and _checkpoint_due(trainer, saved_at, new_best):
                assert out is not None
                trainer.save_checkpoint(out)
                saved_step, saved_at = trainer.step, time.monotonic()
            if (sig := trainer.stop_agreed if env.distributed else stop.requested()) is not None:
                agreed = True
                raise KeyboardInterrupt(sig)  # every rank, after this same step
            if target is not None:
                logger.info(
                    "target reached at step %d: validation AUC %.5f >= %g after %.4g epochs",
                    trainer.step,
                    target["val_auc"],
                    target["target_auc"],
                    target["epochs"],
                )
                if sink:
                    sink.metrics({"kind": "target_reached", **target})
                break
            if stopped_early is not None:
                logger.info(
                    "early stop at step %d: no better validation AUC in %d evaluations since "
                    "step %d",
                    trainer.step,
                    run.early_stop_patience,
                    stopped_early["best_step"],
                )
                if sink:
                    sink.metrics({"kind": "early_stop", **stopped_early})
                break

        trainer.close_input()  # its threads or processes are done: none waits through evals
        trainer.check_finite(trainer.step)  # no result from non-finite weights
        t0 = time.perf_counter()
        val = _eval_record(trainer, "val", None)
        at_end = target is None and run.target_auc is not None  # the last eval may reach it
        if at_end:
            val_evals += 1
            done_s = eval_s + time.perf_counter() - t0
            target = _target_record(trainer, val, (from_step, train_s, done_s, started), val_evals)
        test = _eval_record(trainer, "test", None)
        finals = [val, test]
        if run.final_train_eval_rows:
            finals.append(_eval_record(trainer, "train", run.final_train_eval_rows))
        eval_s += time.perf_counter() - t0
        wall_s = time.perf_counter() - started
        written_finals = [stamped(ev) for ev in finals]
        for ev, written in zip(finals, written_finals, strict=True):
            if sink:
                sink.metrics(written)
            for cb in callbacks:
                cb.on_eval(ev)
        if sink:
            _eval_details(sink, trainer, written_finals)
            if at_end and target is not None:  # after the eval that reached it, as above
                sink.metrics({"kind": "target_reached", **target})
        last_due = periodic or final_checkpoints or export_to is not None
        if out and last_due and saved_step != trainer.step:
            trainer.save_checkpoint(out)
    except KeyboardInterrupt as err:
        safe = not in_step and (agreed or not env.distributed)
        if out is not None and safe and saved_step != trainer.step:
            _checkpoint_at_interrupt(trainer, out)
        hint = resume_hint(out) if out is not None else "it wrote no run directory"
        sig = str(err) if str(err).startswith("SIG") else "SIGINT"
        message = f"interrupted ({sig}) at step {trainer.step}; {hint}"
        if writing:  # tell readers (the service) how the run ended
            rundir.atomic_write_json(
                out / rundir.STATUS,  # type: ignore[operator]
                {"state": "interrupted", "step": trainer.step, "message": message},
            )
        if sink:
            sink.close()
        raise RunInterrupted(message) from err
    except BaseException as err:
        if writing:  # tell readers (the service) why the run ended
            rundir.atomic_write_json(
                out / rundir.STATUS,  # type: ignore[operator]
                {"state": "failed", "step": trainer.step, "error": f"{type(err).__name__}: {err}"},
            )
        if sink:
            sink.close()
        raise
    finally:  # Ctrl-C, a NaN stop, an error: no input thread or process outlives the loop
        trainer.close_input()

    result = RunResult(
        steps=trainer.step,
        samples=trainer.step * run.global_batch,
        losses=losses,
        val=_strip(val),
        test=_strip(test),
        best_val=trainer.best_val,
        train_seconds=train_s,
        eval_seconds=eval_s,
        out_dir=out,
        train=_strip(finals[2]) if len(finals) > 2 else None,
        stopped_early=stopped_early,
        input_wait_seconds=wait_s,
        input_wait_share=steady_wait_s / steady_s if steady_s > 0 else None,
        target=target if target is not None else _target_missed(trainer, from_step, val_evals),
        wall_seconds=wall_s,
    )
    if sink:
        assert out is not None
        try:
            if export_to is not None:
                from dlrm_vrgd.serve.export import export_model

                export_model(out, export_to, trainer.step, overwrite=True)
                sink.model(Path(export_to))  # MLflow logs (and registers) it
            written = _write_result(
                out, cfg, result, result.samples - samples_before, env, sink.result_fields()
            )
            sink.finish(written)
        finally:
            sink.close()
    barrier(env)
    for cb in callbacks:
        cb.on_end(result)
    return result


def _write_result(
    out: Path,
    cfg: TrainConfig,
    result: RunResult,
    trained: int,
    env: DistEnv,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Write ``result.json`` (``extra``: the trackers' fields, e.g. the MLflow run id); returns
    it as readers see it (non-finite floats as null)."""
    sparse = cfg.optim.sparse
    rows_per_s = trained / result.train_seconds if result.train_seconds > 0 else None
    rundir.atomic_write_json(
        out / rundir.RESULT,
        {
            "steps": result.steps,
            "samples": result.samples,
            "final_loss": result.losses[-1] if result.losses else None,
            "val": result.val,
            "test": result.test,
            "train": result.train,
            "best_val": result.best_val,
            "stopped_early": result.stopped_early,
            "target": result.target,
            "timings": {
                "train_seconds": result.train_seconds,
                "eval_seconds": result.eval_seconds,
                "input_wait_seconds": result.input_wait_seconds,
                "input_wait_share": result.input_wait_share,
                "rows_per_s": rows_per_s,
                # MLPerf's throughput figure: samples/s per GPU (per process on the CPU)
                "rows_per_s_per_rank": (
                    rows_per_s / env.world_size if rows_per_s is not None else None
                ),
                # from the first step to the end of the final evals (MLPerf counts evals too)
                "wall_seconds": result.wall_seconds,
            },
            "world_size": env.world_size,
            "optimizers": {
                "dense": cfg.optim.dense.name,
                "sparse": sparse.name,
                "sparse_gsnr_estimator": sparse.estimator if sparse.gsnr else None,
                "sparse_gsnr_placement": sparse.gsnr_placement if sparse.gsnr else None,
                "sparse_cowclip": (
                    {
                        "clip_ratio": sparse.clip_ratio,
                        "zeta": sparse.zeta,
                        "weight_decay": sparse.weight_decay,
                    }
                    if sparse.cowclip
                    else None
                ),  # fmt: skip
                "dense_gsnr_placement": (
                    cfg.optim.dense.gsnr_placement
                    if cfg.optim.dense.name in ("vradam", "vrlamb")
                    else None
                ),
            },
            "config": cfg.to_dict(),
            "versions": _versions(),
            # the batch-size advice from gsnr.jsonl's noise scale (dlrm-vrgd advise)
            "noise_scale": advise(out),
            **extra,
        },
    )
    return json.loads((out / rundir.RESULT).read_text())


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("fbgemm-gpu-cpu", "fbgemm-gpu", "torchrec", "dlrm-vrgd"):
        try:
            out[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    return out


def _checkpoint_due(trainer: Trainer, saved_at: float, new_best: bool) -> bool:
    """Whether this step is checkpointed: every ``checkpoint_every`` steps, when
    ``checkpoint_every_s`` passed since the last one (rank 0's clock decides for all), and at a
    new best validation AUC (``keep_best_checkpoint``)."""
    run = trainer.cfg.run
    if run.checkpoint_every and trainer.step % run.checkpoint_every == 0:
        return True
    if new_best and run.keep_best_checkpoint:
        return True
    if run.checkpoint_every_s:
        late = time.monotonic() - saved_at >= run.checkpoint_every_s
        return rank0_decides(late, trainer.env)
    return False


def _early_stop(trainer: Trainer, every: int) -> dict[str, Any] | None:
    """The early-stop record when ``run.early_stop_patience`` periodic evaluations (``every``
    steps apart) in a row found no better validation AUC than the best (counted from the
    best's step, so a resumed run counts the same), else None."""
    patience = trainer.cfg.run.early_stop_patience
    best = trainer.best_val
    if patience is None or best is None or trainer.step - best["step"] < patience * every:
        return None
    return {
        "step": trainer.step,
        "best_step": best["step"],
        "best_val_auc": best["auc"],
        "patience": patience,
    }


def _target_record(
    trainer: Trainer,
    ev: dict[str, Any],
    clock: tuple[int, float, float, float],
    evals: int,
) -> dict[str, Any] | None:
    """The record of ``run.target_auc`` reached by the validation eval ``ev`` (None: no target,
    or ``ev``'s AUC is below it or not a number). Its figures are MLPerf's: the rows and
    epochs trained up to the eval; ``train_seconds``, the steps' time; ``eval_seconds``, the
    evals' time, this one included; ``wall_seconds``, the wall clock from this process's
    first step to the end of this eval (MLPerf's time to train: evals included, start-up not).
    The seconds are this process's (``clock``: its first step, its steps' and evals' seconds
    so far, its ``perf_counter`` at the first step): a resumed run counts from ``from_step``;
    ``evals``: the validation evals checked, this one included."""
    from_step, train_s, eval_s, started = clock
    target = trainer.cfg.run.target_auc
    auc = ev.get("auc")
    if target is None or not isinstance(auc, float) or not auc >= target:
        return None
    return {
        "target_auc": target,
        "reached": True,
        "step": trainer.step,
        "samples": ev["samples"],
        "epochs": round(trainer.stream.epoch(trainer.step), 6),
        "val_auc": auc,
        "evals": evals,
        "train_seconds": train_s,
        "eval_seconds": eval_s,
        "wall_seconds": time.perf_counter() - started,
        "from_step": from_step,
    }


def _target_missed(trainer: Trainer, from_step: int, evals: int) -> dict[str, Any] | None:
    """The ``target`` of result.json when ``run.target_auc`` was never reached (None: no
    target)."""
    target = trainer.cfg.run.target_auc
    if target is None:
        return None
    empty = ("step", "samples", "epochs", "val_auc", "train_seconds", "eval_seconds")
    return {
        "target_auc": target,
        "reached": False,
        **dict.fromkeys(empty),
        "evals": evals,
        "wall_seconds": None,
        "from_step": from_step,
    }


def _eval_record(trainer: Trainer, split: str, limit: int | None) -> dict[str, Any]:
    source = {
        "train": trainer.splits.train,
        "val": trainer.splits.val,
        "test": trainer.splits.test,
    }[split]
    keep: dict[str, Any] = {}
    m = trainer.evaluate(source, limit, keep)
    trainer.last_predictions[split] = keep
    record = {
        "kind": "eval",
        "split": split,
        "step": trainer.step,
        "samples": trainer.step * trainer.cfg.run.global_batch,
        **m,
    }
    if split == "val" and (trainer.best_val is None or m["auc"] > trainer.best_val["auc"]):
        trainer.best_val = {"step": trainer.step, "auc": m["auc"], "logloss": m["logloss"]}
    return record


def _eval_details(sink: Sinks, trainer: Trainer, evals: list[dict[str, Any]]) -> None:
    """At an eval step, for TensorBoard: the PR curve of each eval (its predictions, kept by
    :func:`_eval_record`) and the weight histograms (once per step). Live only: a rebuilt
    ``tb/`` has no histograms or PR curves (the run directory does not keep predictions)."""
    if not trainer.cfg.run.tensorboard:
        return
    for ev in evals:
        kept = trainer.last_predictions.pop(ev["split"], {})
        if "probs" in kept:
            sink.pr_curve(ev, kept["labels"], kept["probs"])
    sink.histograms(trainer.step, trainer.weight_arrays())


def _strip(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("kind", "split")}
