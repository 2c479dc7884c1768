"""The embedding update of one global batch: our deferred, GSNR-aware row-wise step beside
FBGEMM's fused EXACT_ROWWISE_ADAGRAD on the same batch and tables, in one run.

26 tables x 100k rows x dim 64, Zipf-like ids (s = 1.05), one id per table per row, G rows.
"fused" runs the lookup and FBGEMM's fused backward on all G rows at once (the plain torchrec
way: one update per backward). Ours runs k micro-batches of G/k rows (lookup, capture, per-row
reduction), then one replayed update; with GSNR it also forms each row's ratio, and under the
``update`` placement (the default) scales each row's step: a gather of the damped rows'
Adagrad states and one ``index_add_`` of ``(r − 1)·Δ`` into their weights. "telemetry" adds
the realised step ratio (taken on the steps whose GSNR a run records, every
``run.gsnr_every``). Target: GSNR ``update`` / fused <= 1.10.

The variants run interleaved within every repetition (A B C ..., then reversed), and each ratio
is the median over repetitions of that repetition's pair of times, with its 95% order-statistic
interval (common.median_interval): a run resolves a 5% difference when the interval is under
±3%. ``--json`` writes the figures for ``bench/run_all.py --save``.

Then it counts, with ``torch.profiler``, the aten ops of one ``collect()`` and one ``step()`` of
every deferred variant and the read-backs among them (``aten::item`` /
``_local_scalar_dense`` and ``aten::nonzero``: each is a host sync on a GPU), on the route this
CPU takes and on the route a GPU takes, run here (the groups merged at the step, one id per bag
vouched for, no host replay view: DESIGN.md 7). Target: the GSNR step's ops within 1.5x of the
plain step's on the GPU route, and no read-back in it.

    python bench/sparse_step.py [--rows 8192] [--k 8] [--reps 101] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import statistics
from collections.abc import Callable

import numpy as np
import torch
from common import interleaved_times, paired_ratios, print_table, threads, write_result
from torch.profiler import ProfilerActivity, profile
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import dlrm_vrgd.embedding.fbgemm as fbgemm
from dlrm_vrgd.data.synthetic import zipf_ranks
from dlrm_vrgd.embedding.fbgemm import FbgemmEmbeddingBagCollection
from dlrm_vrgd.optim.sparse import SparseRowwiseOptimizer

T, N, D = 26, 100_000, 64
READ_BACKS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero")
COUNTED = {
    "deferred": {},
    "gsnr_update": {"gsnr": True},
    "gsnr_gradient": {"gsnr": True, "placement": "gradient"},
    "gsnr_telemetry": {"gsnr": True, "measure": True},
    "gsnr_ema": {"gsnr": True, "estimator": "ema"},
}


def aten_ops(fn: Callable[[], None]) -> collections.Counter:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def op_counts(tables, batches, upstream, b: int, gpu_route: bool) -> dict[str, dict[str, int]]:
    """Ops and read-backs of one collect (the last group's) and one step of each variant, in
    the second step (the first builds the row-space views, once)."""
    saved = fbgemm.space_view
    if gpu_route:
        fbgemm.space_view = lambda *a, **k: None  # a GPU TBE has no host replay view
    try:
        out = {}
        for name, kw in COUNTED.items():
            kw = dict(kw)
            measure = kw.pop("measure", False)
            ebc = FbgemmEmbeddingBagCollection(tables, "rowwise_adagrad", lr=0.01)
            if gpu_route:
                ebc.capture.one_hot = True
                kw["accumulate"] = "merge"
            opt = SparseRowwiseOptimizer(ebc.lookups(), lr=0.01, **kw)
            opt.measure_steps = measure
            for counting in (False, True):  # the first step builds the views: count the second
                collect = collections.Counter()
                for j, mb in enumerate(batches):
                    (ebc(mb).values() * upstream[j * b : (j + 1) * b]).sum().div(b).backward()
                    collect = aten_ops(opt.collect) if counting else collect
                    if not counting:
                        opt.collect()
                step = aten_ops(opt.step) if counting else collections.Counter()
                if not counting:
                    opt.step()
            out[name] = {
                "collect_ops": sum(collect.values()),
                "collect_read_backs": sum(collect[k] for k in READ_BACKS),
                "step_ops": sum(step.values()),
                "step_read_backs": sum(step[k] for k in READ_BACKS),
            }
        return out
    finally:
        fbgemm.space_view = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192, help="global batch G")
    ap.add_argument("--k", type=int, default=8, help="micro-batches (gradient groups)")
    ap.add_argument(
        "--reps",
        type=int,
        default=101,
        help="repetitions of every variant (101: intervals within +-3.4%% on 2 idle cores)",
    )
    ap.add_argument("--json", help="write the figures here (bench/run_all.py --save)")
    args = ap.parse_args()
    torch.set_num_threads(threads())
    g, k = args.rows, args.k
    b = g // k
    keys = [f"f{i}" for i in range(T)]
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=N, embedding_dim=D, feature_names=[keys[i]])
        for i in range(T)
    ]
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(zipf_ranks(rng.random((g, T)), np.full(T, N), 1.05))
    upstream = torch.randn(g, T * D, generator=torch.Generator().manual_seed(0))

    def kjt(lo: int, hi: int) -> KeyedJaggedTensor:
        n = hi - lo
        return KeyedJaggedTensor(
            keys=keys, values=ids[lo:hi].t().reshape(-1), offsets=torch.arange(n * T + 1), stride=n
        )

    batches = [kjt(j * b, (j + 1) * b) for j in range(k)]
    whole = kjt(0, g)

    fused = FbgemmEmbeddingBagCollection(tables, "rowwise_adagrad", lr=0.01)
    fused.capture.remove()

    def run_fused() -> None:
        (fused(whole).values() * upstream).sum().div(g).backward()

    def deferred(measure: bool = False, **kw) -> tuple[SparseRowwiseOptimizer, object]:
        ebc = FbgemmEmbeddingBagCollection(tables, "rowwise_adagrad", lr=0.01)
        opt = SparseRowwiseOptimizer(ebc.lookups(), lr=0.01, **kw)
        opt.measure_steps = measure

        def run() -> None:
            for j, mb in enumerate(batches):
                (ebc(mb).values() * upstream[j * b : (j + 1) * b]).sum().div(b).backward()
                opt.collect()
            opt.step()

        return opt, run

    plain_opt, plain = deferred()
    step_opt, gsnr_update = deferred(gsnr=True, estimator="step", placement="update")
    _, gsnr_gradient = deferred(gsnr=True, estimator="step", placement="gradient")
    _, gsnr_telemetry = deferred(True, gsnr=True, estimator="step", placement="update")
    _, gsnr_ema = deferred(gsnr=True, estimator="ema", placement="update")
    variants = {
        "fused": run_fused,
        "deferred": plain,
        "gsnr_update": gsnr_update,
        "gsnr_gradient": gsnr_gradient,
        "gsnr_telemetry": gsnr_telemetry,
        "gsnr_ema": gsnr_ema,
    }
    times = interleaved_times(variants, args.reps)
    med = {n: statistics.median(ts) for n, ts in times.items()}
    ratios = {n: paired_ratios(times, n, "fused") for n in variants if n != "fused"}
    update_vs_gradient = paired_ratios(times, "gsnr_update", "gsnr_gradient")
    touched = sum(s["touched_rows"] for s in step_opt.summary())
    multi = sum(s["multi_group_rows"] for s in step_opt.summary())
    print(
        f"{T} tables x {N:,} rows x dim {D}; G = {g:,} rows as k = {k} micro-batches of {b:,}; "
        f"{threads()} threads; {args.reps} interleaved repetitions"
    )
    print(f"touched rows per step: {touched:,} ({multi / touched:.0%} seen by >= 2 groups)")
    labels = {
        "fused": "FBGEMM fused EXACT_ROWWISE_ADAGRAD (G rows at once)",
        "deferred": "ours, no GSNR (k micro-batches + one replayed update)",
        "gsnr_update": "ours, GSNR step estimator, placement update (default)",
        "gsnr_gradient": "ours, GSNR step estimator, placement gradient (old)",
        "gsnr_telemetry": "ours, GSNR update + realised-step-ratio telemetry",
        "gsnr_ema": "ours, GSNR EMA estimator, placement update",
    }
    rows = [
        [
            labels[n],
            med[n] * 1e3,
            "1" if n == "fused" else f"{ratios[n].median:.3f}",
            "" if n == "fused" else f"[{ratios[n].low:.3f}, {ratios[n].high:.3f}]",
        ]
        for n in variants
    ]
    print_table(["variant", "median ms / step", "ratio to fused", "95% interval"], rows)
    print(f"\nupdate / gradient placement: {update_vs_gradient}")
    worst = max(ratios.values(), key=lambda r: r.half_width)
    print(f"widest interval: ±{worst.half_width:.1%} (resolves 5% when under ±3%)")
    counts = {
        route: op_counts(tables, batches, upstream, b, route == "gpu") for route in ("cpu", "gpu")
    }
    print("\naten ops and read-backs (item, _local_scalar_dense, nonzero) of one collect / step:")
    print_table(
        ["variant", "route", "collect ops", "read-backs", "step ops", "read-backs", "/ plain"],
        [
            [
                labels[name],
                route,
                c["collect_ops"],
                c["collect_read_backs"],
                c["step_ops"],
                c["step_read_backs"],
                f"{c['step_ops'] / counts[route]['deferred']['step_ops']:.2f}",
            ]
            for route in ("cpu", "gpu")
            for name, c in counts[route].items()
        ],
    )
    write_result(
        args.json,
        "sparse_step",
        {
            "rows": g,
            "k": k,
            "reps": args.reps,
            "touched_rows": touched,
            "ms": {n: m * 1e3 for n, m in med.items()},
            "ratio_to_fused": ratios,
            "update_vs_gradient": update_vs_gradient,
            "op_counts": counts,
        },
    )


if __name__ == "__main__":
    main()
