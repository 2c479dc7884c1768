"""The GPU check: agreement with the CPU, then where a 512k step's time goes end to end.

One command on a CUDA host (<= 8 minutes on one H200), in sections, each a function of its
own (:data:`SECTIONS`; ``--only`` picks some). Every section runs whatever the ones before it
did: one that raises is printed with its traceback and recorded in ``--json`` as its ``error``
and ``traceback`` (the file is rewritten after every section), and the exit status is 1 at the
end if any section failed or the agreement did not hold.

1. ``agreement``: the device against the CPU from identical weights, step by step
   (bench/device_agreement.py: the device takes the CPU trainer's whole state before every
   step; losses and dense layers to float32 precision; every table row's mean gradient, ratio,
   row-wise state and weights held to float32 rounding by tolerances from the CPU's side
   alone; a breakdown per table), on FBGEMM's tables when they import; then each VR optimizer
   alone on random gradient groups.
2. ``syncs`` (CUDA only; skipped on a CPU): one model-bound step of the Kaggle-sized DLRM at
   8 x 8k rows, plain and VR, under ``torch.cuda.set_sync_debug_mode("warn")``: the host syncs
   it saw, counted per Python line that called the op.
3. ``throughput``: the Kaggle-sized DLRM (configs/synthetic_kaggle.yaml) at 8 x 64k rows a
   step, plain (AdamW + row-wise Adagrad) and VR (VR-Adam + GSNR row-wise Adagrad), on
   FBGEMM's tables when ``fbgemm_gpu`` and torchrec import (the pure-PyTorch tables when not),
   each fed three ways: micro-batches built once and reused (*model-bound*), the trainer's own
   input pipeline from day files written by ``dlrm-vrgd generate`` (*npy*), and from live
   synthetic data (*live*). One table: s / step, rows/s, the share of the model-bound rate,
   ``data_wait_s`` per step and peak memory. Targets: npy >= 0.9 x model-bound, live >= 0.5 x.
4. ``breakdown``: where a model-bound 8 x 64k step's time goes, plain beside VR, the device
   synchronised around each part (bench/step_breakdown.py). Target: VR / plain <= 1.10.
5. ``nvidia``: NVIDIA's DLRM shape on Kaggle (configs/nvidia_dlrm_kaggle.yaml: 33.8M table
   rows x 128, MLPs 512-256-128 / 1024-1024-512-256-1) at batch 64k, model-bound, plain, in
   fp32, tf32 and bf16, and bf16 with fp16 tables. NVIDIA's figure: 4.02M rows/s on one A100
   (AMP); target >= 4.02M with bf16.

    python bench/gpu_check.py                          # the real check (--device cuda)
    python bench/gpu_check.py --device cpu --quick     # the same code paths, small, on a CPU
    python bench/gpu_check.py --only throughput --json out.json
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
# torchrec's import trips torch.fx's "is_fx_tracing" notice; it says nothing about our runs
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

from dlrm_vrgd.config import TrainConfig, load_config, parse_config  # noqa: E402
from dlrm_vrgd.optim.vrgd import VRLAMB, VRLARS, VRSGD, VRAdam  # noqa: E402
from dlrm_vrgd.train.loop import Trainer  # noqa: E402

OPTIMIZERS = {
    "plain": ["optim.dense.name=adamw", "optim.sparse.name=rowwise_adagrad"],
    "VR": ["optim.dense.name=vradam", "optim.sparse.name=gsnr_rowwise_adagrad"],
}
#: The end-to-end targets, as shares of the model-bound rate.
TARGETS = {"npy": 0.9, "live": 0.5}


# -------------------------------------------------------------------- 1. agreement
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


def section_agreement(args: argparse.Namespace) -> dict[str, Any]:
    """1: the device against the CPU; ``ok`` False on any mismatch."""
    from device_agreement import compare, print_report

    print(f"== agreement: {embedding_backend()} tables and dense VRGD on {args.device} vs the CPU")
    tables, problems = compare(args.device, steps=2 if args.quick else 3)
    print_report(tables, problems, args.device)
    optimizers = check_optimizers(args.device)
    for p in optimizers:
        print("MISMATCH", p)
    print("VR optimizers alone:", "FAILED" if optimizers else "ok")
    problems += optimizers
    return {"ok": not problems, "problems": problems, "tables": tables}


# -------------------------------------------------------------------- 2. syncs
#: What torch.cuda.set_sync_debug_mode("warn") warns with.
SYNC_WARNING = "called a synchronizing CUDA operation"


def count_syncs(fn: Callable[[], Any]) -> dict[str, int]:
    """Run ``fn`` under ``torch.cuda.set_sync_debug_mode("warn")``: the host syncs it caused,
    counted per Python line that called the op (``file:line``), most first."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every sync, not the first of each line only
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = Counter(
        f"{short_path(w.filename)}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)
    )
    return dict(sites.most_common())


