"""Where one global step's time goes, part by part, with the device synchronised around each part
(``bench/gpu_check.py`` prints it for plain and VR on a GPU). The micro-batches are built once
and reused, so the input pipeline is not timed: this is the model-bound step.

Parts, as ``Trainer.train_step`` runs them: forward (the ``A`` micro-batches' forward and loss,
under the run's precision), backward, dense collect, sparse collect (the captured pooled
gradients to per-row sums), dense step, sparse step, and the rest (the loss read-back, the noise
scale, the finiteness check). Synchronising costs a little: the parts add up to more than an
unsynchronised step, which the table gives beside them.

    python bench/step_breakdown.py --device cpu [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dlrm_vrgd.config import load_config  # noqa: E402
from dlrm_vrgd.data.batch import Batch  # noqa: E402
from dlrm_vrgd.train.loop import Trainer  # noqa: E402

PARTS = (
    "forward",
    "backward",
    "dense collect",
    "sparse collect",
    "dense step",
    "sparse step",
    "rest",
)

PLAIN = ["optim.dense.name=adamw", "optim.sparse.name=rowwise_adagrad"]
VR = ["optim.dense.name=vradam", "optim.sparse.name=gsnr_rowwise_adagrad"]


def prebuilt(trainer: Trainer) -> Callable[[int, int], Batch]:
    """The trainer's micro-batches of step 0, built once and kept on its device."""
    batches = [trainer.micro_batch(0, j) for j in range(trainer.A)]
    return lambda step, j: batches[j]


def timed_step(trainer: Trainer, batch: Callable[[int, int], Batch]) -> dict[str, float]:
    """One global step of ``trainer`` on ``batch(step, j)``, its parts timed (seconds)."""
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    parts = dict.fromkeys(PARTS, 0.0)

    def run(part: str, fn: Callable[[], object]) -> object:
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        parts[part] += time.perf_counter() - t0
        return out

    step = trainer.step
    trainer.set_learning_rates(step)
    trainer.model.train()
    trainer.sparse_opt.measure_steps = True  # the default gsnr_every: 1 measures every step
    if hasattr(trainer.dense_opt, "measure_steps"):
        trainer.dense_opt.measure_steps = True
    losses = []
    for j in range(trainer.A):
        mb = batch(step, j)

        def forward(mb: Batch = mb) -> torch.Tensor:
            with trainer.autocast():
                loss, _ = trainer.model.loss(mb)
            return loss

        loss = run("forward", forward)
        run("backward", loss.backward)  # type: ignore[union-attr]
        run("dense collect", trainer.dense_opt.collect)
        run("sparse collect", trainer.sparse_opt.collect)
        losses.append(loss.detach())  # type: ignore[union-attr]
    run("rest", lambda: float(torch.stack(losses).mean()))
    run("dense step", trainer.dense_opt.step)
    run("sparse step", trainer.sparse_opt.step)

    def rest() -> None:
        trainer.noise.update(trainer.dense_opt.noise_pieces(), trainer.sparse_opt.noise_pieces())
        trainer.check_finite(step + 1, tables=False)

    run("rest", rest)
    trainer.step += 1
    return parts


def whole_step(trainer: Trainer, batch: Callable[[int, int], Batch]) -> float:
    """One unsynchronised step (then one synchronisation), as the trainer runs it."""
    trainer.micro_batch = batch  # type: ignore[method-assign]
    t0 = time.perf_counter()
    trainer.train_step()
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def breakdown(trainer: Trainer, steps: int) -> dict[str, float]:
    """Median seconds of each part over ``steps`` steps (after one warm-up), and ``whole``."""
    batch = prebuilt(trainer)
    timed_step(trainer, batch)  # warm-up: allocations, kernels, the views
    runs = [timed_step(trainer, batch) for _ in range(steps)]
    out = {p: statistics.median(r[p] for r in runs) for p in PARTS}
    out["sum of parts"] = sum(out[p] for p in PARTS)
    out["whole"] = statistics.median(whole_step(trainer, batch) for _ in range(steps))
    return out


def trainer(device: str, overrides: list[str], config: str) -> Trainer:
    cfg = load_config(
        REPO / "configs" / config,
        [*overrides, f"run.device={device}", "run.epochs=null", "run.steps=1000"],
    )
    return Trainer(cfg)


def main() -> None:
    from common import print_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--config", default="synthetic_kaggle.yaml")
    ap.add_argument("--global-batch", type=int, default=524_288)
    ap.add_argument("--micro-batch", type=int, default=65_536)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="8 x 1,024 rows (for a CPU)")
    args = ap.parse_args()
    g, b = (8192, 1024) if args.quick else (args.global_batch, args.micro_batch)
    size = [f"run.global_batch={g}", f"run.micro_batch={b}", f"data.train_rows={4 * g}"]
    results = {}
    for name, opts in (("plain", PLAIN), ("VR", VR)):
        results[name] = breakdown(trainer(args.device, [*opts, *size], args.config), args.steps)
    print(f"{g:,}-row step = {g // b} x {b:,} on {args.device}, seconds (median of {args.steps}):")
    print_table(
        ["part", "plain", "VR", "VR / plain"],
        [
            [
                p,
                results["plain"][p],
                results["VR"][p],
                results["VR"][p] / max(results["plain"][p], 1e-12),
            ]
            for p in [*PARTS, "sum of parts", "whole"]
        ],
    )


if __name__ == "__main__":
    main()
