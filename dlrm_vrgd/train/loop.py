"""The training loop: one optimizer step per global batch of ``G = world x A x B`` rows.

For each global step, each rank runs ``A`` micro-batches of ``B`` rows: forward, backward of
the micro-batch's mean loss, then ``collect()`` on both optimizers (the micro-batch is one
gradient *group*); after the last one, ``step()`` on both applies the update of the whole global
batch once. Only one micro-batch is alive at a time, so memory is set by ``B``, not ``G``.

``train(cfg, out_dir, callbacks)`` runs a job end to end and writes the run directory
(:mod:`dlrm_vrgd.train.rundir`); :class:`Trainer` holds the pieces for tests and benchmarks.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dlrm_vrgd.config import TrainConfig
from dlrm_vrgd.data import DataSplits, RowSource, build_splits
from dlrm_vrgd.data.batch import Batch, TrainStream, iter_eval_batches
from dlrm_vrgd.metrics import EvalAccumulator
from dlrm_vrgd.model import ClickModel
from dlrm_vrgd.optim.dense import build_dense_optimizer
from dlrm_vrgd.optim.schedule import batch_scale, lr_factor
from dlrm_vrgd.optim.sparse import SparseRowwiseOptimizer
from dlrm_vrgd.train import checkpoint as ckpt
from dlrm_vrgd.train import rundir

logger = logging.getLogger(__name__)

#: Eval splits up to this many rows are generated/read once and kept in memory.
EVAL_CACHE_ROWS = 250_000

#: Config sections a resumed run may change (how long and how often, not what is trained).
RESUMABLE_CHANGES = {
    "run.gsnr_every",
    "run.steps",
    "run.epochs",
    "run.eval_every",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.log_every",
    "run.eval_rows",
    "run.threads",
}


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
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rows_per_second(self) -> float:
        return self.samples / self.train_seconds if self.train_seconds > 0 else float("nan")


class Trainer:
    """Model, optimizers and data of one process (rank ``rank`` of ``world_size``)."""

    def __init__(
        self,
        cfg: TrainConfig,
        splits: DataSplits | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(cfg.run.device)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.splits = splits if splits is not None else build_splits(cfg.data)
        run = cfg.run
        self.A = run.global_batch // (world_size * run.micro_batch)
        self.stream = TrainStream(
            self.splits.train, run.global_batch, run.micro_batch, seed=run.seed
        )
        self.total_steps = cfg.total_steps(self.splits.train.num_rows)
        torch.manual_seed(run.seed)
        self.model = ClickModel(
            cfg.model,
            self.splits.cardinalities,
            self.splits.num_dense,
            cfg.optim.sparse,
            device=self.device,
        ).to(self.device)
        self.dense_opt = build_dense_optimizer(cfg.optim.dense, self.model.named_dense_parameters())
        sparse = cfg.optim.sparse
        self.sparse_opt = SparseRowwiseOptimizer(
            self.model.embeddings.lookups(),
            lr=sparse.lr,
            gsnr=sparse.gsnr,
            gamma=sparse.gamma,
            estimator=sparse.estimator,
            ema_beta=sparse.ema_beta,
            chunk_rows=sparse.replay_chunk_rows,
        )
        self.step = 0
        self.best_val: dict[str, Any] | None = None
        self._eval_cache: dict[tuple[int, int], list[Batch]] = {}

    # ----------------------------------------------------------------------- train
    def set_learning_rates(self, step: int) -> tuple[float, float]:
        sched = self.cfg.optim.schedule
        factor = batch_scale(self.cfg.run.global_batch, sched) * lr_factor(
            step, self.total_steps, sched
        )
        for group in self.dense_opt.param_groups:
            group["lr"] = group["initial_lr"] * factor
        for group in self.sparse_opt.param_groups:
            group["lr"] = group["initial_lr"] * factor
        return self.dense_opt.param_groups[0]["lr"], self.sparse_opt.param_groups[0]["lr"]

    def micro_batch(self, step: int, j: int) -> Batch:
        group = self.rank * self.A + j
        return Batch.from_rows(self.stream.rows(step, group)).to(self.device)

    def train_step(self) -> dict[str, Any]:
        """One global step; returns its record (loss = mean over the global batch)."""
        step = self.step
        lr_dense, lr_sparse = self.set_learning_rates(step)
        self.model.train()
        t0 = time.perf_counter()
        losses = []
        for j in range(self.A):
            batch = self.micro_batch(step, j)
            loss, _ = self.model.loss(batch)
            loss.backward()
            self.dense_opt.collect()
            self.sparse_opt.collect()
            losses.append(loss.detach())
        self.dense_opt.step()
        self.sparse_opt.step()
        seconds = time.perf_counter() - t0
        self.step += 1
        loss_value = float(torch.stack(losses).mean())
        record = {
            "step": self.step,
            "samples": self.step * self.cfg.run.global_batch,
            "epoch": round(self.stream.epoch(self.step), 6),
            "loss": loss_value,
            "lr_dense": lr_dense,
            "lr_sparse": lr_sparse,
            "step_seconds": seconds,
            "rows_per_s": self.cfg.run.global_batch / seconds,
        }
        record.update(compact_gsnr(self.dense_opt.gsnr_summary()))
        return record

    def gsnr_record(self) -> dict[str, Any]:
        """Per-tensor (dense) and per-table (sparse) GSNR figures of the last step."""
        return {
            "step": self.step,
            "dense": self.dense_opt.gsnr_summary(),
            "tables": self.sparse_opt.summary(),
        }

    # ------------------------------------------------------------------------ eval
    def _eval_batches(self, source: RowSource, limit: int | None) -> Iterable[Batch]:
        """Eval batches; kept in memory when small (periodic evals reread the same rows)."""
        rows = source.num_rows if limit is None else min(limit, source.num_rows)
        if rows > EVAL_CACHE_ROWS:
            return iter_eval_batches(source, self.cfg.run.eval_batch, limit)
        key = (id(source), rows)
        if key not in self._eval_cache:
            self._eval_cache[key] = list(iter_eval_batches(source, self.cfg.run.eval_batch, limit))
        return self._eval_cache[key]

    @torch.no_grad()
    def evaluate(self, source: RowSource, limit: int | None = None) -> dict[str, float]:
        self.model.eval()
        acc = EvalAccumulator()
        for batch in self._eval_batches(source, limit):
            batch = batch.to(self.device)
            acc.update(torch.sigmoid(self.model(batch)), batch.labels, batch.probs)
        self.model.train()
        return acc.compute()

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "dense_opt": self.dense_opt.state_dict(),
            "sparse_opt": self.sparse_opt.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
            "best_val": self.best_val,
            "config": self.cfg.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.dense_opt.load_state_dict(state["dense_opt"])
        self.sparse_opt.load_state_dict(state["sparse_opt"])
        torch.set_rng_state(state["rng"]["torch"])
        self.step = int(state["step"])
        self.best_val = state.get("best_val")

    def save_checkpoint(self, out_dir: Path) -> Path:
        ckpt.write_rank_state(out_dir, self.step, self.rank, self.state_dict())
        return ckpt.publish(
            out_dir, self.step, self.world_size, self.cfg.to_dict(), self.cfg.run.keep_checkpoints
        )


def compact_gsnr(summary: list[dict[str, Any]]) -> dict[str, float]:
    """Element-weighted mean clipped ratio and fraction clipped at γ over all dense tensors."""
    total = sum(s["numel"] for s in summary)
    if not total:
        return {}
    return {
        "gsnr_ratio": sum(s["ratio"] * s["numel"] for s in summary) / total,
        "gsnr_frac_clipped": sum(s["frac_clipped"] * s["numel"] for s in summary) / total,
    }


def config_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts."""
    keys = set(old) | set(new)
    out = []
    for k in sorted(keys):
        path = f"{prefix}{k}"
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, path + ".")
        elif a != b:
            out.append(path)
    return out


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("fbgemm-gpu-cpu", "fbgemm-gpu", "torchrec", "dlrm-vrgd"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def train(
    cfg: TrainConfig,
    out_dir: str | Path | None = None,
    callbacks: list[Callback] | tuple[Callback, ...] = (),
    resume: bool = False,
) -> RunResult:
    """Run the job described by ``cfg``; write the run directory when ``out_dir`` is given.

    With ``resume``, continue from the newest checkpoint in ``out_dir`` (records written after
    that checkpoint by the interrupted run are dropped), else ``out_dir`` must not hold a run.
    """
    trainer = Trainer(cfg)  # everything that can fail on bad input fails before any write
    out = Path(out_dir) if out_dir is not None else None
    latest = None
    if out is not None:
        latest = ckpt.latest_checkpoint(out) if resume else None
        if not resume and (out / rundir.CONFIG).exists():
            raise FileExistsError(f"{out} already holds a run: pass --resume or another --out")
        if latest is not None:
            old = ckpt.read_manifest(latest)["config"]
            changed = [k for k in config_changes(old, cfg.to_dict()) if k not in RESUMABLE_CHANGES]
            if changed:
                raise ValueError(f"cannot resume {out}: config differs in {', '.join(changed)}")
            trainer.load_state_dict(ckpt.load_rank_state(latest, 0))
            logger.info("resumed from %s", latest)
        out.mkdir(parents=True, exist_ok=True)
        for name in (rundir.METRICS, rundir.GSNR):
            rundir.truncate_jsonl_after(out / name, trainer.step)
        (out / rundir.RESULT).unlink(missing_ok=True)
        rundir.atomic_write_json(out / rundir.CONFIG, cfg.to_dict())
    metrics = rundir.JsonlWriter(out / rundir.METRICS) if out else None
    gsnr = rundir.JsonlWriter(out / rundir.GSNR) if out else None
    run = cfg.run
    info = {
        "total_steps": trainer.total_steps,
        "start_step": trainer.step,
        "global_batch": run.global_batch,
        "micro_batch": run.micro_batch,
        "accumulation": trainer.A,
        "train_rows": trainer.splits.train.num_rows,
    }
    for cb in callbacks:
        cb.on_start(info)

    losses: list[float] = []
    train_s = eval_s = 0.0
    samples_before = trainer.step * run.global_batch
    try:
        while trainer.step < trainer.total_steps:
            record = trainer.train_step()
            train_s += record["step_seconds"]
            losses.append(record["loss"])
            if metrics and (record["step"] % run.log_every == 0 or record["step"] == 1):
                metrics.write({"kind": "train", **record})
            if gsnr and (record["step"] % run.gsnr_every == 0 or record["step"] == 1):
                gsnr.write(trainer.gsnr_record())
            for cb in callbacks:
                cb.on_step(record)
            last = trainer.step == trainer.total_steps
            if run.eval_every and trainer.step % run.eval_every == 0 and not last:
                t0 = time.perf_counter()
                ev = _eval_record(trainer, "val", run.eval_rows)
                eval_s += time.perf_counter() - t0
                if metrics:
                    metrics.write(ev)
                for cb in callbacks:
                    cb.on_eval(ev)
            if out and run.checkpoint_every and trainer.step % run.checkpoint_every == 0:
                trainer.save_checkpoint(out)

        t0 = time.perf_counter()
        val = _eval_record(trainer, "val", None)
        test = _eval_record(trainer, "test", None)
        eval_s += time.perf_counter() - t0
        for ev in (val, test):
            if metrics:
                metrics.write(ev)
            for cb in callbacks:
                cb.on_eval(ev)
        if out and run.checkpoint_every and trainer.step % run.checkpoint_every != 0:
            trainer.save_checkpoint(out)
    finally:
        for w in (metrics, gsnr):
            if w:
                w.close()

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
    )
    if out:
        trained = result.samples - samples_before
        rundir.atomic_write_json(
            out / rundir.RESULT,
            {
                "steps": result.steps,
                "samples": result.samples,
                "final_loss": losses[-1] if losses else None,
                "val": result.val,
                "test": result.test,
                "best_val": result.best_val,
                "timings": {
                    "train_seconds": train_s,
                    "eval_seconds": eval_s,
                    "rows_per_s": trained / train_s if train_s > 0 else None,
                },
                "optimizers": {
                    "dense": cfg.optim.dense.name,
                    "sparse": cfg.optim.sparse.name,
                    "sparse_gsnr_estimator": (
                        cfg.optim.sparse.estimator if cfg.optim.sparse.gsnr else None
                    ),
                },
                "config": cfg.to_dict(),
                "versions": _versions(),
            },
        )
    for cb in callbacks:
        cb.on_end(result)
    return result


def _eval_record(trainer: Trainer, split: str, limit: int | None) -> dict[str, Any]:
    source = trainer.splits.val if split == "val" else trainer.splits.test
    m = trainer.evaluate(source, limit)
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


def _strip(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("kind", "split")}
