"""The training loop: one optimizer step per global batch of ``G = world x A x B`` rows.

For each global step, each rank runs ``A`` micro-batches of ``B`` rows: forward, backward of
the micro-batch's mean loss, then ``collect()`` on both optimizers (the micro-batch is one
gradient *group*); after the last one, ``step()`` on both applies the update of the whole global
batch once. One micro-batch is in the step at a time, and the input pipeline
(:mod:`dlrm_vrgd.data.pipeline`, ``run.input``) builds at most ``depth`` more ahead of it, so
memory is set by ``B``, not ``G``; each step records how long it waited for them
(``data_wait_s``).

:class:`Trainer` holds the model, the optimizers and the input, and makes one step
(:meth:`Trainer.train_step`), an evaluation or a checkpoint at a time; the run around it
(resume, the evaluation and checkpoint cadence, early stop, the result) is
:func:`dlrm_vrgd.train.run.train`.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dlrm_vrgd import checkpoint as ckpt
from dlrm_vrgd.checkpoint import rng
from dlrm_vrgd.config import TrainConfig
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
from dlrm_vrgd.train import stop
from dlrm_vrgd.train.distributed import (
    DistEnv,
    barrier,
    gather_objects,
    shard_model,
    sharded_lookups,
    summed,
)
from dlrm_vrgd.train.evaluate import EvalBatch, evaluate_share, rank_share

logger = logging.getLogger(__name__)

#: Eval splits up to this many rows are generated/read once and kept in memory.
EVAL_CACHE_ROWS = 250_000


class NonFiniteError(RuntimeError):
    """Training met a NaN or an infinity (in the loss or the weights) and stopped there."""


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
            every = self.cfg.run.eval_interval(self.splits.train.num_rows)
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
