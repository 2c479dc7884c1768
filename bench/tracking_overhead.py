"""Cost of TensorBoard tracking: step time with the event-file writer on and off, side by side
in one run, on the demo model and data with VR-Adam + GSNR row-wise Adagrad (every step logs
its metrics record and its per-tensor / per-table GSNR record, ~200 scalars).

Both variants do what the training loop does each step: the step, the GSNR record, and both
records written to metrics.jsonl / gsnr.jsonl. "on" also hands them to the TensorBoard sink and
is timed until the sink's thread has written them, so the writer's work counts in full, as if
it did not overlap the next step (a pessimistic figure). Steps alternate between the variants
in a seeded random order per round (the data stream's periodic work hits all alike); medians of
``--reps`` steps each. Wall time and CPU time (every thread of this process, the writer's
included; other processes' load not) are shown beside a second "off" variant, whose ratio is
what noise alone makes of a ratio. A last figure times the writer's own work alone.
Target: ratio <= 1.01.

    python bench/tracking_overhead.py [--reps 12] [--micro-batch 1024] [--k 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import REPO, print_table, threads

from dlrm_vrgd.config import load_config
from dlrm_vrgd.rundir import RunDirSink
from dlrm_vrgd.tracking import scalars
from dlrm_vrgd.tracking.tensorboard_sink import EventFile, TensorBoardSink
from dlrm_vrgd.train.loop import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--micro-batch", type=int, default=1024)
    ap.add_argument("--k", type=int, default=4, help="micro-batches per step")
    args = ap.parse_args()
    torch.set_num_threads(threads())
    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        [
            f"run.global_batch={args.micro_batch * args.k}",
            f"run.micro_batch={args.micro_batch}",
            "run.epochs=null",
            "run.steps=100000",
            "optim.dense.name=vradam",
            "optim.sparse.name=gsnr_rowwise_adagrad",
        ],
    )
    trainer = Trainer(cfg)
    tmp = Path(tempfile.mkdtemp(prefix="tracking-bench-"))
    run_dir = RunDirSink(tmp)
    tb = TensorBoardSink(tmp / "tb", cfg.to_dict())
    last: dict[str, dict] = {}

    def step(tensorboard: bool) -> None:
        record = {"kind": "train", **trainer.train_step()}
        gsnr = trainer.gsnr_record()
        run_dir.metrics(record)
        run_dir.gsnr(gsnr)
        if tensorboard:
            tb.metrics(record)
            tb.gsnr(gsnr)
            tb.wait()
        last.update(metrics=record, gsnr=gsnr)

    for _ in range(2):  # warm-up
        step(False)
        step(True)
    rng = random.Random(0)
    variants = ["off", "on", "off again"]  # "off again": what noise alone makes of a ratio
    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.reps):
        order = list(variants)
        rng.shuffle(order)
        for variant in order:
            t0, c0 = time.perf_counter(), time.process_time()
            step(variant == "on")
            wall[variant].append(time.perf_counter() - t0)
            cpu[variant].append(time.process_time() - c0)  # every thread of this process
    w = {v: statistics.median(ts) for v, ts in wall.items()}
    c = {v: statistics.median(ts) for v, ts in cpu.items()}
    n_scalars = len(scalars.metric_scalars(last["metrics"])) + len(
        scalars.gsnr_scalars(last["gsnr"])
    )
    print(
        f"demo model, G = {cfg.run.global_batch} ({cfg.run.accumulation_steps} x "
        f"{cfg.run.micro_batch}); {threads()} threads; {n_scalars} scalars per step; "
        f"median of {args.reps} steps each, interleaved"
    )
    print_table(
        ["variant", "wall ms", "wall ratio", "CPU ms", "CPU ratio"],
        [
            [f"TensorBoard {v}", w[v] * 1e3, w[v] / w["off"], c[v] * 1e3, c[v] / c["off"]]
            for v in variants
        ],
    )
    off = w["off"]

    # the writer's own work per step (on its thread), against the step it rides along
    events = EventFile(tmp / "tb-alone")
    n = 200
    t0 = time.perf_counter()
    for i in range(n):
        events.scalars(scalars.metric_scalars({**last["metrics"], "step": i}), time.time())
        events.scalars(scalars.gsnr_scalars({**last["gsnr"], "step": i}), time.time())
    writer = (time.perf_counter() - t0) / n
    events.close()
    tb.close()
    run_dir.close()
    print()
    print(
        f"writer alone: {writer * 1e3:.3f} ms per step's records "
        f"(1 + writer / step off = {1 + writer / off:.4f})"
    )


if __name__ == "__main__":
    main()
