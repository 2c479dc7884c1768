"""Batch scoring: rows/s of `dlrm-vrgd score` with each engine beside `preprocess` alone and
beside each engine's forward alone, on the same rows, in one run; and peak RSS of `score` at two
input lengths.

A small model (configs' default ModelConfig: dim 16, MLPs 64-16 / 64-32-1) is trained for two
steps on generated rows, preprocessed with --max-rows-per-table 100000, and exported with
`--format onnx`. Then, on the same N fresh rows (bench/preprocess.py's generator, ~240 bytes a
line):

* preprocess: `dlrm-vrgd preprocess` of the TSV with the same cap (the parsing floor);
* forward torch / forward onnxruntime: the model alone on the N rows already in memory as
  arrays (the preprocessed days, mapped), --batch-rows at a time — the limit of scoring;
* score torch / score onnxruntime: `dlrm-vrgd score --engine ...` of the TSV (parse, map,
  forward, CSV output, metrics; a reader thread, parsing threads and the model overlap).

Medians over --reps interleaved runs. Targets: the faster score >= 0.8x the faster engine's
forward alone; score's peak RSS (a child process each, os.wait4's ru_maxrss) at 4N rows within
1.05x of N rows. Parsing and the forward each use every core, so on these cores scoring streams
at most at the rate of the two back to back (1 / (1/preprocess + 1/forward), printed): on 2 cores
that bound is below 0.8x of the forward whenever parsing is less than 4x as fast as the forward.
Score's time includes loading the model (every file hashed, ONNX Runtime's
session built: ~1-2 s for this 0.7 GB directory, whatever the input length), which the
forward alone does not: the rate after the load is printed too.

    python bench/score.py [--rows 400000] [--reps 3] [--cores 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from common import print_table
from preprocess import generate

from dlrm_vrgd.config import parse_config
from dlrm_vrgd.data.criteo.format import format_criteo_text
from dlrm_vrgd.data.criteo.preprocess import preprocess
from dlrm_vrgd.data.criteo.source import CriteoDays
from dlrm_vrgd.serve.export import export_model
from dlrm_vrgd.serve.features import FeatureMapper
from dlrm_vrgd.serve.model import load_scoring
from dlrm_vrgd.serve.score import score
from dlrm_vrgd.serve.score.engine import predictor
from dlrm_vrgd.train.loop import Trainer

CAP = 100_000
TARGET = 0.8
RSS_TARGET = 1.05
ENGINES = ("torch", "onnxruntime")


def train_model(root: Path, cores: int) -> Path:
    raw = root / "train_raw"
    raw.mkdir()
    for day in range(2):
        (raw / f"day_{day}").write_bytes(format_criteo_text(*generate(20_000, seed=100 + day)))
    data = root / "train_data"
    preprocess([raw], data, max_rows_per_table=CAP, workers=cores, progress=False)
    cfg = parse_config(
        {
            "data": {"source": "criteo", "path": str(data)},
            "run": {"global_batch": 4096, "micro_batch": 2048, "steps": 2, "eval_every": 0},
        }
    )
    trainer = Trainer(cfg)
    for _ in range(2):
        trainer.train_step()
    trainer.save_checkpoint(root / "run")
    export_model(root / "run", root / "model", program=False, onnx=True)
    return root / "model"


#: Started by a small Python: Linux keeps the high-water RSS of the address space a process
#: exec()s from (here a vfork of this large process) in its ru_maxrss, so measuring `score`
#: as our own child would report this process's RSS; the grandchild's is its own.
_MEASURE = """import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
err = p.stderr.read()
_, status, usage = os.wait4(p.pid, 0)
if status:
    sys.exit(err.decode()[-2000:])
