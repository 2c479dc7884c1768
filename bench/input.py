"""The input pipeline: how fast each row source feeds micro-batches, built serially, by threads
and by worker processes; and how long a CPU training step waits for its input.

Sources, in the Kaggle shape of configs/synthetic_kaggle.yaml (13 dense, 26 tables):

* ``synthetic``: live planted-signal rows (the generator: its teacher's logits per row);
* ``generated_npy``: the same rows written once by ``dlrm-vrgd generate`` (day files, read
  through ``data.source: criteo``); the generation's own rows/s is reported too;
* ``criteo_npy``: a raw Criteo TSV written here (random values in Criteo's format), turned
  into day files by the project's ``preprocess``.

Part 1, the input alone: ``--keys`` micro-batches of ``--micro-batch`` rows through an
:class:`~dlrm_vrgd.data.pipeline.InputPipeline` with no step behind it, per builder: rows/s
(wall) and CPU µs per row (this process's CPU time plus its workers', over the rows: what the
rows cost, including the hand-off between threads or processes).

Part 2, the trainer: ``--steps`` steps of the Kaggle-sized DLRM on a CPU
(``--train-micro-batch`` x ``--k`` rows a step) from the generated day files and from live
synthetic data, each with the input serial and with the default pipeline (one thread on a
CPU); the share of the step spent waiting for input (``data_wait_s`` over ``step_seconds``,
the first step left out). Target: <= 5% from the day files with the pipeline on.

Part 3, multi-hot (issue 46): micro-batches of MLPerf DLRMv2's bags (214 ids a row) built from
one-hot day files (MLPerf's preprocessed layout, written here) by MLPerf's synthesis as they are
read (``data.multi_hot_sizes``), tables capped at ``--multi-hot-cap`` rows (MLPerf's own caps
need 23 GB of lookup tables). One thread, serially: CPU µs a row of reading the one-hot rows,
of making them multi-hot in the KJT's table order straight into the int32 slot a GPU run copies
from (dense and labels included), or into a CPU run's int64 batch, and of that batch's
KeyedJaggedTensor (static offsets, no reorder); then through the pipeline's thread builder.
Target: <= 1 CPU µs a row for read + synthesis into the slot.

    python bench/input.py [--micro-batch 65536] [--keys 12] [--workers 2] [--steps 5]
                          [--multi-hot-only] [--multi-hot-cap 1000000] [--json PATH]

The micro-batch of part 1 is the GPU's (64k rows: 8 synthetic chunks). A key's rows start
wherever the stream is, so a micro-batch straddles one more source block than it covers; built
by another worker than its neighbour, that block is generated twice: at 64k rows 9 chunks for
8 (+12.5% of the synthetic CPU per row), at ``B = chunk_rows`` twice the work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from common import REPO, print_table, threads, write_result

from dlrm_vrgd.config import CriteoData, InputConfig, TrainConfig, load_config, parse_config
from dlrm_vrgd.data import build_splits
from dlrm_vrgd.data.batch import TrainStream
from dlrm_vrgd.data.criteo.preprocess import preprocess
from dlrm_vrgd.data.export import generate_days
from dlrm_vrgd.data.multihot import MLPERF_MULTI_HOT_SIZES, MLPERF_NUM_EMBEDDINGS, bags_of
from dlrm_vrgd.data.pipeline import InputPipeline, Layout, rank_keys, resolve_plan
from dlrm_vrgd.data.pipeline.plan import block_affinity
from dlrm_vrgd.data.pipeline.slots import PinnedSlots
from dlrm_vrgd.data.rows import Rows, RowSource

BUILDERS = ("serial", "threads", "processes")


def kaggle(train_rows: int, val_rows: int, *sets: str) -> TrainConfig:
    return load_config(
        REPO / "configs" / "synthetic_kaggle.yaml",
        [
            f"data.train_rows={train_rows}",
            f"data.val_rows={val_rows}",
            f"data.test_rows={val_rows}",
            "run.epochs=null",
            "run.steps=1000",
            *sets,
        ],
    )


def criteo_tsv(path: Path, rows: int, seed: int = 0) -> None:
    """``rows`` lines of Criteo's raw format: label, 13 integer counts (a fifth missing), 26
    eight-digit hex ids (a tenth missing), tab-separated."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for start in range(0, rows, 10_000):
            n = min(10_000, rows - start)
            labels = rng.random(n) < 0.25
            ints = np.floor(np.exp(rng.normal(1.5, 1.2, (n, 13)))).astype(np.int64)
            ints_missing = rng.random((n, 13)) < 0.2
            ids = rng.integers(0, 2**32, (n, 26), dtype=np.uint64)
            ids = ids % (np.uint64(1) + rng.integers(10, 200_000, 26).astype(np.uint64))
            ids_missing = rng.random((n, 26)) < 0.1
            lines = []
            for i in range(n):
                cells = [str(int(labels[i]))]
                cells += ["" if ints_missing[i, j] else str(ints[i, j]) for j in range(13)]
                cells += ["" if ids_missing[i, j] else f"{int(ids[i, j]):08x}" for j in range(26)]
                lines.append("\t".join(cells))
            f.write("\n".join(lines) + "\n")


