"""Peak memory at a 16k and a 512k global batch with the same micro-batch, in one run.

Each global batch trains in a fresh process (so that the peaks do not mix) for ``--steps``
steps of the Kaggle-sized model (configs/synthetic_kaggle.yaml: 26 tables x 100k rows x 64)
with VR-Adam + GSNR row-wise Adagrad; the process reports its peak resident set size
(``ru_maxrss``). Activations scale with the micro-batch B; what grows with G is the step's
row accumulator — O(touched rows x D), bounded by the table sizes — so the ratio is reported
with the touched rows beside it. Target: peak(512k) / peak(16k) <= 1.15.

    python bench/memory.py [--micro-batch 8192] [--steps 1]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

from common import REPO, print_table, threads


def child(global_batch: int, micro_batch: int, steps: int) -> None:
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
        ],
    )
    trainer = Trainer(cfg)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(steps):
        trainer.train_step()
    touched = sum(t["touched_rows"] for t in trainer.sparse_opt.summary())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    total_rows = sum(trainer.splits.cardinalities)
    print(
        json.dumps(
            {
                "peak_mb": peak / 1024,
                "after_build_mb": base / 1024,
                "touched_rows": touched,
                "table_rows": total_rows,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batch", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.micro_batch, args.steps)
        return
    results = {}
    for g in (16_384, 524_288):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                str(g),
                "--micro-batch",
                str(args.micro_batch),
                "--steps",
                str(args.steps),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        results[g] = json.loads(out.stdout.strip().splitlines()[-1])
    small, large = results[16_384], results[524_288]
    rows = [
        [
            f"{g:,}",
            g // args.micro_batch,
            r["after_build_mb"],
            r["peak_mb"],
            f"{r['touched_rows']:,} of {r['table_rows']:,}",
        ]
        for g, r in results.items()
    ]
    print(
        f"Kaggle-sized DLRM, micro-batch B = {args.micro_batch}, {args.steps} step(s) each, "
        "VR-Adam + GSNR rowwise Adagrad"
    )
    print_table(
        [
            "global batch",
            "micro-batches",
            "RSS after build MB",
            "peak RSS MB",
            "rows touched in a step",
        ],
        rows,
    )
    print(f"\npeak RSS 512k / 16k: {large['peak_mb'] / small['peak_mb']:.3f}   (target <= 1.15)")


if __name__ == "__main__":
    main()
