"""Training throughput: our trainer beside a reference loop written directly against torchrec,
and full VRGD beside plain optimizers — one process, one run, medians of interleaved steps.

Model: the Criteo-Kaggle-sized DLRM of DESIGN.md 6 (26 tables x 100k rows x 64, MLPs
512-256-64 / 512-256-1) on Kaggle-shaped synthetic data (configs/synthetic_kaggle.yaml sizes).

* reference: torchrec DistributedModelParallel (one rank) with FBGEMM's fused EXACT_ROWWISE_ADAGRAD
  inside the backward and torch.optim.AdamW for the dense layers: one update per B rows.
* ours, plain: AdamW + row-wise Adagrad through our trainer — at A = 1 (same batch, one update
  per B rows) and at A = k (one update per k·B rows: the global-batch path).
* ours, VRGD: VR-Adam + GSNR row-wise Adagrad at A = k.
* ours, plain at A = 1 with ``run.input.builder: serial``: the step builds its micro-batch
  itself, as the reference loop does (the default builds it ahead on a thread that shares the
  cores with the step's), so the two A = 1 rows tell whether the builder thread costs the step.
* ours, plain at A = 1 with ``run.heap_release: never``: what handing glibc's free pages back
  after every micro-batch (the CPU default, which bounds memory by the micro-batch) costs.

Targets: ours(A=1) / reference >= 0.9 in rows/s; VRGD / plain at A = k <= 1.25 in step time.

The six run interleaved within every repetition (A B C ..., then reversed); each ratio is the
median over repetitions of that repetition's pair, with its 95% order-statistic interval
(common.median_interval). ``--json`` writes the figures for ``bench/run_all.py --save``.

    python bench/throughput.py [--micro-batch 4096] [--k 8] [--reps 41] [--heap-release MODE]
                               [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import REPO, interleaved_times, paired_ratios, print_table, threads, write_result

from dlrm_vrgd.config import load_config
from dlrm_vrgd.data.batch import Batch
from dlrm_vrgd.malloc import HEAP_RELEASE
from dlrm_vrgd.model import build_model
from dlrm_vrgd.train.distributed import DistEnv, dense_parameters, shard_model
from dlrm_vrgd.train.loop import Trainer

PLAIN = ["optim.dense.name=adamw", "optim.sparse.name=rowwise_adagrad"]
VRGD = ["optim.dense.name=vradam", "optim.sparse.name=gsnr_rowwise_adagrad"]


def config(b: int, a: int, optim: list[str], heap_release: str = "micro_batch", *extra: str):
    return load_config(
        REPO / "configs" / "synthetic_kaggle.yaml",
        [
            f"run.global_batch={a * b}",
            f"run.micro_batch={b}",
            "run.epochs=null",
            "run.steps=100000",
            "optim.schedule.warmup_steps=0",
            "optim.schedule.decay=none",
            f"run.heap_release={heap_release}",
            *optim,
            *extra,
        ],
    )


class ReferenceLoop:
    """The plain torchrec way: DMP-sharded tables with the fused optimizer in the backward."""

    def __init__(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        self.stream = trainer.stream
        torch.manual_seed(cfg.run.seed)
        self.model = build_model(
            cfg,
            trainer.splits.cardinalities,
            trainer.splits.num_dense,
            torch.device("cpu"),
            for_sharding=True,
        )
        self.dmp = shard_model(self.model, cfg, DistEnv())
        params = [p for _, p in dense_parameters(self.model)]
        self.opt = torch.optim.AdamW(params, lr=cfg.optim.dense.lr)
        self.step = 0

    def train_step(self) -> None:
        batch = Batch.from_rows(self.stream.rows(self.step, 0))
        loss = F.binary_cross_entropy_with_logits(self.dmp(batch), batch.labels)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.step += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batch", type=int, default=4096)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument(
        "--reps",
        type=int,
        default=41,
        help="repetitions of every variant (41: intervals within +-5%% on 2 idle cores)",
    )
    ap.add_argument(
        "--heap-release",
        default="micro_batch",
        choices=HEAP_RELEASE,
        help="our trainers' run.heap_release (default: the trainer's default)",
    )
    ap.add_argument("--json", help="write the figures here (bench/run_all.py --save)")
    args = ap.parse_args()
    torch.set_num_threads(threads())
    b, k = args.micro_batch, args.k
    store = tempfile.mktemp(prefix="dlrm-vrgd-bench-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    try:
        heap = args.heap_release
        ours_1 = Trainer(config(b, 1, PLAIN, heap))
        ours_1_serial = Trainer(config(b, 1, PLAIN, heap, "run.input.builder=serial"))
        ours_1_keep = Trainer(config(b, 1, PLAIN, "never"))
        ours_k = Trainer(config(b, k, PLAIN, heap))
        vrgd_k = Trainer(config(b, k, VRGD, heap))
        reference = ReferenceLoop(ours_1)
        times = interleaved_times(
            {
                "reference": reference.train_step,
                "ours_1": ours_1.train_step,
                "ours_1_serial": ours_1_serial.train_step,
                "ours_1_keep_heap": ours_1_keep.train_step,
                "ours_k": ours_k.train_step,
                "vrgd_k": vrgd_k.train_step,
            },
            args.reps,
            warmup=1,
        )
    finally:
        dist.destroy_process_group()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    # rows/s ratio of ours(A=1) to the reference = reference time / ours time (same B rows)
    rate_1 = paired_ratios(times, "reference", "ours_1")
    rate_1_serial = paired_ratios(times, "reference", "ours_1_serial")
    rate_1_keep = paired_ratios(times, "reference", "ours_1_keep_heap")
    vrgd_over_plain = paired_ratios(times, "vrgd_k", "ours_k")
    ref_rate = b / med["reference"]
    rows = [
        ["torchrec reference (DMP + fused rowwise Adagrad + AdamW)", b, "reference"],
        ["ours, AdamW + rowwise Adagrad, A = 1", b, "ours_1"],
        ["ours, the same with run.input.builder: serial", b, "ours_1_serial"],
        ["ours, the same with run.heap_release: never", b, "ours_1_keep_heap"],
        [f"ours, AdamW + rowwise Adagrad, A = {k}", k * b, "ours_k"],
        [f"ours, VR-Adam + GSNR rowwise Adagrad, A = {k}", k * b, "vrgd_k"],
    ]
    table = [
        [label, n, med[name], n / med[name], n / med[name] / ref_rate] for label, n, name in rows
    ]
    print(
        f"Kaggle-sized DLRM, micro-batch B = {b}, {threads()} threads, {args.reps} interleaved "
        "repetitions (medians)"
    )
    print_table(["variant", "rows/step", "s/step", "rows/s", "rows/s vs reference"], table)
    print(f"\nours(A=1) / reference rows/s: {rate_1}   (target >= 0.9)")
    print(f"ours(A=1, serial input) / reference rows/s: {rate_1_serial}")
    print(f"ours(A=1, heap kept) / reference rows/s: {rate_1_keep}")
    print(f"VRGD / plain step time at A = {k}: {vrgd_over_plain}   (target <= 1.25)")
    write_result(
        args.json,
        "throughput",
        {
            "micro_batch": b,
            "k": k,
            "reps": args.reps,
            "heap_release": args.heap_release,
            "s_per_step": med,
            "ours_1_vs_reference_rows_per_s": rate_1,
            "ours_1_serial_vs_reference_rows_per_s": rate_1_serial,
            "ours_1_keep_heap_vs_reference_rows_per_s": rate_1_keep,
            "vrgd_vs_plain_step_time": vrgd_over_plain,
        },
    )


if __name__ == "__main__":
    main()
