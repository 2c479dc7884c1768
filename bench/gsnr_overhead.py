"""Cost of GSNR bookkeeping in the dense optimizers: step time of each VR optimizer beside its
base optimizer on the demo model and data, k = 8 micro-batches per step, all in one run.

Bases: torch.optim.SGD / AdamW for VR-SGD / VR-Adam; for VR-LARS / VR-LAMB (no torch.optim
counterpart) the same class with gamma = 1, which skips the statistics and *is* the base
algorithm. Target: ratio <= 1.03.

A whole step (forward and backward over k micro-batches, embedding update, dense update) takes
~130 ms here and varies by a few per cent from step to step, which is as large as the overhead
being measured. So a second table times the optimizer's own work alone, on the same model's dense
parameters: k gradient groups and one update, for VR (``collect()`` k times and ``step()``) and
for the base (k gradients summed into ``p.grad``, as autograd does, and ``step()``). It then states
the overhead as a fraction of the base's whole step. Both tables come from the same run.

A third part prices the gradient noise scale (DESIGN.md 4.6), which every step keeps for every
optimizer: the whole step with its bookkeeping (per-group ``|g_d|²`` of the dense tensors, the
per-table sums over touched rows, the EMAs) beside the same step without it (``track_noise`` off
on both optimizers), for a VR pair and a plain pair, interleaved (as noisy as above); then its
extra work alone, with far less noise: the dense optimizer with and without it (k groups + one
update), and the tables' sums (``add_table_sums`` on one real step's drained row sums), stated
as a fraction of the whole step without it. Target: within 1% of a step.

    python bench/gsnr_overhead.py [--reps 15] [--micro-batch 1024] [--only-noise]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from common import REPO, interleaved_medians, print_table, threads

from dlrm_vrgd.config import load_config
from dlrm_vrgd.optim.dense import build_dense_optimizer
from dlrm_vrgd.optim.sparse import add_table_sums
from dlrm_vrgd.train.loop import Trainer

PAIRS = [
    (
        "vrsgd",
        {"name": "vrsgd", "lr": 0.05, "momentum": 0.9},
        {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    ),
    ("vradam", {"name": "vradam", "lr": 0.002}, {"name": "adamw", "lr": 0.002}),
    (
        "vrlars",
        {"name": "vrlars", "lr": 1.0, "momentum": 0.9},
        {"name": "vrlars", "lr": 1.0, "momentum": 0.9, "gamma": 1.0},
    ),
    ("vrlamb", {"name": "vrlamb", "lr": 0.002}, {"name": "vrlamb", "lr": 0.002, "gamma": 1.0}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--micro-batch", type=int, default=1024)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--only-noise", action="store_true", help="only the noise-scale tables")
    ap.add_argument(
        "--noise-reps",
        type=int,
        default=0,
        help="reps of the noise scale's alone parts (0: 10 x --reps, 4 x --reps)",
    )
    args = ap.parse_args()
    torch.set_num_threads(threads())
    b, k = args.micro_batch, args.k

    def trainer(dense: dict, sparse: dict | None = None) -> Trainer:
        overrides = [
            f"run.global_batch={b * k}",
            f"run.micro_batch={b}",
            "run.epochs=null",
            "run.steps=1000",
        ] + [f"optim.dense.{key}={v}" for key, v in dense.items()]
        overrides += [f"optim.sparse.{key}={v}" for key, v in (sparse or {}).items()]
        return Trainer(load_config(REPO / "configs" / "demo.yaml", overrides))

    if args.only_noise:
        noise_scale_tables(trainer, args.reps, b, k, args.noise_reps)
        return

    variants = {}
    for name, vr, base in PAIRS:
        variants[f"{name}"] = trainer(vr).train_step
        variants[f"{name}:base"] = trainer(base).train_step
    dense_params = list(trainer(PAIRS[0][2]).model.dense_parameters())
    n_dense = sum(p.numel() for p in dense_params)
    print(
        f"demo model: {n_dense:,} dense parameters; G = {k} x {b} rows; "
        f"{threads()} threads; median of {args.reps} interleaved steps"
    )
    med = interleaved_medians(variants, args.reps)
    rows = []
    for name, _, base in PAIRS:
        vr_t, base_t = med[name], med[f"{name}:base"]
        rows.append(
            [
                name,
                base["name"] + (" (gamma=1)" if "gamma" in base else ""),
                vr_t * 1e3,
                base_t * 1e3,
                vr_t / base_t,
            ]
        )
    print_table(["optimizer", "base", "VR step ms", "base step ms", "ratio"], rows)

    # the optimizer's own work alone, with far less noise than a whole step
    model_params = [p for p in dense_params if p.requires_grad]
    groups = [[torch.randn_like(p) for p in model_params] for _ in range(k)]

    def optimizer_only(dense: dict) -> Callable[[], None]:
        overrides = [f"optim.dense.{key}={v}" for key, v in dense.items()]
        cfg = load_config(REPO / "configs" / "demo.yaml", overrides)
        params = [p.detach().clone().requires_grad_() for p in model_params]
        opt = build_dense_optimizer(cfg.optim.dense, [(f"p{i}", p) for i, p in enumerate(params)])

        def run() -> None:
            for grads in groups:  # what autograd leaves in .grad, then the group protocol
                for p, g in zip(params, grads, strict=True):
                    if p.grad is None:  # VR optimizers take each group's grads and clear them
                        p.grad = g.clone()
                    else:  # torch.optim bases let them sum over the k groups
                        p.grad.add_(g)
                opt.collect()
            opt.step()
            opt.zero_grad()

        return run

    alone = {}
    for name, vr, base in PAIRS:
        alone[name] = optimizer_only(vr)
        alone[f"{name}:base"] = optimizer_only(base)
    omed = interleaved_medians(alone, args.reps * 10)
    rows = []
    for name, _, _ in PAIRS:
        vr_o, base_o = omed[name], omed[f"{name}:base"]
        rows.append([name, vr_o * 1e3, base_o * 1e3, 1 + (vr_o - base_o) / med[f"{name}:base"]])
    print()
    print(f"the optimizer alone (k = {k} groups + one update), median of {args.reps * 10}:")
    print_table(["optimizer", "VR ms", "base ms", "1 + (VR - base) / base whole step"], rows)
    print()
    noise_scale_tables(trainer, args.reps, b, k, args.noise_reps)


NOISE_PAIRS = [
    ("vrsgd + gsnr_rowwise_adagrad", PAIRS[0][1], {"name": "gsnr_rowwise_adagrad"}),
    ("sgd + rowwise_adagrad", PAIRS[0][2], {"name": "rowwise_adagrad"}),
]


def noise_scale_tables(
    trainer: Callable[..., Trainer], reps: int, b: int, k: int, alone_reps: int = 0
) -> None:
    """The gradient noise scale's cost: whole steps with / without, then the dense optimizer
    alone with / without over the whole step without."""

    def step(t: Trainer, on: bool) -> Callable[[], object]:
        t.dense_opt.track_noise = on
        t.sparse_opt.track_noise = on
        return t.train_step

    variants = {}
    for name, dense, sparse in NOISE_PAIRS:
        variants[f"{name}:on"] = step(trainer(dense, sparse), True)
        variants[f"{name}:off"] = step(trainer(dense, sparse), False)
    med = interleaved_medians(variants, reps * 2)
    t = trainer(PAIRS[0][2])
    params = [p for p in t.model.dense_parameters() if p.requires_grad]
    groups = [[torch.randn_like(p) for p in params] for _ in range(k)]

    def dense_alone(dense: dict, on: bool) -> Callable[[], None]:
        cfg = load_config(
            REPO / "configs" / "demo.yaml", [f"optim.dense.{a}={v}" for a, v in dense.items()]
        )
        ps = [p.detach().clone().requires_grad_() for p in params]
        opt = build_dense_optimizer(cfg.optim.dense, [(f"p{i}", p) for i, p in enumerate(ps)])
        opt.track_noise = on

        def run() -> None:
            for grads in groups:
                for p, g in zip(ps, grads, strict=True):
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.add_(g)
                opt.collect()
            opt.step()

        return run

    alone = {}
    for name, dense, _ in NOISE_PAIRS:
        alone[f"{name}:on"] = dense_alone(dense, True)
        alone[f"{name}:off"] = dense_alone(dense, False)
    dense_reps, sparse_reps = (alone_reps, alone_reps) if alone_reps else (reps * 10, reps * 4)
    amed = interleaved_medians(alone, dense_reps)

    def table_sums(sparse: dict) -> Callable[[], None]:
        """The tables' part alone: :func:`add_table_sums` on one real step's drained sums."""
        t = trainer(PAIRS[0][2], sparse)
        for j in range(t.A):
            loss, _ = t.model.loss(t.micro_batch(0, j))
            loss.backward()
            t.sparse_opt.collect()
        parts = []
        for lk, accs in zip(t.lookups, t.sparse_opt._acc, strict=True):
            sums = torch.zeros(2, len(lk.table_names), dtype=torch.float64)
            for space, view, acc in zip(
                lk.capture.layout.spaces, lk.space_views(), accs, strict=True
            ):
                sr = acc.drain()
                tables = torch.tensor(space.tables)[view.table_index(sr.rows)]
                parts.append((sums, tables, sr.grad_sum, sr.sq_sum))

        def run() -> None:
            for part in parts:
                add_table_sums(*part)

        return run

    sparse_variants = {name: table_sums(sparse) for name, _, sparse in NOISE_PAIRS}
    smed = interleaved_medians(sparse_variants, sparse_reps * 10)
    rows = []
    for name, _, _ in NOISE_PAIRS:
        on, off = med[f"{name}:on"], med[f"{name}:off"]
        dense_extra = amed[f"{name}:on"] - amed[f"{name}:off"]
        sparse_extra = smed[name]
        rows.append(
            [
                name,
                on * 1e3,
                off * 1e3,
                on / off,
                dense_extra * 1e3,
                sparse_extra * 1e3,
                1 + (dense_extra + sparse_extra) / off,
            ]
        )
    print(
        f"gradient noise scale (G = {k} x {b}): whole step with / without its bookkeeping, "
        f"median of {reps * 2} interleaved steps; its extra work alone: the dense optimizer "
        f"(on - off, median of {dense_reps}) and the tables' sums (median of {sparse_reps * 10})"
    )
    print_table(
        [
            "optimizers",
            "on ms",
            "off ms",
            "step ratio",
            "dense extra ms",
            "sparse extra ms",
            "1 + extras / off step",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
