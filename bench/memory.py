"""Peak memory at a 16k and a 512k global batch with the same micro-batch, in one run.

Each (global batch, allocator setting) trains in a fresh process (so peaks do not mix) for
``--steps`` steps of the Kaggle-sized model (configs/synthetic_kaggle.yaml: 26 tables x 100k
rows x 64) with VR-Adam + GSNR row-wise Adagrad, and reports its peak resident set size
(``ru_maxrss``) and step time. Activations scale with the micro-batch B; what grows with G is
the step's touched-row sums — O(touched rows x D), bounded by the table sizes — and, with
glibc's adaptive allocator, heap fragmentation over many micro-batches; a fixed mmap threshold
(``run.malloc_mmap_threshold_kb``, train/malloc.py) removes the latter at a cost in speed.
Both settings are measured. Target: peak(512k) / peak(16k) <= 1.15.

    python bench/memory.py [--micro-batch 8192] [--steps 1]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from common import REPO, print_table, threads

SETTINGS = {"glibc adaptive (default)": 0, "mmap threshold 128 KiB": 128}


def child(global_batch: int, micro_batch: int, steps: int, threshold_kb: int) -> None:
    import torch

    from dlrm_vrgd.config import load_config
    from dlrm_vrgd.train.loop import Trainer

    torch.set_num_threads(threads())
    cfg = load_config(
        REPO / "configs" / "synthetic_kaggle.yaml",
        [
            f"run.global_batch={global_batch}",
            f"run.micro_batch={micro_batch}",
            "run.epochs=null",
            f"run.steps={steps}",
            "optim.dense.name=vradam",
            "optim.sparse.name=gsnr_rowwise_adagrad",
            f"run.malloc_mmap_threshold_kb={threshold_kb}",
        ],
    )
    trainer = Trainer(cfg)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    seconds = (time.perf_counter() - t0) / steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "peak_mb": peak / 1024,
                "after_build_mb": base / 1024,
                "step_s": seconds,
                "touched_rows": sum(t["touched_rows"] for t in trainer.sparse_opt.summary()),
                "table_rows": sum(trainer.splits.cardinalities),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batch", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--threshold-kb", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.micro_batch, args.steps, args.threshold_kb)
        return
    b = args.micro_batch
    results: dict[tuple[str, int], dict] = {}
    for label, kb in SETTINGS.items():
        for g in (16_384, 524_288):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    str(g),
                    "--micro-batch",
                    str(b),
                    "--steps",
                    str(args.steps),
                    "--threshold-kb",
                    str(kb),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            results[(label, g)] = json.loads(out.stdout.strip().splitlines()[-1])
    rows = [
        [
            label,
            f"{g:,}",
            g // b,
            r["after_build_mb"],
            r["peak_mb"],
            r["step_s"] / (g // b),
            f"{r['touched_rows']:,} of {r['table_rows']:,}",
        ]
        for (label, g), r in results.items()
    ]
    print(
        f"Kaggle-sized DLRM, micro-batch B = {b:,}, {args.steps} step(s) each, VR-Adam + "
        f"GSNR rowwise Adagrad, {threads()} threads"
    )
    print_table(
        [
            "allocator",
            "global batch",
            "micro-batches",
            "RSS after build MB",
            "peak RSS MB",
            "s per micro-batch",
            "rows touched in a step",
        ],
        rows,
    )
    print()
    for label in SETTINGS:
        small, large = results[(label, 16_384)], results[(label, 524_288)]
        print(
            f"{label}: peak RSS 512k / 16k = {large['peak_mb'] / small['peak_mb']:.3f}   "
            "(target <= 1.15)"
        )


if __name__ == "__main__":
    main()
