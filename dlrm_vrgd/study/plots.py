"""The study's PNG plots (matplotlib, headless)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from dlrm_vrgd.study.config import StudyConfig


def _series(summary: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """(optimizer, k) of every series, in summary order."""
    return list(dict.fromkeys((s["optimizer"], s.get("groups")) for s in summary))


def write_plots(
    study: StudyConfig,
    summary: list[dict[str, Any]],
    cells: list[dict[str, Any]],
    out: Path,
    summary_rule: list[dict[str, Any]] | None = None,
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    # every figure of an exploratory study says so on its face
    label_of = EXPLORATORY if study.exploratory else None
    names = [o.name for o in study.optimizers]
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    vr = {o.name for o in study.optimizers if o.baseline}  # compared against a base
    # optimizers that estimate GSNR (the "VR cells" of the GSNR and k plots)
    gsnr = {
        o.name
        for o in study.optimizers
        if str(o.dense.get("name", "")).startswith("vr")
        or str(o.sparse.get("name", "")).startswith("gsnr_")
    }
    series = _series(summary)
    many_k = {n for n in names if len({k for m, k in series if m == n}) > 1}
    markers = "osD^v<>ph"
    all_k = sorted({k for _, k in series if k is not None})

    def label(name: str, k: Any) -> str:
        return f"{name} k={k}" if name in many_k else name

    def style(name: str, k: Any) -> dict[str, Any]:
        m = markers[all_k.index(k) % len(markers)] if k in all_k and name in many_k else "o"
        return {
            "color": colors[name],
            "marker": m,
            "linestyle": "-" if name in vr else "--",
            "label": label(name, k),
        }

    # 1. test AUC against batch size, mean ± sd over seeds: tuned LR and the rule's LR
    protocols = [("tuned", "best LR on val", summary)]
    if summary_rule is not None:
        protocols.append(("rule", "the rule's LR, untuned", summary_rule))
    fig, axes = plt.subplots(
        1, len(protocols), figsize=(7 * len(protocols), 4.5), squeeze=False, sharey=True
    )
    oracle = [c["oracle_test_auc"] for c in cells if c["oracle_test_auc"] is not None]
    lows: list[float] = []
    highs: list[float] = []
    for ax, (_, _, rows) in zip(axes[0], protocols, strict=True):
        for name, k in series:
            pts = sorted(
                (s["global_batch"], s["test_auc"], s["test_auc_sd"])
                for s in rows
                if s["optimizer"] == name and s.get("groups") == k
            )
            if pts:
                xs, ys, es = zip(*pts, strict=True)
                lows += [y - (e or 0.0) for y, e in zip(ys, es, strict=True)]
                highs += [y + (e or 0.0) for y, e in zip(ys, es, strict=True)]
                ax.errorbar(xs, ys, yerr=es, capsize=4, **style(name, k))
    # y fitted to the points and their error bars: the oracle, often far above them, would
    # squeeze them flat at the bottom; its value stays in the legend when it is off the range
    y_range = _fitted(lows, highs)
    level = sum(oracle) / len(oracle) if oracle else None
    where = ""
    if level is not None and y_range is not None:
        where = " (above)" if level > y_range[1] else " (below)" if level < y_range[0] else ""
    for ax, (_, what, _) in zip(axes[0], protocols, strict=True):
        if level is not None:
            ax.axhline(level, color="grey", linestyle=":", label=f"oracle {level:.4f}{where}")
        if y_range is not None:
            ax.set_ylim(*y_range)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(study.batch_sizes), [f"{g:,}" for g in sorted(study.batch_sizes)])
        ax.minorticks_off()
        ax.set_xlabel("global batch (rows)")
        ax.set_title(f"{study.name}: test AUC vs batch, {what}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test AUC (mean ± sd over seeds)")
    for ax in axes[0][::-1]:  # the last panel with points (a study cut short may have none)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
            break
    paths.append(_save(fig, out / "auc_vs_batch.png", label_of))

    # 2. validation AUC against rows seen, best LR, one panel per batch size
    best = {
        (s["global_batch"], s["optimizer"], s.get("groups")): s["best_lr_multiplier"]
        for s in summary
    }
    sizes = sorted(study.batch_sizes)

    def chosen(g: int, name: str, k: Any) -> list[dict[str, Any]]:
        return [
            c
            for c in cells
            if c["global_batch"] == g
            and c["optimizer"] == name
            and c.get("groups") == k
            and c["lr_multiplier"] == best.get((g, name, k))
        ]

    # A study rewritten from its results.json alone (no curves) keeps its curve plots; a curve
    # is the mean over the chosen cells that kept theirs.
    has_runs = any(c.get("val_curve") for c in cells)
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes), 4), squeeze=False)
    for ax, g in zip(axes[0], sizes if has_runs else [], strict=False):
        for name, k in series:
            curve = _mean_curve([c["val_curve"] for c in chosen(g, name, k) if c.get("val_curve")])
            if curve:
                xs, ys = zip(*curve, strict=True)
                st = style(name, k)
                st.pop("marker")
                ax.plot(xs, ys, **st)
        ax.set_title(f"batch {g:,}")
        ax.set_xlabel("rows seen")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation AUC")
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=8)
    if has_runs:
        paths.append(_save(fig, out / "auc_vs_rows.png", label_of))
    else:
        plt.close(fig)

    # 3. GSNR ratio over training (VR optimizers, best LR, seed mean), dense and tables
    fig, (ax_d, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    for name, k in series:
        if name not in gsnr:
            continue
        for g in sizes:
            dense, tables = _gsnr_curves([c.get("gsnr_curve") or [] for c in chosen(g, name, k)])
            st = {
                "color": colors[name],
                "alpha": 0.4 + 0.6 * sizes.index(g) / max(1, len(sizes) - 1),
            }
            if dense:
                ax_d.plot(*zip(*dense, strict=True), label=f"{label(name, k)} G={g:,}", **st)
            if tables:
                ax_t.plot(*zip(*tables, strict=True), label=f"{label(name, k)} G={g:,}", **st)
    for ax, what in ((ax_d, "dense layers"), (ax_t, "embedding tables")):
        ax.set_title(f"mean GSNR ratio, {what}")
        ax.set_xlabel("fraction of training")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    if ax_t.get_legend_handles_labels()[0]:
        ax_t.legend(fontsize=8)
    if has_runs:
        paths.append(_save(fig, out / "gsnr_ratio.png", label_of))
    else:
        plt.close(fig)

    # 4. test AUC against k (gradient groups per step), VR optimizers, both protocols; only
    # where some VR arm has k (a study off the groups axis has no k to plot against)
    if any(s["optimizer"] in gsnr and s.get("groups") is not None for s in summary):
        fig, axes = plt.subplots(
            1, len(protocols), figsize=(6 * len(protocols), 4), squeeze=False, sharey=True
        )
        for ax, (_, what, rows) in zip(axes[0], protocols, strict=True):
            for name in sorted(gsnr):
                for g in sizes:
                    pts = sorted(
                        (s["groups"], s["test_auc"], s["test_auc_sd"])
                        for s in rows
                        if s["optimizer"] == name
                        and s["global_batch"] == g
                        and s.get("groups") is not None
                    )
                    if not pts:
                        continue
                    xs, ys, es = zip(*pts, strict=True)
                    ax.errorbar(
                        xs,
                        ys,
                        yerr=es,
                        marker="o",
                        capsize=4,
                        color=colors[name],
                        alpha=0.4 + 0.6 * sizes.index(g) / max(1, len(sizes) - 1),
                        label=f"{name} G={g:,}",
                    )
            ax.set_xscale("log", base=2)
            ks = sorted({s["groups"] for s in summary if s.get("groups") is not None})
            ax.set_xticks(ks, [str(k) for k in ks])
            ax.minorticks_off()
            ax.set_xlabel("k: micro-batches (gradient groups) per step")
            ax.set_title(f"VR cells: test AUC vs k, {what}")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("test AUC (mean ± sd over seeds)")
        if axes[0][-1].get_legend_handles_labels()[0]:  # a study cut short may have no point
            axes[0][-1].legend(fontsize=8)
        paths.append(_save(fig, out / "auc_vs_groups.png", label_of))
    else:  # an empty plot from an older report goes
        (out / "auc_vs_groups.png").unlink(missing_ok=True)
    return paths


def _fitted(lows: list[float], highs: list[float], pad: float = 0.15) -> tuple[float, float] | None:
    """A y range around ``[min(lows), max(highs)]`` with ``pad`` of the span on each side (at
    least 0.002 wide); None without values."""
    values = [v for v in lows + highs if v == v]  # not NaN
    if not values:
        return None
    lo, hi = min(values), max(values)
    span = max(hi - lo, 0.002)
    return lo - pad * span, hi + pad * span


#: The banner over every figure of an exploratory study.
EXPLORATORY = "EXPLORATORY cells (not pre-registered): no figure here is a tested claim"


def _save(fig: Any, path: Path, banner: str | None = None) -> Path:
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp.png")
    if banner:
        fig.suptitle(banner, color="darkred", fontweight="bold")
    fig.tight_layout()
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def _mean_curve(runs: list[list[tuple[int, float, int]]]) -> list[tuple[int, float]]:
    points: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        for x, y, *_ in run:
            points[x].append(y)
    return [(x, sum(ys) / len(ys)) for x, ys in sorted(points.items()) if len(ys) == len(runs)]


def _gsnr_curves(
    curves: list[list[list[float | None]]],
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Seed-mean of the cells' weighted ratios (``gsnr_curve``: fraction of training, dense
    ratio, table ratio), against the fraction of training done."""
    dense: dict[float, list[float]] = defaultdict(list)
    tables: dict[float, list[float]] = defaultdict(list)
    for curve in curves:
        for x, d, t in curve:
            if d is not None:
                dense[x].append(d)
            if t is not None:
                tables[x].append(t)
    mean = [(x, sum(v) / len(v)) for x, v in sorted(dense.items())]
    mean_t = [(x, sum(v) / len(v)) for x, v in sorted(tables.items())]
    return mean, mean_t