print(usage.ru_maxrss)
"""


def peak_rss_mb(cmd: list[str]) -> float:
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd}: {proc.stderr[-2000:]}")
    return int(proc.stdout) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cores", type=int, default=2, help="CPUs to run on (sched_setaffinity)")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > args.cores:
        os.sched_setaffinity(0, cpus[: args.cores])
    cores = len(os.sched_getaffinity(0))
    root = Path(tempfile.mkdtemp(prefix="bench-score-"))
    try:
        model = train_model(root, cores)
        text = format_criteo_text(*generate(args.rows, seed=7))
        tsv = root / "day_0"
        tsv.write_bytes(text)
        print(
            f"{args.rows:,} rows, {len(text) / 1e6:,.0f} MB of TSV; {cores} cores, "
            f"median of {args.reps}"
        )
        days = root / "days"
        preprocess([tsv], days, max_rows_per_table=CAP, workers=cores, progress=False)
        scoring, layout, vocab = load_scoring(model)
        mapper = FeatureMapper(layout, vocab)
        (day,) = CriteoDays(days).days
        dense = np.array(day.dense[:], dtype=np.float32)
        sparse = mapper.day_ids(np.array(day.sparse[:], dtype=np.int64))
        batch_rows = 16_384
        forward = {
            e: predictor(model, scoring, e, "cpu", batch_rows, cores) for e in ENGINES
        }  # fmt: skip

        def run_preprocess() -> int:
            out = root / "pre"
            shutil.rmtree(out, ignore_errors=True)
            return preprocess([tsv], out, max_rows_per_table=CAP, workers=cores,
                              progress=False).rows  # fmt: skip

        def run_forward(engine: str) -> int:
            return len(forward[engine](dense, sparse))

        loads: dict[str, list[float]] = {e: [] for e in ENGINES}

        def run_score(engine: str) -> int:
            res = score(model, [tsv], root / "p.csv", overwrite=True, workers=cores,
                        progress=False, engine=engine, batch_rows=batch_rows)  # fmt: skip
            loads[engine].append(res.load_seconds)
            return res.rows

        variants: dict[str, Any] = {"preprocess": run_preprocess}
        for e in ENGINES:
            variants[f"forward {e}"] = partial(run_forward, e)
        for e in ENGINES:
            variants[f"score {e}"] = partial(run_score, e)
        wall: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.reps):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                rows = fn()
                wall[name].append(time.perf_counter() - t0)
                assert rows == args.rows, (name, rows)
        med = {name: statistics.median(w) for name, w in wall.items()}
        limit = min(med[f"forward {e}"] for e in ENGINES)
        table = [[name, w, args.rows / w, limit / w] for name, w in med.items()]
        print_table(["variant", "s", "rows/s", "x faster forward"], table)
        best = min(ENGINES, key=lambda e: med[f"score {e}"])
        ratio = limit / med[f"score {best}"]
        print(f"score ({best}) / faster forward alone: {ratio:.2f} (target >= {TARGET})")
        # the model's load (every file hashed, the engine built) is a fixed cost of a run,
        # whatever the input length; after it, scoring streams at this share of the forward
        for e in ENGINES:
            runs = zip(wall[f"score {e}"], loads[e], strict=True)
            stream = statistics.median(w - ld for w, ld in runs)
            print(f"score ({e}): model load {statistics.median(loads[e]):.2f} s; after it "
                  f"{args.rows / stream:,.0f} rows/s, x{limit / stream:.2f} of the faster "
                  f"forward, x{med[f'forward {e}'] / stream:.2f} of its own")  # fmt: skip
            # Parsing and the forward each keep every core busy, so on these cores a row costs
            # at least their sum: the most scoring can stream is the harmonic combination.
            bound = med["preprocess"] + med[f"forward {e}"]
            print(
                f"  bound on {cores} cores, preprocess + forward {e} back to back: "
                f"{args.rows / bound:,.0f} rows/s (x{limit / bound:.2f} of the faster "
                f"forward); after the load, score streams at x{bound / stream:.2f} of it"
            )
        print(f"score ({best}) / preprocess: {med['preprocess'] / med[f'score {best}']:.2f}")

        # peak RSS of `dlrm-vrgd score` at N and 4N rows (a process each, see _MEASURE)
        long = root / "day_long"
        with long.open("wb") as f:
            for _ in range(4):
                f.write(text)
        cli = [sys.executable, "-m", "dlrm_vrgd.cli", "score", "--model", str(model), "--engine",
               best, "--overwrite", "--no-progress", "--workers", str(cores)]  # fmt: skip
        rss = {
            n: peak_rss_mb([*cli, "--input", str(p), "--out", str(root / f"rss{n}.csv")])
            for n, p in ((args.rows, tsv), (4 * args.rows, long))
        }
        print_table(["score input rows", "peak RSS MB"], [[f"{n:,}", mb] for n, mb in rss.items()])
        a, b = rss.values()
        print(f"peak RSS 4N / N ({best}): {b / a:.3f} (target <= {RSS_TARGET})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
