"""Does a GPU train what the CPU trains? Both from the same weights, step by step, with every
table row held to the difference its step may show (``bench/gpu_check.py`` runs it).

Before each step the device trainer takes the CPU trainer's whole state (dense layers, tables,
row-wise sums, optimizer moments), so each step is compared from identical weights; both then
train the same micro-batches. Losses and dense layers must agree to float32 precision. Table rows
need not: row-wise Adagrad's first-update step has a norm of about ``lr·√D`` whatever the row's
gradient, so a row whose gradient is mostly cancellation turns the devices' small differences
in its terms (their GEMMs and atomics sum in other orders) into a direction difference
(tests/optim/test_sparse_amplification.py reproduces the pattern on one CPU). Each row is held to
:func:`~dlrm_vrgd.optim.sparse.step_difference_bound` of the two devices' own mean gradients and
ratios for it: a row over its bound is a bug, not rounding.

    python bench/device_agreement.py --device cuda       # also part of bench/gpu_check.py
    python bench/device_agreement.py --device cpu        # the same code on the CPU (exact)
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dlrm_vrgd.config import load_config  # noqa: E402
from dlrm_vrgd.optim.sparse import step_difference_bound  # noqa: E402
from dlrm_vrgd.train.loop import Trainer  # noqa: E402

#: VR-Adam and GSNR row-wise Adagrad on the demo's model and data, 8 groups of 1024 rows.
CHECK = [
    "optim.dense.name=vradam",
    "optim.dense.lr=0.002",
    "optim.sparse.name=gsnr_rowwise_adagrad",
    "optim.sparse.gamma=0.2",
    "run.global_batch=8192",
    "run.micro_batch=1024",
    "run.epochs=null",
    "run.steps=100",
    "run.tensorboard=false",
]
#: A row may exceed its bound by this factor (the bound is first-order) ...
BOUND_FACTOR = 1.5
#: ... plus a few float32 ulps of its weights.
ULPS = 4


def backend() -> str:
    try:
        import fbgemm_gpu  # noqa: F401
    except ImportError:
        return "torch"
    return "fbgemm"


def trainer(device: str, overrides: list[str]) -> Trainer:
    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        [*CHECK, f"model.embedding_backend={backend()}", *overrides, f"run.device={device}"],
    )
    t = Trainer(cfg)
    t.sparse_opt.record_rows = True
    return t


def compare(
    device: str,
    steps: int,
    overrides: list[str] | None = None,
    tamper: Callable[[Trainer], None] | None = None,
) -> tuple[list[dict], list[str]]:
    """Per step and table, the rows' differences against their bounds; and the problems.
    ``tamper`` (tests) alters the device trainer after it took the CPU's state."""
    cpu, dev = trainer("cpu", overrides or []), trainer(device, overrides or [])
    tables: list[dict[str, Any]] = []
    problems: list[str] = []
    for step in range(1, steps + 1):
        dev.load_state_dict(copy.deepcopy(cpu.state_dict()))  # identical weights, every step
        if tamper is not None:
            tamper(dev)
        a, b = cpu.train_step()["loss"], dev.train_step()["loss"]
        if abs(a - b) > 1e-5 * abs(a):
            problems.append(f"step {step}: loss cpu {a:.7f} vs {device} {b:.7f}")
        for (name, p), (_, q) in zip(
            cpu.model.named_dense_parameters(), dev.model.named_dense_parameters(), strict=True
        ):
            err = float((p.detach() - q.detach().cpu()).abs().max())
            if err > 1e-4 * max(1.0, float(p.detach().abs().max())):
                problems.append(f"step {step}: dense {name}: max |cpu - {device}| = {err:.2e}")
        lr_step = float(cpu.sparse_opt.param_groups[0]["lr"])  # the step's, after schedules
        for lk_cpu, lk_dev, rec_cpu, rec_dev in zip(
            cpu.lookups,
            dev.lookups,
            cpu.sparse_opt.last_rows,
            dev.sparse_opt.last_rows,
            strict=True,
        ):
            weights = zip(lk_cpu.table_weights(), lk_dev.table_weights(), strict=True)
            for name, (w_cpu, w_dev), x, y in zip(
                lk_cpu.table_names, weights, rec_cpu, rec_dev, strict=True
            ):
                if not torch.equal(x.rows, y.rows.cpu()):
                    problems.append(f"step {step}: {name}: the devices touched other rows")
                    continue
                rows = x.rows
                moved = torch.linalg.vector_norm(w_cpu[rows] - w_dev.cpu()[rows], dim=1)
                bound = step_difference_bound(
                    "rowwise_adagrad", lr_step, x.update, y.update.cpu(), x.ratio, y.ratio.cpu()
                )
                slack = (
                    ULPS
                    * torch.finfo(torch.float32).eps
                    * torch.linalg.vector_norm(w_cpu[rows], dim=1)
                )
                excess = moved / (BOUND_FACTOR * bound + slack).clamp_min(1e-30)
                worst = int(excess.argmax()) if rows.numel() else 0
                entry = {
                    "step": step,
                    "table": name,
                    "rows": rows.numel(),
                    "max_diff": float(moved.max()) if rows.numel() else 0.0,
                    "rows_over_1e-3": int((moved > 1e-3).sum()),
                    "max_diff_over_bound": float(excess.max()) if rows.numel() else 0.0,
                    "worst_rel_grad_diff": float(
                        (x.update[worst] - y.update[worst].cpu()).norm() / x.update[worst].norm()
                    )
                    if rows.numel()
                    else 0.0,
                }
                tables.append(entry)
                if entry["max_diff_over_bound"] > 1.0:
                    problems.append(
                        f"step {step}: {name}: a row moved {entry['max_diff']:.2e} apart, "
                        f"{entry['max_diff_over_bound']:.2f}x its bound"
                    )
    return tables, problems


def print_report(tables: list[dict], problems: list[str], device: str) -> None:
    from common import print_table

    last = max((t["step"] for t in tables), default=0)
    rows = [
        [
            t["table"],
            t["rows"],
            f"{t['max_diff']:.2e}",
            t["rows_over_1e-3"],
            f"{t['max_diff_over_bound']:.3f}",
            f"{t['worst_rel_grad_diff']:.1e}",
        ]
        for t in tables
        if t["step"] == last
    ]
    print(f"tables after step {last}, each step from identical weights (cpu vs {device}):")
    print_table(["table", "rows", "max |dw|", "> 1e-3", "max |dw| / bound", "its |dg|/|g|"], rows)
    worst = max((t["max_diff_over_bound"] for t in tables), default=0.0)
    print(f"largest row difference over its bound, every step: {worst:.3f} (must be <= 1)")
    for p in problems:
        print("MISMATCH", p)
    print("agreement:", "FAILED" if problems else "ok")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    tables, problems = compare(args.device, args.steps)
    print_report(tables, problems, args.device)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