def short_path(filename: str) -> str:
    path = Path(filename)
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else filename


def section_syncs(args: argparse.Namespace) -> dict[str, Any]:
    """2: the host syncs of one model-bound training step, plain and VR (CUDA only)."""
    print("\n== syncs: one training step under torch.cuda.set_sync_debug_mode('warn')")
    if args.device != "cuda":
        print("skipped: no CUDA")
        return {"skipped": "no CUDA"}
    backend = embedding_backend()
    micro, k = 8192, 8
    out: dict[str, Any] = {}
    for optim in OPTIMIZERS:
        cfg = kaggle(args.device, backend, micro, k, 4 * k * micro, optim)

        def one_step(t: Trainer) -> dict[str, Any]:
            t.train_step()  # warm-up: lazily built state, first allocations
            reuse_micro_batches(t)
            sites = count_syncs(t.train_step)
            torch.cuda.synchronize()
            return {"count": sum(sites.values()), "sites": sites}

        out[optim] = with_trainer(cfg, args.device, one_step)
        print(f"{optim}: {out[optim]['count']} syncs in one step ({k} x {micro:,} rows)")
        for site, n in out[optim]["sites"].items():
            print(f"  {n:4d}  {site}")
    return out


# ------------------------------------------------------------------- 3. throughput
def embedding_backend() -> str:
    """``fbgemm`` when FBGEMM and torchrec import, else ``torch`` (pure PyTorch)."""
    try:
        importlib.import_module("fbgemm_gpu")
        importlib.import_module("torchrec")
    except Exception:  # ImportError, or a CUDA/CPU build mismatch raising OSError
        return "torch"
    return "fbgemm"


def kaggle(
    device: str, backend: str, micro: int, k: int, train_rows: int, optim: str
) -> TrainConfig:
    return load_config(
        REPO / "configs" / "synthetic_kaggle.yaml",
        [
            f"run.device={device}",
            f"model.embedding_backend={backend}",
            f"run.global_batch={k * micro}",
            f"run.micro_batch={micro}",
            "run.epochs=null",
            "run.steps=1000",
            "optim.schedule.warmup_steps=0",
            "optim.schedule.decay=none",
            f"data.train_rows={train_rows}",
            "data.val_rows=65536",
            "data.test_rows=65536",
            *OPTIMIZERS[optim],
        ],
    )


