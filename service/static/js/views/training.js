// The job page's four training charts, drawn from a JobSeries:
//   loss vs step (train loss, validation logloss), AUC vs rows seen beside the oracle AUC,
//   mean GSNR ratio and fraction clipped (dense layers, tables), learning rates.

import { chartCard, color, createChart, fade, fixedTicks, join, line } from "../charts.js";
import { compact, fmt, isNum, pct } from "../dom.js";

const last = (xs) => {
  for (let i = xs.length - 1; i >= 0; i--) if (xs[i] != null) return xs[i];
  return null;
};

/** Learning-rate ticks: 0.005, 0.01, 1.5e-4 (no padded zeros). */
const lrTicks = (u, values) => values.map((v) => (v == null ? "" : v === 0 ? "0" : Math.abs(v) < 1e-3 ? v.toExponential(1) : String(+v.toPrecision(2))));

export class TrainingCharts {
  /** Build the cards into `grid` (a .chart-grid element); `config` is the job's config. */
  constructor(grid, config) {
    const optim = (config && config.optim) || {};
    const dense = (optim.dense && optim.dense.name) || "?";
    const sparse = (optim.sparse && optim.sparse.name) || "?";
    // VR-* dense optimizers and GSNR-aware sparse ones report GSNR; the base ones do not
    const reportsGsnr = dense.startsWith("vr") || sparse.startsWith("gsnr");
    const loss = chartCard("Loss", { help: "Training loss per step; validation logloss at each eval." });
    const auc = chartCard("AUC vs rows seen", { help: "Model AUC beside the oracle AUC (the true click probabilities' AUC on the same rows: the ceiling)." });
    const gsnr = chartCard("GSNR ratio and fraction clipped", { help: "Mean normalized GSNR ratio r ∈ [γ, 1] and share of elements/rows clipped at γ." });
    const lr = chartCard("Learning rate", { help: "Dense (left axis) and sparse (right axis) learning rates." });
    grid.append(auc.card, loss.card, gsnr.card, lr.card);
    this.subtitles = { loss: loss.subtitle, auc: auc.subtitle, gsnr: gsnr.subtitle, lr: lr.subtitle };

    this.loss = createChart("loss", loss.plot, {
      xLabel: "step",
      series: [
        line("train loss", { color: color(0), width: 1.25 }),
        line("val logloss", { color: color(1), points: true }),
      ],
      axes: [{ label: "loss", ticks: fixedTicks(3) }],
    });
    this.auc = createChart("auc", auc.plot, {
      xLabel: "rows seen",
      series: [
        line("val AUC", { color: color(0), points: true, width: 2 }),
        line("val oracle AUC", { color: fade(color(0), 0.6), dash: [6, 4] }),
        line("test AUC", { color: color(3), points: true, width: 2 }),
        line("test oracle AUC", { color: fade(color(3), 0.6), dash: [6, 4], points: true }),
      ],
      axes: [{ label: "AUC", ticks: fixedTicks(3) }],
      emptyText: "No evaluation yet (run.eval_every sets how often the job evaluates).",
    });
    this.gsnr = createChart("gsnr-summary", gsnr.plot, {
      xLabel: "step",
      scales: { y: { range: [0, 1] } },
      series: [
        line("dense ratio", { color: color(0) }),
        line("dense clipped", { color: color(0), dash: [4, 3], width: 1.25 }),
        line("tables ratio", { color: color(2) }),
        line("tables clipped", { color: color(2), dash: [4, 3], width: 1.25 }),
      ],
      axes: [{ label: "ratio / fraction", ticks: fixedTicks(1) }],
      emptyText: reportsGsnr
        ? "Waiting for data…"
        : `No GSNR figures: ${dense} and ${sparse} compute none (VR-* optimizers do).`,
    });
    this.lr = createChart("lr", lr.plot, {
      xLabel: "step",
      scales: { lr_sparse: { auto: true } },
      series: [
        line("dense LR", { color: color(4), digits: 6 }),
        line("sparse LR", { color: color(5), scale: "lr_sparse", digits: 6 }),
      ],
      axes: [
        { label: "dense", ticks: lrTicks },
        { scale: "lr_sparse", label: "sparse", side: 1, ticks: lrTicks },
      ],
    });
  }

  /** Redraw from `s` (a JobSeries). */
  update(s) {
    const t = s.train;
    const val = s.evals.val;
    const test = s.evals.test;
    this.loss.set(join([[t.step, t.loss], [val.step, val.logloss]]));
    this.auc.set(join([[val.samples, val.auc, val.oracle_auc], [test.samples, test.auc, test.oracle_auc]]));
    this.gsnr.set(join([
      [t.step, t.gsnr_ratio, t.gsnr_frac_clipped],
      [s.gsnr.step, s.gsnr.table_ratio, s.gsnr.table_frac_clipped],
    ]));
    this.lr.set([t.step, t.lr_dense, t.lr_sparse]);

    // the latest figures beside each title
    const lastLoss = last(t.loss);
    this.subtitles.loss.textContent = isNum(lastLoss) ? `last ${fmt(lastLoss)}` : "";
    const vAuc = last(val.auc);
    const vOracle = last(val.oracle_auc);
    this.subtitles.auc.textContent = isNum(vAuc)
      ? `val ${fmt(vAuc)} · oracle ${fmt(vOracle)} · gap ${isNum(vOracle) ? fmt(vOracle - vAuc) : "–"}`
      : "";
    const dr = last(t.gsnr_ratio);
    const tr = last(s.gsnr.table_ratio);
    const parts = [];
    if (isNum(dr)) parts.push(`dense ${fmt(dr, 3)} (${pct(last(t.gsnr_frac_clipped))} clipped)`);
    if (isNum(tr)) parts.push(`tables ${fmt(tr, 3)} (${pct(last(s.gsnr.table_frac_clipped))} clipped)`);
    this.subtitles.gsnr.textContent = parts.join(" · ");
    const lrd = last(t.lr_dense);
    this.subtitles.lr.textContent = isNum(lrd) ? `dense ${lrd.toPrecision(3)} · sparse ${compact(last(t.lr_sparse), 3)}` : "";
  }

  destroy() {
    for (const c of [this.loss, this.auc, this.gsnr, this.lr]) c.destroy();
  }
}

