"""Peak memory at a 16k, a 128k and a 512k global batch with the same micro-batch, in one run,
and where its bytes are.

Each global batch trains in a fresh process (so peaks do not mix) for ``--steps`` steps of the
Kaggle-sized model (configs/synthetic_kaggle.yaml: 26 tables x 100k rows x 64) with VR-Adam +
GSNR row-wise Adagrad at the trainer's defaults, sampling its resident set (``/proc/self``:
``VmRSS``, and ``VmHWM`` reset through ``clear_refs`` so that each phase's own peak is read)
after every micro-batch and around the optimizers' steps. The peak is split into:

* runtime: the interpreter, torch, FBGEMM and the data source (RSS after the build, less the
  two parts below);
* tables + optimizer state: the tables' weights, the row-wise Adagrad sums, the sparse
  optimizer's per-table-row slot map (and EMA state), counted from their tensors;
* dense: the dense parameters, their gradients and the dense optimizer's state (tensors);
* row sums: the step's touched-row sums (``RowAccumulator``), ``4·D + 16`` bytes per touched row
  — the one part that grows with the global batch, bounded by the table rows;
* transient: what the phase holding the peak allocates and frees — a micro-batch's activations
  and captured gradients, or the optimizers' step (whose ``rows x D`` temporaries go
  ``chunk_rows`` rows at a time);
* allocator: the rest — freed memory the allocator has not returned (fragmentation).

Each batch runs in ``--repeats`` fresh processes (default 3, interleaved): the same config's RSS
varies from process to process, so the run with the median peak stands for its batch, and the
range over the runs is printed beside it, and so is each phase's own peak (the micro-batches',
the sparse step's). Checks, of the medians: peak RSS(512k) / peak RSS(16k) <= 1.10, whole and
less the row sums alive at each peak (the exact float32 sums are ``O(U x D)``: on this model
they alone add ~10% of the 16k peak, so the whole ratio cannot reach 1.10 with them, and what
the micro-batch bounds is the rest); and the growth from 16k to 512k per extra touched row is
at most twice the row sums' ``4·D + 16`` bytes (the constant measured is printed). ``--json``
writes the figures for ``bench/run_all.py --save``.

    python bench/memory.py [--micro-batch 8192] [--steps 1] [--repeats 3] [--threshold-kb N]
                           [--heap-release micro_batch|growth|never]
                           [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from common import REPO, print_table, threads, write_result

from dlrm_vrgd.malloc import HEAP_RELEASE

BATCHES = (16_384, 131_072, 524_288)
TARGET_RATIO = 1.10
MB = 1 << 20


def _status() -> tuple[float, float]:
    """``(VmRSS, VmHWM)`` of this process in bytes."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def tensor_bytes(*objs: Any) -> int:
    """Bytes of the distinct storages of the tensors in ``objs`` (nested lists, tuples, dicts,
    and the attributes of plain objects one level down)."""
    import torch

    seen: dict[int, int] = {}

    def walk(obj: Any, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v, depth)
        elif depth > 0 and hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                walk(v, depth - 1)

    for obj in objs:
        walk(obj, 1)
    return sum(seen.values())