def sources(
    tmp: Path, rows: int, criteo_rows: int, workers: int
) -> tuple[dict[str, RowSource], dict[str, float]]:
    """The three train sources, and the generation's figures."""
    cfg = kaggle(rows, 65_536)
    live = build_splits(cfg.data).train
    live.read(0, 1)  # the teacher, calibrated once (forked workers inherit it)
    t0 = time.perf_counter()
    gen = generate_days(cfg, tmp / "generated", workers=workers, progress=False)
    gen_s = time.perf_counter() - t0
    generated = build_splits(
        CriteoData(path=tmp / "generated", shuffle_block_rows=cfg.data.chunk_rows)  # type: ignore[union-attr]
    ).train
    raw = tmp / "criteo.tsv"
    criteo_tsv(raw, criteo_rows)
    preprocess(
        [raw],
        tmp / "criteo",
        max_rows_per_table=100_000,
        split=[0.9, 0.05, 0.05],
        workers=workers,
        progress=False,
    )
    criteo = build_splits(CriteoData(path=tmp / "criteo")).train
    figures = {"rows": gen.rows, "seconds": gen_s, "rows_per_s": gen.rows / gen_s}
    return {"synthetic": live, "generated_npy": generated, "criteo_npy": criteo}, figures


def workers_cpu(pipe: InputPipeline) -> float:
    """CPU seconds the pipeline's worker processes used so far (/proc; 0 without any)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in getattr(pipe.builder, "pids", []):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def feed(source: RowSource, builder: str, b: int, keys: int, workers: int) -> dict[str, float]:
    """Rows/s and CPU µs per row of ``keys`` micro-batches through a pipeline, nothing else;
    the first one (the pipeline's start: threads, forks, first reads) is left out."""
    stream = TrainStream(source, global_batch=b, micro_batch=b, seed=0)
    plan = resolve_plan(
        InputConfig(builder=builder, workers=workers if builder != "threads" else 1),  # type: ignore[arg-type]
        "synthetic",
        "cpu",
        os.cpu_count() or 1,
    )

    def schedule(key: tuple[int, int]) -> Iterator[tuple[int, int]]:
        return rank_keys(key, 0, 1, keys)

    layout = Layout(b, source.num_dense, len(source.cardinalities), bags_of(source))
    affinity = block_affinity(b, b, source.block_rows)
    pipe = InputPipeline(stream.rows, layout, torch.device("cpu"), plan, schedule, affinity)
    try:
        pipe.get((0, 0))
        cpu0, kids0, t0 = time.process_time(), workers_cpu(pipe), time.perf_counter()
        for step in range(1, keys):
            batch = pipe.get((step, 0))
            assert len(batch) == b
            del batch
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0 + workers_cpu(pipe) - kids0
    finally:
        pipe.close()
    rows = (keys - 1) * b
    return {"rows_per_s": rows / wall, "cpu_us_per_row": 1e6 * cpu / rows, "seconds": wall}


def trainer_wait(
    path: Path | None, rows: int, b: int, k: int, steps: int, builder: str
) -> dict[str, float]:
    """Steps of the Kaggle-sized model from the generated days at ``path`` (None: live
    synthetic rows): median step and wait, and the wait's share of the step time (first step
    left out)."""
    from dlrm_vrgd.train.loop import Trainer

    raw = kaggle(rows, 65_536).to_dict()
    if path is not None:
        chunk = raw["data"]["chunk_rows"]
        raw["data"] = {"source": "criteo", "path": str(path), "shuffle_block_rows": chunk}
    raw["run"].update(
        global_batch=b * k, micro_batch=b, steps=steps + 1, input={"builder": builder}
    )
    trainer = Trainer(parse_config(raw))
    try:
        records = [trainer.train_step() for _ in range(steps + 1)][1:]
    finally:
        trainer.close_input()
    step = [r["step_seconds"] for r in records]
    wait = [r["data_wait_s"] for r in records]
    return {
        "steps": len(records),
        "step_s": statistics.median(step),
        "wait_s": statistics.median(wait),
        "wait_share": sum(wait) / sum(step),
        "max_wait_share": max(w / s for w, s in zip(wait, step, strict=True)),
    }


def mlperf_onehot_days(path: Path, rows: int, days: int = 3, seed: int = 0) -> None:
    """MLPerf's preprocessed one-hot layout (no manifest): int32 ids spread over each table's
    full MLPerf range (read modulo the caps), float32 dense, int32 labels."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    high = np.asarray(MLPERF_NUM_EMBEDDINGS, dtype=np.int64)
    for i in range(days):
        ids = (rng.random((rows, 26)) * high).astype(np.int32)
        np.save(path / f"day_{i}_sparse.npy", ids)
        np.save(path / f"day_{i}_dense.npy", rng.random((rows, 13), dtype=np.float32))
        np.save(path / f"day_{i}_labels.npy", rng.integers(0, 2, (rows, 1), dtype=np.int32))


def multi_hot(tmp: Path, b: int, keys: int, cap: int, workers: int) -> dict[str, float]:
    """Part 3 (module docstring): CPU µs a row of building multi-hot micro-batches."""
    from dlrm_vrgd.data.batch import Batch
    from dlrm_vrgd.data.criteo.source import criteo_splits

    rows = b * keys // 2 + 1  # two train days hold the keys' rows
    mlperf_onehot_days(tmp / "mlperf", rows)
    caps = [min(c, cap) for c in MLPERF_NUM_EMBEDDINGS]
    t0 = time.perf_counter()
    source = criteo_splits(
        CriteoData(
            path=tmp / "mlperf",
            max_rows_per_table=caps,
            multi_hot_sizes=list(MLPERF_MULTI_HOT_SIZES),
        )
    ).train
    tables_s = time.perf_counter() - t0
    onehot = source.base  # type: ignore[attr-defined]
    keys_ = [f"cat_{i}" for i in range(26)]
    spans = [(i * b, (i + 1) * b) for i in range(keys)]
    # once before timing: page the day files in (the figure is CPU, not the disk) and import
    # torchrec (2 s: the first KJT)
    Batch.from_rows(source.read(*spans[0])).kjt(keys_)
    slots = PinnedSlots(Layout(b, 13, 26, source.bags), 1, pin=False)
    tables = source.tables  # type: ignore[attr-defined]
    parts = {"read": 0.0, "slot": 0.0, "batch": 0.0, "kjt": 0.0}
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: process_time is this thread's CPU
    try:
        for a, z in spans:
            c0 = time.process_time()
            one = onehot.read(a, z)
            rows_ = Rows(one.dense, one.sparse, one.labels, bags=source.bags, hot=tables)
            c1 = time.process_time()
            slots.fill(0, rows_)  # synthesis into the pinned int32 slot a GPU run copies from
            c2 = time.process_time()
            batch = Batch.from_rows(rows_)  # a CPU run: synthesis into its int64 batch
            c3 = time.process_time()
            kjt = batch.kjt(keys_)  # the ids are in table order already: no reorder
            c4 = time.process_time()
            assert kjt.values().numel() == b * 214
            parts["read"] += c1 - c0
            parts["slot"] += c2 - c1
            parts["batch"] += c3 - c2
            parts["kjt"] += c4 - c3
    finally:
        torch.set_num_threads(torch_threads)
    n = keys * b
    out = {f"{k}_us_per_row": 1e6 * v / n for k, v in parts.items()}
    out["gpu_feed_us_per_row"] = out["read_us_per_row"] + out["slot_us_per_row"]
    out["cpu_run_us_per_row"] = (
        out["read_us_per_row"] + out["batch_us_per_row"] + out["kjt_us_per_row"]
    )
    out["tables_s"] = tables_s
    out["cap"] = cap
    out["threads"] = {  # the whole micro-batch (rows read and made multi-hot) by one thread
        k: v for k, v in feed(source, "threads", b, keys, workers).items()
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batch", type=int, default=65536)
    ap.add_argument("--keys", type=int, default=12, help="micro-batches per source and builder")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (and generation)")
    ap.add_argument("--rows", type=int, default=800_000, help="train rows: synthetic, generated")
    ap.add_argument("--criteo-rows", type=int, default=200_000, help="rows of the raw TSV")
    ap.add_argument("--train-micro-batch", type=int, default=4096)
    ap.add_argument("--k", type=int, default=8, help="micro-batches per training step")
    ap.add_argument("--steps", type=int, default=5, help="training steps measured (part 2)")
    ap.add_argument("--json", help="write the figures here (bench/run_all.py --save)")
    ap.add_argument("--multi-hot-only", action="store_true", help="part 3 only")
    ap.add_argument("--multi-hot-cap", type=int, default=1_000_000, help="table cap, part 3")
    args = ap.parse_args()
    torch.set_num_threads(threads())
    with tempfile.TemporaryDirectory(prefix="dlrm-vrgd-input-") as tmp:
        hot = multi_hot(Path(tmp), args.micro_batch, args.keys, args.multi_hot_cap, args.workers)
    print(
        f"Part 3: multi-hot micro-batches of {args.micro_batch:,} rows (MLPerf's 214 ids a "
        f"row) from one-hot days, tables capped at {hot['cap']:,} rows (drawn in "
        f"{hot['tables_s']:.1f} s); one thread, CPU us a row:"
    )
    print_table(
        ["read one-hot", "synthesis -> int32 slot", "synthesis -> int64 batch", "KJT (CPU run)",
         "thread builder rows/s", "its CPU us/row"],
        [[hot["read_us_per_row"], hot["slot_us_per_row"], hot["batch_us_per_row"],
          hot["kjt_us_per_row"], hot["threads"]["rows_per_s"],
          hot["threads"]["cpu_us_per_row"]]],
    )  # fmt: skip
    print(
        f"multi-hot micro-batch from one-hot days into a GPU run's int32 slot (read + "
        f"synthesis in table order): {hot['gpu_feed_us_per_row']:.2f} CPU us a row (target "
        f"<= 1); a CPU run's int64 batch with its KJT {hot['cpu_run_us_per_row']:.2f}"
    )
    if args.multi_hot_only:
        write_result(args.json, "input_multi_hot", {"micro_batch": args.micro_batch, **hot})
        return
    with tempfile.TemporaryDirectory(prefix="dlrm-vrgd-input-") as tmp:
        srcs, generation = sources(Path(tmp), args.rows, args.criteo_rows, args.workers)
        print(
            f"generate: {generation['rows']:,} rows in {generation['seconds']:.1f} s "
            f"({generation['rows_per_s']:,.0f} rows/s, {args.workers} processes)"
        )
        figures: dict[str, dict[str, dict[str, float]]] = {}
        for name, src in srcs.items():
            figures[name] = {}
            for builder in BUILDERS:
                fresh = src.gen.source("train") if name == "synthetic" else src  # type: ignore[attr-defined]
                figures[name][builder] = feed(
                    fresh, builder, args.micro_batch, args.keys, args.workers
                )
        table = [
            [name, builder, f["rows_per_s"], f["cpu_us_per_row"]]
            for name, by in figures.items()
            for builder, f in by.items()
        ]
        print(
            f"\nPart 1: {args.keys} micro-batches of {args.micro_batch:,} rows per source, no "
            f"step behind them ({args.workers} processes, 1 thread)"
        )
        print_table(["source", "builder", "rows/s", "CPU us/row"], table)
        days = {"generated_npy": Path(tmp) / "generated", "synthetic": None}
        trainer = {
            name: {
                builder: trainer_wait(
                    path, args.rows, args.train_micro_batch, args.k, args.steps, builder
                )
                for builder in ("serial", "threads")
            }
            for name, path in days.items()
        }
    print(
        f"\nPart 2: the Kaggle-sized DLRM on {threads()} CPU threads, {args.k} x "
        f"{args.train_micro_batch:,} rows a step, {args.steps} steps after one (medians)"
    )
    print_table(
        ["source", "input", "s / step", "wait s / step", "wait share", "worst step's share"],
        [
            [name, b, f["step_s"], f["wait_s"], f"{f['wait_share']:.2%}",
             f"{f['max_wait_share']:.2%}"]
            for name, by in trainer.items()
            for b, f in by.items()
        ],
    )  # fmt: skip
    share = trainer["generated_npy"]["threads"]["wait_share"]
    print(f"\nwait share from the day files with the pipeline on: {share:.2%}   (target <= 5%)")
    write_result(
        args.json,
        "input",
        {
            "micro_batch": args.micro_batch,
            "keys": args.keys,
            "workers": args.workers,
            "rows": args.rows,
            "criteo_rows": args.criteo_rows,
            "generate": generation,
            "sources": figures,
            "multi_hot": hot,
            "trainer": {
                "micro_batch": args.train_micro_batch,
                "k": args.k,
                "threads": threads(),
                **trainer,
            },
        },
    )


if __name__ == "__main__":
    main()
