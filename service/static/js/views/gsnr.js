// Per-layer and per-table GSNR over time, as small multiples: one small chart per dense tensor
// and per embedding table, showing the normalized GSNR ratio r, the fraction clipped at γ, γ
// itself and (tables) the share of touched rows that two or more micro-batches saw on a fixed
// 0..1.05 axis, and the realised step ratio (|actual step| / |plain step from the same state|:
// whether the damping reached the weights) on a right-hand axis of its own, which grows to fit
// a ratio above 1 (VR-Adam's `gradient` placement, see adamNote: spikes near 20 were seen) and
// so never flattens r. Charts are created as tensors first appear in the GSNR records.

import { color, createChart, fixedTicks, line } from "../charts.js";
import { fill, fmt, h, isNum, pct, shortTensorName } from "../dom.js";

const SMALL_HEIGHT = 104;

/** The range of the realised step ratio's axis: 0..1.05, or up to its largest value (+5%). */
export function smallRange(u, lo, hi) {
  return [0, isNum(hi) && hi > 1 ? hi * 1.05 : 1.05];
}

/** The range of r, the fraction clipped and γ: always 0..1.05 (r ∈ [γ, 1]). */
export function unitRange() {
  return [0, 1.05];
}

/** Why VR-Adam / VR-LAMB's realised step ratio can exceed 1 under the paper's placement. */
export function adamNote(dense) {
  const name = String(dense.name ?? "");
  if (!["vradam", "vrlamb"].includes(name) || (dense.gsnr_placement ?? "gradient") !== "gradient") return null;
  return (
    `${name} with gsnr_placement: gradient (the paper's): the ratio scales the gradient that enters Adam's moments, ` +
    "not the step. Adam divides by √v̂, so a damped gradient also lowers v̂ and the step grows back; where the new " +
    "gradient opposes the momentum, damping it cancels less of m̂. The realised step ratio (actual / plain Adam step " +
    "from the same state) can therefore exceed 1, most where the plain step nearly cancels. " +
    "gsnr_placement: update damps every step by exactly p̂ ∈ [γ, 1]."
  );
}

function legendItem(label, swatchClass) {
  return h("span", { class: "legend-item" }, h("span", { class: `swatch ${swatchClass}` }), label);
}

const lastOf = (xs) => {
  for (let i = xs.length - 1; i >= 0; i--) if (xs[i] != null) return xs[i];
  return null;
};

/** One group of small multiples (dense tensors, or tables). */
class Multiples {
  constructor(parent, { kind, title, gamma, note }) {
    this.kind = kind;
    this.gamma = gamma;
    this.charts = new Map();
    this.count = h("span", { class: "muted" });
    this.note = h("p", { class: "muted small" }, note);
    this.grid = h("div", { class: "multiples", id: `gsnr-${kind}` });
    this.details = h(
      "details",
      { class: "multiples-group", open: true },
      h("summary", {}, h("span", { class: "group-title" }, title), " ", this.count),
      this.note,
      this.grid,
    );
    parent.append(this.details);
  }

  /** Redraw from a Group of the JobSeries and its steps. */
  update(group, steps) {
    const withData = [...group.items.entries()].filter(([, item]) => item.ratio.some(isNum) || (item.multi_fraction ?? []).some(isNum));
    this.count.textContent = withData.length ? `(${withData.length})` : "";
    this.note.hidden = withData.length > 0;
    for (const [name, item] of withData) {
      let entry = this.charts.get(name);
      if (!entry) entry = this.add(name);
      const gammaLine = steps.map(() => this.gamma);
      const data = this.kind === "table"
        ? [steps, item.ratio, item.frac_clipped, item.step_ratio_mean, item.multi_fraction, gammaLine]
        : [steps, item.ratio, item.frac_clipped, item.step_ratio_mean, gammaLine];
      entry.chart.set(data);
      const r = lastOf(item.ratio);
      const c = lastOf(item.frac_clipped);
      const realised = lastOf(item.step_ratio_mean);
      const stepText = isNum(realised) ? ` · step ×${fmt(realised, 2)}` : "";
      entry.value.textContent = isNum(r) ? `r ${fmt(r, 2)} · ${pct(c)} clipped${stepText}` : this.kind === "table" ? `${pct(lastOf(item.multi_fraction))} in ≥2 groups` : "";
    }
  }