def child(
    global_batch: int, micro_batch: int, steps: int, threshold_kb: int | None, heap: str | None
) -> None:
    import torch

    from dlrm_vrgd.config import load_config
    from dlrm_vrgd.train.loop import Trainer

    torch.set_num_threads(threads())
    overrides = [
        f"run.global_batch={global_batch}",
        f"run.micro_batch={micro_batch}",
        "run.epochs=null",
        f"run.steps={steps}",
        "optim.dense.name=vradam",
        "optim.sparse.name=gsnr_rowwise_adagrad",
    ]
    if threshold_kb is not None:
        overrides.append(f"run.malloc_mmap_threshold_kb={threshold_kb}")
    if heap is not None:
        overrides.append(f"run.heap_release={heap}")
    cfg = load_config(REPO / "configs" / "synthetic_kaggle.yaml", overrides)
    trainer = Trainer(cfg)
    so, do = trainer.sparse_opt, trainer.dense_opt
    accs = [acc for per_lookup in so._acc for acc in per_lookup]

    def row_bytes(acc: Any) -> int:
        per_row = acc.grad_sum.element_size() * acc.dim
        per_row += acc.rows.element_size() + acc.sq_sum.element_size()
        per_row += acc.n_groups.element_size() + (acc.counts.element_size() * acc.count_ids)
        return per_row

    tables = tensor_bytes(
        [lk.table_weights() for lk in trainer.lookups],
        [lk.row_states() for lk in trainer.lookups],
        [acc.slot for acc in accs],
        so._ema,
    )
    params = [p for _, p in trainer.model.named_dense_parameters()]
    built, _ = _status()
    # per phase (from the end of the previous one to its own end): RSS before, its own peak,
    # the row sums at its end
    phases: list[dict[str, Any]] = []
    state = {"rss": built, "row_sums": 0}

    def after(name: str, fn: Any) -> Any:
        out = fn()
        rss, peak = _status()
        sums = sum(acc.size * row_bytes(acc) for acc in accs)
        phases.append(
            {
                "phase": name,
                "before": state["rss"],
                "peak": peak,
                "row_sums_before": state["row_sums"],
                "row_sums": sums,
            }
        )
        state["rss"], state["row_sums"] = rss, sums
        _reset_peak()
        return out

    collect, sparse_step, dense_step = so.collect, so.step, do.step
    so.collect = lambda: after("micro-batch", collect)  # its forward, backward and capture
    so.step = lambda: after("sparse step", sparse_step)
    do.step = lambda: after("dense step", dense_step)
    _reset_peak()
    seconds = []
    for _ in range(steps):
        seconds.append(trainer.train_step()["step_seconds"])
    dense = tensor_bytes(params, [p.grad for p in params], do.state, vars(do))
    top = max(phases, key=lambda p: p["peak"])
    row_sums = max(p["row_sums"] for p in phases)
    # the peak phase's own allocations, less the row sums it added (counted as row sums)
    transient = top["peak"] - top["before"] - (top["row_sums"] - top["row_sums_before"])
    parts = {
        "runtime": built - tables - dense,
        "tables_and_state": tables,
        "dense": dense,
        "row_sums": top["row_sums"],
        "transient": transient,
        "allocator": top["before"] - built - top["row_sums_before"],  # retained, not alive
    }
    peak_micro = max(p["peak"] - p["before"] for p in phases if p["phase"] == "micro-batch")
    print(
        json.dumps(
            {
                "peak_mb": top["peak"] / MB,
                "peak_phase": top["phase"],
                "parts_mb": {k: v / MB for k, v in parts.items()},
                "row_sums_max_mb": row_sums / MB,
                "micro_batch_transient_mb": peak_micro / MB,
                "row_bytes": row_bytes(accs[0]),
                "s_per_micro_batch": min(seconds) / (global_batch // micro_batch),
                "touched_rows": sum(t["touched_rows"] for t in so.summary()),
                "table_rows": sum(trainer.splits.cardinalities),
                "phase_peaks_mb": {  # keyed as in docs' markers: no spaces
                    name.replace(" ", "_").replace("-", "_"): max(
                        p["peak"] for p in phases if p["phase"] == name
                    )
                    / MB
                    for name in ("micro-batch", "sparse step", "dense step")
                },
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batch", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument(
        "--threshold-kb", type=int, help="run.malloc_mmap_threshold_kb (default: the trainer's)"
    )
    ap.add_argument(
        "--heap-release",
        choices=HEAP_RELEASE,
        help="run.heap_release (default: the trainer's)",
    )
    ap.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=list(BATCHES),
        help="global batches, smallest first (default 16k 128k 512k; fewer for a reduced run)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="fresh processes per global batch, interleaved (the median's run is reported)",
    )
    ap.add_argument("--json", help="write the figures here (bench/run_all.py --save)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.micro_batch, args.steps, args.threshold_kb, args.heap_release)
        return
    b = args.micro_batch
    batches = sorted(args.batches)
    # The same process's RSS varies from run to run (its anonymous memory right after the
    # build by up to ~100 MB here, whatever the hash seed), so every batch runs in
    # several fresh processes, interleaved, and the run with the median peak stands for it.
    runs: dict[int, list[dict[str, Any]]] = {g: [] for g in batches}
    for _ in range(max(1, args.repeats)):
        for g in batches:
            cmd = [sys.executable, __file__, "--child", str(g), "--micro-batch", str(b)]
            cmd += ["--steps", str(args.steps)]
            if args.threshold_kb is not None:
                cmd += ["--threshold-kb", str(args.threshold_kb)]
            if args.heap_release is not None:
                cmd += ["--heap-release", args.heap_release]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[g].append(json.loads(out.stdout.strip().splitlines()[-1]))
    results: dict[int, dict[str, Any]] = {}
    for g, rs in runs.items():
        ordered = sorted(rs, key=lambda r: r["peak_mb"])
        results[g] = {
            **ordered[(len(ordered) - 1) // 2],
            "peaks_mb": [r["peak_mb"] for r in rs],
        }
    setting = (
        "trainer default" if args.threshold_kb is None else f"mmap threshold {args.threshold_kb}"
    )
    if args.heap_release is not None:
        setting += f", heap_release {args.heap_release}"
    print(
        f"Kaggle-sized DLRM, micro-batch B = {b:,}, {args.steps} step(s) each, VR-Adam + "
        f"GSNR rowwise Adagrad, allocator: {setting}, {threads()} threads; "
        f"{args.repeats} processes per batch, the median's parts shown"
    )
    names = ["runtime", "tables_and_state", "dense", "row_sums", "transient", "allocator"]
    rows = [
        [
            f"{g:,}",
            f"{r['touched_rows']:,} of {r['table_rows']:,}",
            r["peak_phase"],
            *(r["parts_mb"][n] for n in names),
            r["peak_mb"],
            f"{min(r['peaks_mb']):.0f}-{max(r['peaks_mb']):.0f}",
            r["phase_peaks_mb"]["micro_batch"],
            r["phase_peaks_mb"]["sparse_step"],
            r["s_per_micro_batch"],
        ]
        for g, r in results.items()
    ]
    print_table(
        [
            "global batch",
            "touched rows",
            "peak in",
            "runtime MB",
            "tables+state MB",
            "dense MB",
            "row sums MB",
            "transient MB",
            "allocator MB",
            "peak RSS MB",
            "range of runs MB",
            "micro-batch peak MB",
            "sparse step peak MB",
            "s / micro-batch",
        ],
        rows,
    )
    small, large = results[batches[0]], results[batches[-1]]
    span = f"{batches[-1]:,} / {batches[0]:,}"
    ratio = large["peak_mb"] / small["peak_mb"]
    extra_rows = large["touched_rows"] - small["touched_rows"]
    per_row = (large["peak_mb"] - small["peak_mb"]) * MB / max(extra_rows, 1)
    bound = 2 * large["row_bytes"]
    # every pairing of the runs: how far the single-run ratio can move on this noise alone
    pairs = [x / y for x in large["peaks_mb"] for y in small["peaks_mb"]]
    print(
        f"\npeak RSS {span} = {ratio:.3f} (medians; single runs paired {min(pairs):.3f}-"
        f"{max(pairs):.3f})   (target <= {TARGET_RATIO}: "
        f"{'met' if ratio <= TARGET_RATIO else 'NOT met'})"
    )
    # the row sums alive at each peak: the one part bounded by the touched rows, not by B
    net = (large["peak_mb"] - large["parts_mb"]["row_sums"]) / (
        small["peak_mb"] - small["parts_mb"]["row_sums"]
    )
    sums_share = (large["row_sums_max_mb"] - small["row_sums_max_mb"]) / small["peak_mb"]
    print(
        f"  less the row sums at each peak: {net:.3f}   (target <= {TARGET_RATIO}: "
        f"{'met' if net <= TARGET_RATIO else 'NOT met'}); the row sums alone grow by "
        f"{sums_share:.1%} of the {batches[0]:,} peak"
    )
    print(
        f"growth per extra touched row: {per_row:.0f} B (row sums {large['row_bytes']} B = "
        f"4·D + 16; bound {bound} B: {'met' if per_row <= bound else 'NOT met'})"
    )
    write_result(
        args.json,
        "memory",
        {
            "micro_batch": b,
            "steps": args.steps,
            "repeats": args.repeats,
            "allocator": setting,
            "by_global_batch": {str(g): r for g, r in results.items()},
            "batches": batches,
            "ratio_largest_smallest": ratio,
            "ratio_single_runs": [min(pairs), max(pairs)],
            "ratio_less_row_sums": net,
            "row_sums_growth_share": sums_share,
            "bytes_per_extra_touched_row": per_row,
            "row_bytes": large["row_bytes"],
        },
    )


if __name__ == "__main__":
    main()
