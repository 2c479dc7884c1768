"""The training loop: one optimizer step per global batch of ``G = world x A x B`` rows.

For each global step, each rank runs ``A`` micro-batches of ``B`` rows: forward, backward of
the micro-batch's mean loss, then ``collect()`` on both optimizers (the micro-batch is one
gradient *group*); after the last one, ``step()`` on both applies the update of the whole global
batch once. One micro-batch is in the step at a time, and the input pipeline
(:mod:`dlrm_vrgd.data.pipeline`, ``run.input``) builds at most ``depth`` more ahead of it, so
memory is set by ``B``, not ``G``; each step records how long it waited for them
(``data_wait_s``).

``train(cfg, out_dir, callbacks)`` runs a job end to end and writes the run directory
(:mod:`dlrm_vrgd.rundir`); :class:`Trainer` holds the pieces for tests and benchmarks.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dlrm_vrgd import checkpoint as ckpt
from dlrm_vrgd import rundir
from dlrm_vrgd.advice import advise
from dlrm_vrgd.checkpoint import rng
from dlrm_vrgd.config import OPERATIONAL, RunConfig, TrainConfig, marked_fields
from dlrm_vrgd.data import DataSplits, RowSource, build_splits
from dlrm_vrgd.data.batch import Batch, TrainStream
from dlrm_vrgd.data.pipeline import InputPipeline, trainer_pipeline
from dlrm_vrgd.malloc import heap_release, set_mmap_threshold
from dlrm_vrgd.model import build_model, table_specs
from dlrm_vrgd.optim.dense import build_dense_optimizer
from dlrm_vrgd.optim.noise_scale import NoiseScale
from dlrm_vrgd.optim.schedule import batch_scale, lr_factor
from dlrm_vrgd.optim.sparse import CowClip, SparseRowwiseOptimizer
from dlrm_vrgd.optim.vrgd import GroupGSNROptimizer
from dlrm_vrgd.precision import configure as configure_precision
from dlrm_vrgd.tracking import Sinks, run_sinks
from dlrm_vrgd.tracking.sink import stamped
from dlrm_vrgd.train import stop
from dlrm_vrgd.train.distributed import (
    DistEnv,
    barrier,
    gather_objects,
    rank0_decides,
    shard_model,
    sharded_lookups,
    summed,
)
from dlrm_vrgd.train.evaluate import EvalBatch, evaluate_share, rank_share

logger = logging.getLogger(__name__)

#: Eval splits up to this many rows are generated/read once and kept in memory.
EVAL_CACHE_ROWS = 250_000

#: Config keys a resumed run may change (how long and how often, not what is trained), with
#: every field marked OPERATIONAL in dlrm_vrgd/config.py; a key covers the keys below it.
RESUMABLE_CHANGES = {
    "run.gsnr_every",
    "run.noise_scale_beta",
    "run.steps",
    "run.epochs",
    "run.eval_every",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.log_every",
    "run.eval_rows",
    "run.threads",
    "run.malloc_mmap_threshold_kb",
    "run.precision",
} | {f"run.{name}" for name in marked_fields(RunConfig, OPERATIONAL)}

#: What may change when a run resumes on another number of ranks (its tables are resharded).
RESHARD_CHANGES = {
    "run.nproc_per_node",
    "run.nnodes",
    "run.rdzv_endpoint",
    "run.rdzv_id",
    "run.sharding",
    "run.collective_timeout_s",
}


class RunInterrupted(KeyboardInterrupt):
    """The run was stopped by SIGINT (Ctrl-C); the message says where and how to resume."""


class NonFiniteError(RuntimeError):
    """Training met a NaN or an infinity (in the loss or the weights) and stopped there."""


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

    @property
    def rows_per_second(self) -> float:
        return self.samples / self.train_seconds if self.train_seconds > 0 else float("nan")


class Trainer:
    """Model, optimizers and data of one process (rank ``env.rank`` of ``env.world_size``)."""

    def __init__(
        self, cfg: TrainConfig, splits: DataSplits | None = None, env: DistEnv | None = None
    ) -> None:
        self.cfg = cfg
        self.env = env or DistEnv()
        run = cfg.run
        if self.env.world_size != run.world_size:
            raise ValueError(
                f"the config asks for {run.world_size} process(es), this is one of "
                f"{self.env.world_size}: launch through `dlrm-vrgd train` (it starts torchrun)"
            )
        self.device = torch.device(
            run.device, self.env.local_rank if run.device == "cuda" else None
        )
        if run.threads:
            torch.set_num_threads(run.threads)
        set_mmap_threshold(run.malloc_mmap_threshold_kb)
        self.release_heap = heap_release(run.heap_release, run.device)
        self.splits = splits if splits is not None else build_splits(cfg.data)
        self.A = run.accumulation_steps
        self.stream = TrainStream(self.splits.train, run.global_batch, run.micro_batch, run.seed)
        self.total_steps = cfg.total_steps(self.splits.train.num_rows)
        #: Built on the first micro-batch asked for (:meth:`micro_batch`); :meth:`close_input`.
        self.input: InputPipeline | None = None
        #: Seconds this step has waited for its micro-batches so far.
        self.data_wait_s = 0.0
        #: The context the model's forward runs under (autocast for ``run.precision: bf16``).
        self.autocast = configure_precision(run.precision, self.device)
        torch.manual_seed(run.seed)  # the dense layers are drawn on the CPU: one model per seed
        cards, num_dense = self.splits.cardinalities, self.splits.num_dense
        if self.env.distributed:
            self.model = build_model(cfg, cards, num_dense, self.device, for_sharding=True)
            self.sharded = shard_model(self.model, cfg, self.env)
            names = [name for name, _, _ in table_specs(cards)]
            self.lookups = sharded_lookups(self.model, self.env, run.seed, names)
        else:
            self.model = build_model(cfg, cards, num_dense, self.device).to(self.device)
            self.lookups = self.model.embeddings.lookups()
        for lookup in self.lookups:  # a Batch holds one id per table per row
            lookup.capture.one_hot = True
        pg = dist.group.WORLD if self.env.distributed else None
        self.dense_opt = build_dense_optimizer(
            cfg.optim.dense, self.model.named_dense_parameters(), process_group=pg
        )
        sparse = cfg.optim.sparse
        self.sparse_opt = SparseRowwiseOptimizer(
            self.lookups,
            lr=sparse.lr,
            gsnr=sparse.gsnr,
            gamma=sparse.gamma,
            placement=sparse.gsnr_placement,
            estimator=sparse.estimator,
            ema_beta=sparse.ema_beta,
            chunk_rows=sparse.replay_chunk_rows,
            cowclip=(
                CowClip(sparse.clip_ratio, sparse.zeta, sparse.weight_decay)
                if sparse.cowclip
                else None
            ),
            groups_per_collect=self.env.world_size,
            seed=run.seed,
        )
        #: The gradient noise scale (DESIGN.md 4.6): groups of B rows, updated every step.
        self.noise = NoiseScale(run.micro_batch, run.noise_scale_beta)
        self.step = 0
        #: Set by each step's agreement: the signal every rank stops after this step with
        #: (several ranks; one process asks :func:`stop.requested`).
        self.stop_agreed: str | None = None
        #: The last update's check of the dense weights (a device flag, 1 where one is not
        #: finite), read back with the next step's agreement.
        self._dense_broken: torch.Tensor | None = None
        self.best_val: dict[str, Any] | None = None
        self._eval_cache: dict[tuple[int, int | None], list[EvalBatch]] = {}
        #: split -> the last eval's ``probs`` / ``labels`` (until the sinks take them)
        self.last_predictions: dict[str, dict[str, Any]] = {}

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
        """Micro-batch ``j`` of this rank in global step ``step``: group ``rank·A + j``, from
        the input pipeline (``run.input``: the next ones are built ahead); the time waited for
        it is added to :attr:`data_wait_s`."""
        if self.input is None:
            self.input = trainer_pipeline(
                self.stream, self.cfg, self.device, self.env.rank, self.A, self.total_steps
            )
        batch = self.input.get((step, self.env.rank * self.A + j))
        self.data_wait_s += self.input.last_wait_s
        return batch

    def close_input(self) -> None:
        """Stop the input pipeline's threads or processes (a later micro-batch starts it
        again)."""
        if self.input is not None:
            self.input.close()
            self.input = None

    def train_step(self) -> dict[str, Any]:
        """One global step; returns its record (loss = mean over the global batch)."""
        step = self.step
        lr_dense, lr_sparse = self.set_learning_rates(step)
        self.model.train()
        # the realised step ratio: on the steps whose GSNR is recorded
        measure = step == 0 or (step + 1) % self.cfg.run.gsnr_every == 0
        self.sparse_opt.measure_steps = measure
        if isinstance(self.dense_opt, GroupGSNROptimizer):
            self.dense_opt.measure_steps = measure
            # an eval follows this step: TensorBoard's histograms show its GSNR ratios
            every = self.cfg.run.eval_every
            evals = (every and (step + 1) % every == 0) or step + 1 == self.total_steps
            self.dense_opt.keep_ratios = self.cfg.run.tensorboard and bool(evals)
        t0 = time.perf_counter()
        self.data_wait_s = 0.0
        losses = []
        for j in range(self.A):
            batch = self.micro_batch(step, j)
            with self.autocast():
                loss, _ = self.model.loss(batch)
            loss.backward()
            self.dense_opt.collect()
            self.sparse_opt.collect()
            losses.append(loss.detach())
            del batch, loss  # the micro-batch's buffers are free: return their pages
            self.release_heap()
        loss = self._agree(torch.stack(losses).mean())
        if not math.isfinite(loss):  # every rank sees the same mean: all stop together
            raise NonFiniteError(
                f"step {step + 1}: the loss is {loss} (not finite); stopped before updating "
                "the weights (a learning rate or data.signal_scale too large?)"
            )
        self.dense_opt.step()
        self.release_heap()  # the dense step's temporaries: the sparse step starts lower
        self.sparse_opt.step()
        self.noise.update(self.dense_opt.noise_pieces(), self.sparse_opt.noise_pieces())
        with torch.no_grad():  # read back with the next step's agreement (or check_finite)
            finite = [torch.isfinite(p).all() for _, p in self.model.named_dense_parameters()]
            self._dense_broken = torch.stack(finite).logical_not().any()
        seconds = time.perf_counter() - t0
        self.step += 1
        record = {
            "step": self.step,
            "samples": self.step * self.cfg.run.global_batch,
            "epoch": round(self.stream.epoch(self.step), 6),
            "loss": loss,
            "lr_dense": lr_dense,
            "lr_sparse": lr_sparse,
            "step_seconds": seconds,
            "rows_per_s": self.cfg.run.global_batch / seconds,
            # waited for input (micro-batches not built in time): the GPU starving shows here
            "data_wait_s": self.data_wait_s,
        }
        if measure:  # the optimizer's figures are read back on the steps it measured only
            record.update(compact_gsnr(self.dense_opt.gsnr_summary()))
        return record

    def _agree(self, loss: torch.Tensor) -> float:
        """The step's one collective and one read-back, before its update: this rank's mean
        micro-batch ``loss`` (a device scalar), whether the previous update left a dense weight
        not finite, and this rank's stop request (:func:`stop.flags`), summed over the ranks in
        one vector on the run's device. Sets :attr:`stop_agreed`; returns the global mean
        loss. Raises :class:`NonFiniteError` (on every rank alike) for the previous step's
        weights."""
        asked = stop.flags()
        agreement = torch.zeros(2 + len(asked), dtype=torch.float64, device=self.device)
        agreement[0] = loss  # copies on the device: nothing is read back before the sum
        if self._dense_broken is not None:
            agreement[1] = self._dense_broken
        for i, flag in enumerate(asked):
            if flag:
                agreement[2 + i] = flag
        total, broken, *signals = summed(agreement, self.env)
        if broken > 0:
            self.check_finite(self.step, tables=False)  # names the tensor (replicated)
            raise NonFiniteError(
                f"step {self.step}: a dense parameter of another rank is not finite"
            )
        self.stop_agreed = stop.agreed(signals)
        return total / self.env.world_size

    def check_finite(self, step: int, tables: bool = True) -> None:
        """Raise :class:`NonFiniteError` naming ``step`` when a dense parameter (replicated:
        every rank agrees) or, with ``tables``, a weight of this rank's tables (agreed on by an
        all-reduce: a collective when distributed) is NaN or infinite."""
        with torch.no_grad():
            named = list(self.model.named_dense_parameters())
            finite = torch.stack([torch.isfinite(p).all() for _, p in named])
            if not bool(finite.all()):  # one read-back a step; the names only on failure
                name = next(n for (n, _), ok in zip(named, finite.tolist(), strict=True) if not ok)
                raise NonFiniteError(f"step {step}: dense parameter {name} is not finite")
            if not tables:
                return
            bad = [
                name
                for lk in self.lookups
                for name, w in zip(lk.table_names, lk.table_weights(), strict=True)
                if not bool(torch.isfinite(w).all())
            ]
        if summed(torch.tensor([float(bool(bad))], dtype=torch.float64), self.env)[0] > 0:
            where = f"table(s) {', '.join(bad)}" if bad else "a table of another rank"
            raise NonFiniteError(f"step {step}: {where} not finite")

    @torch.no_grad()
    def weight_arrays(self) -> dict[str, np.ndarray]:
        """What TensorBoard's histograms show at an eval: every dense parameter
        (``weights/dense/<name>``), the L2 norm of every row of this rank's tables
        (``weights/row_norm/<table>``) and, with a VR dense optimizer, the last step's
        per-element GSNR ratio of each dense tensor (``gsnr/ratio/<name>``)."""
        out = {
            f"weights/dense/{name}": p.detach().float().cpu().numpy().ravel()
            for name, p in self.model.named_dense_parameters()
        }
        for lk in self.lookups:
            for name, w in zip(lk.table_names, lk.table_weights(), strict=True):
                norms = torch.linalg.vector_norm(w.detach().float(), dim=1)
                out[f"weights/row_norm/{name}"] = norms.cpu().numpy()
        for name, ratio in getattr(self.dense_opt, "last_ratios", {}).items():
            out[f"gsnr/ratio/{name}"] = ratio.detach().float().cpu().numpy().ravel()
        return out

    def gsnr_record(self) -> dict[str, Any]:
        """Per-tensor (dense) and per-table (sparse, from every rank) GSNR figures of the last
        step, and the gradient noise scale (``noise_scale``, :meth:`NoiseScale.record`). A
        collective when distributed: every rank must call it."""
        parts = gather_objects((self.sparse_opt.summary(), self.noise.table_rows()), self.env)
        tables = [t for summary, _ in parts for t in summary]
        noise = self.noise.record(
            self.cfg.run.global_batch,
            self.noise.dense_rows(),
            [row for _, rows in parts for row in rows],
        )
        return {
            "step": self.step,
            "dense": self.dense_opt.gsnr_summary(),
            "tables": tables,
            "noise_scale": noise,
        }

    # ------------------------------------------------------------------------ eval
    def evaluate(
        self, source: RowSource, limit: int | None = None, keep: dict[str, Any] | None = None
    ) -> dict[str, float]:
        """Model and oracle metrics of the first ``limit`` rows of ``source`` (every rank
        scores a share; a collective when distributed); ``keep``: see :func:`evaluate_share`."""
        key = (id(source), limit)
        batches = self._eval_cache.get(key)
        if batches is None:
            batches = rank_share(source, self.cfg.run.eval_batch, self.env, limit)
            rows = source.num_rows if limit is None else min(limit, source.num_rows)
            if rows <= EVAL_CACHE_ROWS:  # periodic evals reread the same rows
                self._eval_cache[key] = batches
        self.model.eval()
        try:
            return evaluate_share(self._probabilities, batches, self.env, self.device, keep)
        finally:
            self.model.train()

    def _probabilities(self, batch: Batch) -> torch.Tensor:
        with self.autocast():
            logits = self.model(batch)
        return torch.sigmoid(logits.float())

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: dense parameters, its tables (weights + row-wise optimizer state),
        both optimizers, step, RNG, config."""
        return {
            "step": self.step,
            "world_size": self.env.world_size,
            "dense": {n: p.detach().clone() for n, p in self.model.named_dense_parameters()},
            "tables": [
                {
                    "names": lk.table_names,
                    "weights": [w.detach().clone() for w in lk.table_weights()],
                    "states": [s.detach().clone() for s in lk.row_states()],
                }
                for lk in self.lookups
            ],
            "dense_opt": self.dense_opt.state_dict(),
            "sparse_opt": self.sparse_opt.state_dict(),
            "noise_scale": self.noise.state_dict(),
            "rng": rng.capture(self.device),
            "best_val": self.best_val,
            "config": self.cfg.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = [t["names"] for t in state["tables"]]
        mine = [lk.table_names for lk in self.lookups]
        if saved != mine:
            raise ckpt.CheckpointError(
                f"rank {self.env.rank}: checkpoint holds tables {saved}, this run has {mine} "
                "(a different sharding plan?)"
            )
        with torch.no_grad():
            params = dict(self.model.named_dense_parameters())
            for name, value in state["dense"].items():
                params[name].copy_(value)
            for lk, tables in zip(self.lookups, state["tables"], strict=True):
                for w, w0 in zip(lk.table_weights(), tables["weights"], strict=True):
                    w.copy_(w0)
                for s, s0 in zip(lk.row_states(), tables["states"], strict=True):
                    s.copy_(s0)
        self.dense_opt.load_state_dict(state["dense_opt"])
        self.sparse_opt.load_state_dict(state["sparse_opt"])
        self.noise.load_state_dict(
            state.get("noise_scale"), [n for lk in self.lookups for n in lk.table_names]
        )
        rng.restore(state["rng"], self.device)
        self._dense_broken = None  # a checkpoint's weights were checked when it was saved
        self.step = int(state["step"])
        self.best_val = state.get("best_val")

    def save_checkpoint(self, out_dir: Path) -> None:
        """Every rank writes its state; rank 0 seals the checkpoint once all have. Weights that
        are not finite are never saved (:class:`NonFiniteError`; older checkpoints stay)."""
        self.check_finite(self.step)
        ckpt.write_rank_state(out_dir, self.step, self.env.rank, self.state_dict())
        barrier(self.env)
        if self.env.is_main:
            ckpt.publish(
                out_dir,
                self.step,
                self.env.world_size,
                self.cfg.to_dict(),
                self.cfg.run.keep_checkpoints,
                best=self.best_val if self.cfg.run.keep_best_checkpoint else None,
            )
        barrier(self.env)


def compact_gsnr(summary: list[dict[str, Any]]) -> dict[str, float]:
    """Element-weighted mean clipped ratio and fraction clipped at γ over all dense tensors."""
    total = sum(s["numel"] for s in summary)
    if not total:
        return {}
    return {
        "gsnr_ratio": sum(s["ratio"] * s["numel"] for s in summary) / total,
        "gsnr_frac_clipped": sum(s["frac_clipped"] * s["numel"] for s in summary) / total,
    }


def _covered(key: str, allowed: set[str]) -> bool:
    """Whether the dotted ``key`` or a key above it is in ``allowed``."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in allowed for i in range(1, len(parts) + 1))


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
    for package in ("fbgemm-gpu-cpu", "fbgemm-gpu", "torchrec", "dlrm-vrgd"):
        try:
            out[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    return out


def check_resume(
    out: Path, cfg: TrainConfig, resume: bool, skipped: list[tuple[Path, str]] | None = None
) -> Path | None:
    """The checkpoint to resume from (None: start afresh), or a clear error before any work.

    That is the newest checkpoint that verifies; newer, damaged ones are logged and appended to
    ``skipped`` (path, reason)."""
    if not resume:
        if (out / rundir.CONFIG).exists():
            raise FileExistsError(f"{out} already holds a run: pass --resume or another --out")
        return None
    latest, damaged = ckpt.newest_verified(out)
    for path, reason in damaged:
        logger.warning("skipping damaged checkpoint %s: %s", path.name, reason)
    if skipped is not None:
        skipped += damaged
    if latest is None:
        return None
    manifest = ckpt.read_manifest(latest)
    changed = [
        k
        for k in config_changes(manifest["config"], cfg.to_dict())
        if not _covered(k, RESUMABLE_CHANGES | RESHARD_CHANGES)
    ]
    if changed:
        raise ValueError(f"cannot resume {out}: config differs in {', '.join(changed)}")
    if needs_reshard(manifest, cfg):
        logger.info(
            "resuming %s (written by %d rank(s)) on %d: its tables are resharded",
            latest,
            manifest["world_size"],
            cfg.run.world_size,
        )
    return latest


def finished_run(out: Path, total_steps: int) -> dict[str, Any] | None:
    """The result.json of a run in ``out`` that already trained all ``total_steps``, else None
    (no result, an unreadable one, or fewer steps: e.g. ``run.steps`` was raised)."""
    try:
        result = json.loads((out / rundir.RESULT).read_text())
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(result, dict) or not isinstance(result.get("steps"), int):
        return None
    done = result["steps"] >= total_steps or isinstance(result.get("stopped_early"), dict)
    return result if done else None


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


def _resume_hint(out: Path) -> str:
    latest = ckpt.latest_checkpoint(out)
    if latest is None:
        return "no checkpoint was written yet: --resume starts it again from step 0"
    return f"--resume continues from {latest.name}"


def needs_reshard(manifest: dict[str, Any], cfg: TrainConfig) -> bool:
    """Whether a checkpoint's shards differ from what ``cfg`` runs on (ranks or sharding)."""
    saved = manifest["config"]["run"]
    return int(manifest["world_size"]) != cfg.run.world_size or (
        cfg.run.world_size > 1 and saved.get("sharding") != list(cfg.run.sharding)
    )


def load_checkpoint(trainer: Trainer, latest: Path) -> None:
    """Load checkpoint ``latest`` into ``trainer``, resharding it when it was written by
    another number of ranks or sharding (:mod:`dlrm_vrgd.checkpoint.reshard`)."""
    if not needs_reshard(ckpt.read_manifest(latest), trainer.cfg):
        trainer.load_state_dict(ckpt.load_rank_state(latest, trainer.env.rank))
        return
    from dlrm_vrgd.checkpoint.reshard import gather_checkpoint, rank_state

    full = gather_checkpoint(latest)
    with_ema = bool(trainer.sparse_opt.gsnr and trainer.sparse_opt.estimator == "ema")
    trainer.load_state_dict(rank_state(full, trainer.lookups, with_ema, trainer.env.rank))


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
    info = {
        "total_steps": trainer.total_steps,
        "start_step": trainer.step,
        "global_batch": run.global_batch,
        "micro_batch": run.micro_batch,
        "accumulation": trainer.A,
        "world_size": env.world_size,
        "train_rows": trainer.splits.train.num_rows,
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
            if run.eval_every and trainer.step % run.eval_every == 0 and not last:
                t0 = time.perf_counter()
                ev = _eval_record(trainer, "val", run.eval_rows)
                eval_s += time.perf_counter() - t0
                new_best = trainer.best_val is not None and trainer.best_val["step"] == trainer.step
                if sink:
                    written = stamped(ev)  # its wall_time is its PR curve's too
                    sink.metrics(written)
                    _eval_details(sink, trainer, [written])
                for cb in callbacks:
                    cb.on_eval(ev)
                stopped_early = _early_stop(trainer)
            if checkpointing and _checkpoint_due(trainer, saved_at, new_best):
                assert out is not None
                trainer.save_checkpoint(out)
                saved_step, saved_at = trainer.step, time.monotonic()
            if (sig := trainer.stop_agreed if env.distributed else stop.requested()) is not None:
                agreed = True
                raise KeyboardInterrupt(sig)  # every rank, after this same step
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
        test = _eval_record(trainer, "test", None)
        finals = [val, test]
        if run.final_train_eval_rows:
            finals.append(_eval_record(trainer, "train", run.final_train_eval_rows))
        eval_s += time.perf_counter() - t0
        written_finals = [stamped(ev) for ev in finals]
        for ev, written in zip(finals, written_finals, strict=True):
            if sink:
                sink.metrics(written)
            for cb in callbacks:
                cb.on_eval(ev)
        if sink:
            _eval_details(sink, trainer, written_finals)
        last_due = periodic or final_checkpoints or export_to is not None
        if out and last_due and saved_step != trainer.step:
            trainer.save_checkpoint(out)
    except KeyboardInterrupt as err:
        safe = not in_step and (agreed or not env.distributed)
        if out is not None and safe and saved_step != trainer.step:
            _checkpoint_at_interrupt(trainer, out)
        hint = _resume_hint(out) if out is not None else "it wrote no run directory"
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
            "timings": {
                "train_seconds": result.train_seconds,
                "eval_seconds": result.eval_seconds,
                "input_wait_seconds": result.input_wait_seconds,
                "input_wait_share": result.input_wait_share,
                "rows_per_s": trained / result.train_seconds if result.train_seconds > 0 else None,
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


def _early_stop(trainer: Trainer) -> dict[str, Any] | None:
    """The early-stop record when ``run.early_stop_patience`` periodic evaluations in a row
    found no better validation AUC than the best (counted from the best's step, so a resumed
    run counts the same), else None."""
    patience, every = trainer.cfg.run.early_stop_patience, trainer.cfg.run.eval_every
    best = trainer.best_val
    if patience is None or best is None or trainer.step - best["step"] < patience * every:
        return None
    return {
        "step": trainer.step,
        "best_step": best["step"],
        "best_val_auc": best["auc"],
        "patience": patience,
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