def on_days(cfg: TrainConfig, days: Path) -> TrainConfig:
    """``cfg`` reading the generated day files in the live source's order."""
    raw = cfg.to_dict()
    chunk = raw["data"]["chunk_rows"]
    raw["data"] = {"source": "criteo", "path": str(days), "shuffle_block_rows": chunk}
    return parse_config(raw)


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float:
    """Peak device memory since :func:`reset_peak` (CUDA), or the process's peak RSS (CPU:
    the high-water mark so far, not per variant)."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def timed_steps(t: Trainer, device: str, warmup: int, steps: int) -> dict[str, float]:
    """``warmup`` steps, then ``steps`` timed ones: median s / step and data_wait_s."""
    for _ in range(warmup):
        t.train_step()
    reset_peak(device)
    times, waits = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        record = t.train_step()  # ends with .item()s on the loss: the step's work is done
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        waits.append(record["data_wait_s"])
    step_s = statistics.median(times)
    return {
        "step_s": step_s,
        "rows_per_s": t.cfg.run.global_batch / step_s,
        "data_wait_s": statistics.median(waits),
        "peak_gib": peak_gib(device),
    }


def reuse_micro_batches(t: Trainer) -> None:
    """Model-bound: the step's micro-batches built once (on the device) and reused, so the
    step never waits for input."""
    step = t.step
    cached = [t.micro_batch(step, j) for j in range(t.A)]
    t.close_input()
    t.micro_batch = lambda step, j: cached[j]  # type: ignore[method-assign]


def with_trainer(cfg: TrainConfig, device: str, fn: Callable[[Trainer], Any]) -> Any:
    """``fn`` of a trainer built from ``cfg``, which is then closed and let go (its device
    memory too) before the next one is built."""
    t = Trainer(cfg)
    try:
        return fn(t)
    finally:
        t.close_input()
        del t
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def section_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """3: model-bound and end-to-end rows/s of plain and VR (module docstring)."""
    device, backend = args.device, embedding_backend()
    micro, k = (2048, 8) if args.quick else (65536, 8)
    warmup, steps = (1, 2) if args.quick else (2, 5)
    rows = k * micro * (warmup + steps + 1)  # one epoch of the npy and live runs
    print(
        f"\n== throughput: Kaggle-sized DLRM on {device}, {backend} tables, {k} x {micro:,} rows "
        f"a step, {warmup} warm-up + {steps} timed steps (medians)"
    )
    out: dict[str, Any] = {"backend": backend, "micro_batch": micro, "k": k, "rows": {}}
    with tempfile.TemporaryDirectory(prefix="dlrm-vrgd-gpu-check-", dir=args.tmp) as tmp:
        from dlrm_vrgd.data.export import generate_days

        t0 = time.perf_counter()
        days = Path(tmp) / "days"
        generate_days(kaggle(device, backend, micro, k, rows, "plain"), days, progress=False)
        gen_s = time.perf_counter() - t0
        print(f"generated {rows:,} train rows as day files in {gen_s:.1f} s")
        out["generate_s"] = gen_s
        for optim in OPTIMIZERS:
            cfg = kaggle(device, backend, micro, k, rows, optim)

            def npy(t: Trainer, optim: str = optim) -> None:
                out["rows"][f"{optim}/npy"] = timed_steps(t, device, warmup, steps)

            def live(t: Trainer, optim: str = optim) -> None:
                out["rows"][f"{optim}/live"] = timed_steps(t, device, warmup, steps)
                reuse_micro_batches(t)  # the same trainer, its input taken out
                out["rows"][f"{optim}/model-bound"] = timed_steps(t, device, 1, steps)

            with_trainer(on_days(cfg, days), device, npy)
            with_trainer(cfg, device, live)
    print_throughput(out["rows"], device)
    return out


def print_throughput(rows: dict[str, dict[str, float]], device: str) -> None:
    memory = "peak GiB" if device == "cuda" else "peak RSS GiB (so far)"
    head = ["optimizer", "input", "s / step", "rows/s", "x model-bound", "data_wait_s", memory]
    table = []
    for optim in OPTIMIZERS:
        bound = rows[f"{optim}/model-bound"]["rows_per_s"]
        for mode in ("model-bound", "npy", "live"):
            r = rows[f"{optim}/{mode}"]
            share = r["rows_per_s"] / bound
            target = TARGETS.get(mode)
            verdict = "" if target is None else (" ok" if share >= target else f" < {target}")
            r["x_model_bound"] = share
            table.append(
                [optim, mode, f"{r['step_s']:.3f}", f"{r['rows_per_s']:,.0f}",
                 f"{share:.2f}{verdict}", f"{r['data_wait_s']:.3f}", f"{r['peak_gib']:.2f}"]
            )  # fmt: skip
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table, strict=True)]
    for i, line in enumerate([head, *table]):
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


# -------------------------------------------------------------------- 4. breakdown
def section_breakdown(args: argparse.Namespace) -> dict[str, Any]:
    """4: a model-bound step's parts, plain and VR (bench/step_breakdown.py)."""
    from step_breakdown import PARTS, breakdown

    backend = embedding_backend()
    micro, k = (1024, 8) if args.quick else (65536, 8)
    print(f"\n== breakdown: Kaggle-sized DLRM on {args.device}, {k} x {micro:,}, {backend} tables")
    out: dict[str, Any] = {}
    steps = 2 if args.quick else 3
    for optim in OPTIMIZERS:
        cfg = kaggle(args.device, backend, micro, k, 4 * k * micro, optim)
        out[optim] = with_trainer(cfg, args.device, lambda t: breakdown(t, steps))
    head = ["part", "plain s", "VR s", "VR / plain"]
    rows = [
        [p, f"{out['plain'][p]:.4f}", f"{out['VR'][p]:.4f}",
         f"{out['VR'][p] / max(out['plain'][p], 1e-9):.2f}"]
        for p in [*PARTS, "sum of parts", "whole"]
    ]  # fmt: skip
    print_rows(head, rows)
    ratio = out["VR"]["whole"] / out["plain"]["whole"]
    verdict = "met" if ratio <= 1.1 else "NOT met"
    print(f"VR / plain, whole step: {ratio:.2f} (target <= 1.10: {verdict})")
    out["vr_over_plain"] = ratio
    return out