  add(name) {
    const label = this.kind === "table" ? name : shortTensorName(name);
    const value = h("span", { class: "mult-value" });
    const plot = h("div", { class: "chart" });
    const cell = h(
      "div",
      { class: "mult", title: name, dataset: { name } },
      h("div", { class: "mult-head" }, h("span", { class: "mult-name" }, label), value),
      plot,
    );
    this.grid.append(cell);
    const series = [
      line("ratio", { color: color(0), width: 1.5, digits: 3 }),
      line("clipped", { color: color(1), width: 1.25, digits: 3 }),
      line("realised step ratio", { color: color(2), width: 1.25, digits: 3, dash: [6, 2], scale: "step" }),
    ];
    if (this.kind === "table") series.push(line("≥2 groups", { color: color(7), width: 1.25, digits: 3, dash: [2, 2] }));
    series.push(line("γ", { color: "#9aa3af", width: 1, dash: [3, 3], digits: 2 }));
    const chart = createChart(`gsnr:${this.kind}:${name}`, plot, {
      small: true,
      legend: false,
      height: SMALL_HEIGHT,
      xLabel: "step",
      scales: { y: { range: unitRange }, step: { range: smallRange } },
      series,
      axes: [{ ticks: fixedTicks(1) }, { scale: "step", side: 1, ticks: fixedTicks(1), color: color(2) }],
      emptyText: "",
    });
    const entry = { chart, value };
    this.charts.set(name, entry);
    return entry;
  }

  destroy() {
    for (const { chart } of this.charts.values()) chart.destroy();
    this.charts.clear();
  }
}

export class GsnrPanel {
  /**
   * container: the section to fill. config: the job's resolved TrainConfig (for γ and the
   * optimizer names, to explain an empty panel).
   */
  constructor(container, config) {
    const optim = (config && config.optim) || {};
    const dense = optim.dense || {};
    const sparse = optim.sparse || {};
    const denseGamma = isNum(dense.gamma) ? dense.gamma : 0.1;
    const sparseGamma = isNum(sparse.gamma) ? sparse.gamma : 0.1;
    // VR-* dense optimizers and gsnr_* sparse ones measure GSNR; the base ones do not
    const denseVr = String(dense.name ?? "").startsWith("vr");
    const sparseVr = String(sparse.name ?? "").startsWith("gsnr");
    const none = !denseVr && !sparseVr ? "This job's optimizers measure no GSNR. " : "";
    fill(
      container,
      h(
        "div",
        { class: "card-head" },
        h("h2", {}, "GSNR per layer and per table"),
        h(
          "div",
          { class: "legend" },
          legendItem("ratio r", "sw-ratio"),
          legendItem("fraction clipped at γ", "sw-clipped"),
          legendItem("realised step ratio (actual / plain step; its own axis, right)", "sw-step"),
          legendItem("rows seen by ≥ 2 micro-batches (tables)", "sw-multi"),
          legendItem("γ", "sw-gamma"),
        ),
      ),
    );
    this.dense = new Multiples(container, {
      kind: "dense",
      title: `Dense layers — ${dense.name ?? "?"}, γ = ${denseGamma}`,
      gamma: denseGamma,
      note: denseVr
        ? "No per-tensor GSNR yet."
        : `${none}The dense optimizer (${dense.name ?? "?"}) is not a VR-* optimizer (vrsgd, vradam, vrlars, vrlamb, vradagrad): it measures no GSNR.`,
    });
    const note = adamNote(dense);
    if (note) this.dense.details.insertBefore(h("p", { class: "muted small", id: "gsnr-adam-note" }, note), this.dense.grid);
    this.tables = new Multiples(container, {
      kind: "table",
      title: sparseVr
        ? `Embedding tables — ${sparse.name ?? "?"}, γ = ${sparseGamma}`
        : `Embedding tables — ${sparse.name ?? "?"} measures no GSNR (gsnr_${sparse.name ?? "…"} does): only the share of rows seen by ≥ 2 micro-batches`,
      gamma: sparseGamma,
      note: sparseVr ? "No per-table records yet." : `${none}No per-table records yet.`,
    });
  }

  update(series) {
    this.dense.update(series.dense, series.gsnr.step);
    this.tables.update(series.tables, series.gsnr.step);
  }

  destroy() {
    this.dense.destroy();
    this.tables.destroy();
  }
}
