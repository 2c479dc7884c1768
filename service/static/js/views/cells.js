// A study's cells, live: every finished cell (one training run of the grid) arrives as a
// metrics record of kind "cell" (dlrm_vrgd/study/run.py: global_batch, optimizer,
// lr_multiplier, seed, val/test/oracle AUC, train seconds). Shown as a chart of the best
// validation AUC so far per optimizer against the global batch, and a table of the cells.
// The study's own report (results.md, plots) is the answer; this is the view while it runs.

import { chartCard, color, createChart, fade, fittedRange, fixedTicks, join, line } from "../charts.js";
import { batchSize, fill, fmt, h, isNum } from "../dom.js";

const num = (v) => (isNum(v) ? v : null);
const fit = fittedRange(0.15, 0.004);

/** y range of the cells chart: the optimizers' series only (the last one is the oracle). */
function cellsRange(u, data = u.data) {
  const ys = data.slice(1, -1).flatMap((s) => Array.from(s).filter(isNum));
  if (!ys.length) return [0.5, 1];
  return fit(u, Math.min(...ys), Math.max(...ys));
}

export class StudyCells {
  constructor(container) {
    this.container = container;
    this.cells = new Map(); // cell id -> record (a re-run cell replaces its record)
    this.lastSeq = 0;
    this.version = 0;
    this.drawn = -1;
    this.chart = null;
    this.tbody = null;
    this.optimizers = "";
    container.hidden = true;
  }

  /** Add a `kind: cell` record; false when it was seen before. */
  add(rec) {
    if (isNum(rec.seq)) {
      if (rec.seq <= this.lastSeq) return false;
      this.lastSeq = rec.seq;
    }
    const id = typeof rec.cell === "string" ? rec.cell : `${rec.global_batch}-${rec.optimizer}-${rec.lr_multiplier}-${rec.seed}`;
    this.cells.set(id, rec);
    this.version += 1;
    return true;
  }

  /** Build the section on first data, then redraw when something changed. */
  update() {
    if (!this.cells.size || this.version === this.drawn) return;
    this.drawn = this.version;
    if (!this.tbody) this.build();
    const cells = [...this.cells.values()];
    const total = Math.max(0, ...cells.map((c) => (isNum(c.total_cells) ? c.total_cells : 0)));
    this.count.textContent = total ? `${cells.length} of ${total} cells finished` : `${cells.length} cells finished`;

    // best validation AUC so far per (optimizer, batch)
    const optimizers = [...new Set(cells.map((c) => String(c.optimizer)))].sort();
    const batches = [...new Set(cells.map((c) => c.global_batch).filter(isNum))].sort((a, b) => a - b);
    if (optimizers.join() !== this.optimizers) this.makeChart(optimizers);
    const tables = optimizers.map((opt) => {
      const ys = batches.map((g) => {
        const aucs = cells.filter((c) => c.optimizer === opt && c.global_batch === g).map((c) => num(c.val_auc)).filter(isNum);
        return aucs.length ? Math.max(...aucs) : null;
      });
      const keep = ys.map((y, i) => (y === null ? -1 : i)).filter((i) => i >= 0);
      return [keep.map((i) => batches[i]), keep.map((i) => ys[i])];
    });
    const oracles = cells.map((c) => num(c.oracle_auc)).filter(isNum);
    const oracle = oracles.length ? oracles.reduce((a, b) => a + b, 0) / oracles.length : null;
    const data = join(tables);
    data.push(data[0].map(() => oracle));
    this.chart.set(data);
    const [lo, hi] = cellsRange(this.chart.u, data);
    this.subtitle.textContent = !isNum(oracle) ? "" : `oracle AUC ${fmt(oracle)}${oracle > hi ? " (above the range)" : oracle < lo ? " (below the range)" : ""}`;

    const sorted = cells.sort((a, b) =>
      (a.global_batch - b.global_batch) || String(a.optimizer).localeCompare(String(b.optimizer)) ||
      (a.lr_multiplier - b.lr_multiplier) || (a.seed - b.seed));
    fill(this.tbody, sorted.map((c) => h(
      "tr",
      { dataset: { cell: c.cell ?? "" } },
      h("td", { class: "num" }, batchSize(c.global_batch)),
      h("td", {}, h("span", { class: "swatch", style: { background: color(optimizers.indexOf(String(c.optimizer))) } }), " ", String(c.optimizer)),
      h("td", { class: "num" }, isNum(c.lr_multiplier) ? `×${c.lr_multiplier}` : "–"),
      h("td", { class: "num" }, isNum(c.seed) ? String(c.seed) : "–"),
      h("td", { class: "num" }, fmt(c.val_auc)),
      h("td", { class: "num" }, fmt(c.test_auc)),
      h("td", { class: "num" }, fmt(c.oracle_auc)),
      h("td", { class: "num" }, isNum(c.train_seconds) ? c.train_seconds.toFixed(1) : "–"),
      h("td", { class: "muted" }, c.status === "skip" ? "from an earlier run" : ""),
    )));
  }

  build() {
    this.count = h("span", { class: "muted small", id: "cells-count" });
    const card = chartCard("Best validation AUC so far, by global batch", {
      help: "Per optimizer: the best finished cell (any LR, any seed) at each batch size; dashed: the oracle AUC. The report's figures select the LR on validation and average the seeds.",
      wide: true,
    });
    this.plot = card.plot;
    this.subtitle = card.subtitle;
    this.tbody = h("tbody", { id: "cells-body" });
    fill(
      this.container,
      h("div", { class: "card-head" }, h("h2", {}, "Cells"), this.count),
      card.card,
      h("div", { class: "table-scroll cells-scroll" }, h("table", { class: "data", id: "cells" },
        h("thead", {}, h("tr", {}, ...["Batch", "Optimizer", "LR", "Seed", "Val AUC", "Test AUC", "Oracle AUC", "Train s", ""].map((t, i) => h("th", { class: i !== 1 && i < 8 ? "num" : null }, t)))),
        this.tbody)),
    );
    this.container.hidden = false;
  }

  /** (Re)make the chart: one series per optimizer, then the oracle. */
  makeChart(optimizers) {
    this.chart?.destroy();
    this.optimizers = optimizers.join();
    this.chart = createChart("study-cells", this.plot, {
      height: 260,
      xLabel: "global batch",
      // y fitted to the cells' AUCs (the oracle, often far above, would squeeze them flat at
      // the bottom); the oracle's value is beside the title when it falls outside
      scales: { x: { time: false, distr: 3, log: 2 }, y: { range: (u) => cellsRange(u) } },
      series: [
        ...optimizers.map((opt, i) => line(opt, { color: color(i), points: true, width: 2 })),
        line("oracle AUC", { color: fade("#6b7280", 0.7), dash: [6, 4] }),
      ],
      axes: [{ label: "validation AUC", ticks: fixedTicks(3) }],
    });
  }

  destroy() {
    this.chart?.destroy();
    this.chart = null;
  }
}