# -------------------------------------------------------------------- 5. nvidia
NVIDIA_A100_ROWS_PER_S = 4.02e6

#: (label, overrides) of the NVIDIA-shape variants.
NVIDIA_VARIANTS = [
    ("fp32", ["run.precision=fp32"]),
    ("tf32", ["run.precision=tf32"]),
    ("bf16", ["run.precision=bf16"]),
    ("bf16 + fp16 tables", ["run.precision=bf16", "model.embedding_precision=fp16"]),
]


def section_nvidia(args: argparse.Namespace) -> dict[str, Any]:
    """5: NVIDIA's DLRM shape at batch 64k, model-bound, per precision."""
    backend = embedding_backend()
    batch = 4096 if args.quick else 65536
    rows = ["data.val_rows=4096", "data.test_rows=4096"]  # the shape's tables, few eval rows
    if args.quick:  # the CPU form: Kaggle's tables capped at 1,000 rows
        rows.append(f"data.cardinalities={[1000] * 26}")
    print(f"\n== nvidia: NVIDIA's DLRM Kaggle shape on {args.device}, batch {batch:,}", end="")
    print(f", {backend} tables")
    out: dict[str, Any] = {}
    for label, overrides in NVIDIA_VARIANTS:
        if backend != "fbgemm" and "fp16" in label:
            continue  # fp16 tables are FBGEMM's
        cfg_over = [
            f"run.device={args.device}", f"model.embedding_backend={backend}",
            f"run.global_batch={batch}", f"run.micro_batch={batch}", "run.epochs=null",
            "run.steps=1000", "optim.schedule.warmup_steps=0", "optim.schedule.decay=none",
            f"data.train_rows={4 * batch}", "run.tensorboard=false", *rows, *overrides,
        ]  # fmt: skip
        cfg = load_config(REPO / "configs" / "nvidia_dlrm_kaggle.yaml", cfg_over)
        t0 = time.perf_counter()

        def model_bound(t: Trainer, t0: float = t0) -> dict[str, float]:
            built = time.perf_counter() - t0
            reuse_micro_batches(t)
            return {**timed_steps(t, args.device, 2, 2 if args.quick else 5), "build_s": built}

        out[label] = with_trainer(cfg, args.device, model_bound)
    head = ["precision", "s / step", "rows/s", "x NVIDIA A100 (4.02M)", "peak GiB", "build s"]
    table = [
        [label, f"{r['step_s']:.4f}", f"{r['rows_per_s']:,.0f}",
         f"{r['rows_per_s'] / NVIDIA_A100_ROWS_PER_S:.2f}", f"{r['peak_gib']:.2f}",
         f"{r['build_s']:.0f}"]
        for label, r in out.items()
    ]  # fmt: skip
    print_rows(head, table)
    return out


def print_rows(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    for i, line in enumerate([head, *rows]):
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "agreement": section_agreement,
    "syncs": section_syncs,
    "throughput": section_throughput,
    "breakdown": section_breakdown,
    "nvidia": section_nvidia,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="small sizes (for a CPU)")
    ap.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run just these sections")
    ap.add_argument("--tmp", help="where the day files are generated (default: the system's)")
    ap.add_argument("--json", help="write every section's figures here")
    args = ap.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("no CUDA device; run with --device cpu --quick for the CPU form")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    else:
        print(f"CPU ({os.cpu_count()} cores), torch {torch.__version__}")
    t0 = time.perf_counter()
    results = run_sections(args.only or list(SECTIONS), args)
    print(f"\ngpu_check: {time.perf_counter() - t0:.0f} s")
    failed = [name for name, r in results.items() if "error" in r]
    if failed:
        print("FAILED sections:", ", ".join(failed))
    agreed = results.get("agreement", {}).get("ok", True)
    sys.exit(1 if failed or not agreed else 0)


def run_sections(names: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every section in ``names``, each whatever the ones before it did: a section that raises
    is recorded as its ``error`` and ``traceback`` (and printed). With ``--json`` the figures
    are written after every section, so a run cut short keeps what it measured."""
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            results[name] = SECTIONS[name](args)
        except Exception as e:
            tb = traceback.format_exc()
            print(f"\n!! section {name} FAILED:\n{tb}", flush=True)
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": tb}
        gc.collect()  # what a failed section held, before the next one builds its own
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
