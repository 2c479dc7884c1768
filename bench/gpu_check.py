"""Checks and timings for a GPU host without torchrec/FBGEMM (run by bench/gpu_check.sh).

1. The pure-PyTorch embedding backend and dense VRGD on the device agree with the CPU: the
   same model (torch backend, VR-LAMB dense + GSNR row-wise Adagrad sparse) trained for a few
   steps on both, losses / dense parameters / tables compared; then each VR optimizer alone on
   random gradient groups.
2. A 512k global batch step on the device: rows/s and peak device memory.

    python bench/gpu_check.py --device cuda          # the real check (H200: well under 5 min)
    python bench/gpu_check.py --device cpu --quick   # the same code paths, small, on a CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dlrm_vrgd.config import load_config  # noqa: E402
from dlrm_vrgd.optim.vrgd import VRLAMB, VRLARS, VRSGD, VRAdam  # noqa: E402
from dlrm_vrgd.train.loop import Trainer  # noqa: E402

CHECK = [
    "model.embedding_backend=torch",
    "optim.dense.name=vrlamb",
    "optim.dense.lr=0.01",
    "optim.sparse.name=gsnr_rowwise_adagrad",
    "optim.sparse.gamma=0.2",
    "run.global_batch=8192",
    "run.micro_batch=1024",
    "run.epochs=null",
    "run.steps=100",
]


def trainer(device: str, overrides: list[str], config: str = "demo.yaml") -> Trainer:
    cfg = load_config(REPO / "configs" / config, [*overrides, f"run.device={device}"])
    return Trainer(cfg)


def check_model(device: str, steps: int) -> list[str]:
    cpu, dev = trainer("cpu", CHECK), trainer(device, CHECK)
    problems = []
    for s in range(steps):
        a, b = cpu.train_step()["loss"], dev.train_step()["loss"]
        if abs(a - b) > 1e-4 * abs(a):
            problems.append(f"step {s + 1}: loss cpu {a:.6f} vs {device} {b:.6f}")
    for (name, p), (_, q) in zip(
        cpu.model.named_dense_parameters(), dev.model.named_dense_parameters(), strict=True
    ):
        err = float((p.detach() - q.detach().cpu()).abs().max())
        if err > 1e-3 * max(1.0, float(p.abs().max())):
            problems.append(f"dense {name}: max |cpu - {device}| = {err:.2e}")
    for a, b in zip(cpu.lookups[0].table_weights(), dev.lookups[0].table_weights(), strict=True):
        err = float((a - b.cpu()).abs().max())
        if err > 1e-3:
            problems.append(f"table: max |cpu - {device}| = {err:.2e}")
    return problems


def check_optimizers(device: str) -> list[str]:
    problems = []
    for cls in (VRSGD, VRAdam, VRLARS, VRLAMB):
        results = []
        for dev in ("cpu", device):
            g = torch.Generator().manual_seed(0)
            w = torch.nn.Parameter(torch.randn(64, 32, generator=g).to(dev))
            opt = cls([w], lr=0.01, gamma=0.2)
            for _ in range(3):
                signal = torch.randn(64, 32, generator=g)
                for _ in range(8):
                    w.grad = (signal + torch.randn(64, 32, generator=g)).to(dev)
                    opt.collect()
                opt.step()
            results.append(w.detach().cpu())
        err = float((results[0] - results[1]).abs().max())
        if err > 1e-5:
            problems.append(f"{cls.__name__}: max |cpu - {device}| = {err:.2e}")
    return problems


def time_big_step(device: str, global_batch: int, micro_batch: int, steps: int) -> None:
    overrides = [
        "model.embedding_backend=torch",
        "optim.dense.name=vradam",
        "optim.sparse.name=gsnr_rowwise_adagrad",
        f"run.global_batch={global_batch}",
        f"run.micro_batch={micro_batch}",
        "run.epochs=null",
        "run.steps=100",
        "data.train_rows=2000000",
        "data.val_rows=10000",
        "data.test_rows=10000",
    ]
    t = trainer(device, overrides, "synthetic_kaggle.yaml")
    t.train_step()  # warm-up (allocations, kernels)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        t.train_step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    best = min(times)
    print(
        f"global batch {global_batch:,} = {global_batch // micro_batch} x {micro_batch:,} on "
        f"{device}: {best:.2f} s/step, {global_batch / best:,.0f} rows/s"
    )
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"peak device memory: {peak:.2f} GiB ({torch.cuda.get_device_name()})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="small sizes (for a CPU)")
    args = ap.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("no CUDA device; run with --device cpu for the CPU form")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    print(f"torch {torch.__version__}; checking the torch backend and dense VRGD on {args.device}")
    problems = check_model(args.device, steps=2 if args.quick else 3)
    problems += check_optimizers(args.device)
    for p in problems:
        print("MISMATCH", p)
    print("agreement with CPU:", "FAILED" if problems else "ok")
    if args.quick:
        time_big_step(args.device, 65_536, 8_192, steps=1)
    else:
        time_big_step(args.device, 524_288, 65_536, steps=3)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
