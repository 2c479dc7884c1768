// The job page's training charts, drawn from a JobSeries:
//   loss vs step (train loss, validation logloss), AUC vs rows seen beside the oracle AUC,
//   mean GSNR ratio and fraction clipped (dense layers, tables), learning rates, the
//   gradient noise scale B_simple against the run's own global batch G (log axis, in rows),
//   and each step's time beside the part of it spent waiting for input (data_wait_s).

import { chartCard, color, compactTicks, createChart, fade, fixedTicks, join, line } from "../charts.js";
import { compact, fmt, isNum, pct } from "../dom.js";

const last = (xs) => {
  for (let i = xs.length - 1; i >= 0; i--) if (xs[i] != null) return xs[i];
  return null;
};

/**
 * Learning-rate ticks: 0.005, 0.01, 1.5e-4 (no padded zeros; none below 0), with as many
 * significant digits as it takes for neighbouring ticks not to read the same.
 */
const lrTicks = (u, values) => {
  const label = (v, p) => (v == null || v < 0 ? "" : v === 0 ? "0" : Math.abs(v) < 1e-3 ? v.toExponential(p - 1) : String(+v.toPrecision(p)));
  const shown = values.filter((v) => v != null && v >= 0);
  let p = 2;
  while (p < 6 && new Set(shown.map((v) => label(v, p))).size < shown.length) p += 1;
  return values.map((v) => label(v, p));
};

/**
 * The LR chart's two y scales: the dense LR is drawn in the upper half of the plot, the sparse
 * LR in the lower half, each on its own axis. Two constant LRs (the default schedule) would
 * otherwise both sit mid-height on their auto-ranged axes, one hiding the other.
 */
export function lrRange(upper) {
  return (u, min, max) => {
    if (min == null || max == null || !isFinite(min) || !isFinite(max)) return [0, 1];
    const span = max > min ? max - min : Math.abs(max) * 0.1 || 1e-6;
    return upper ? [min - 1.2 * span, max + 0.2 * span] : [min - 0.2 * span, max + 1.2 * span];
  };
}

/** A log axis spanning the positive values with a margin (a decade when there are none). */
function logRange(u, min, max) {
  if (!isNum(min) || !isNum(max) || min <= 0) return [1, 10];
  return [min / 1.5, max * 1.5];
}

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
    const lr = chartCard("Learning rate", { help: "Dense LR: left axis, upper half. Sparse LR: right axis, lower half (two scales, offset so that neither line hides the other)." });
    const noise = chartCard("Gradient noise scale B_simple vs the global batch G", {
      wide: true,
      help: "B_simple = EMA(S) / EMA(|G|²) (McCandlish et al. 2018): the batch, in rows, past which the paper's model says more rows per step stop paying (steps S/S_min = 1 + B_simple/B, rows E/E_min = 1 + B/B_simple). The dashed line is this run's global batch G. `dlrm-vrgd advise` reads the same records.",
    });
    const wait = chartCard("Step time and input wait", {
      help: "Seconds per step, and how many of them the step waited for its micro-batches (data_wait_s). A wait close to the step time: the trainer starves for input (the GPU idles); see run.input, or generate the data once as day files.",
    });
    grid.append(auc.card, loss.card, gsnr.card, lr.card, noise.card, wait.card);
    this.subtitles = { loss: loss.subtitle, auc: auc.subtitle, gsnr: gsnr.subtitle, lr: lr.subtitle, noise: noise.subtitle, wait: wait.subtitle };

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
        // the end-of-run figure: one point per job, so drawn large and filled
        line("test AUC", { color: color(3), points: true, width: 2, pointSize: 11, pointFill: color(3) }),
        line("test oracle AUC", { color: fade(color(3), 0.6), dash: [6, 4], points: true, pointSize: 9 }),
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
    this.noise = createChart("noise-scale", noise.plot, {
      xLabel: "step",
      scales: { y: { distr: 3, range: logRange } },
      series: [
        line("B_simple (model)", { color: color(0), width: 2, digits: 0 }),
        line("B_simple (dense)", { color: color(4), width: 1.25, digits: 0 }),
        line("B_simple (tables)", { color: color(2), width: 1.25, digits: 0 }),
        line("global batch G", { color: "#6b7280", width: 1.5, dash: [6, 4], digits: 0 }),
      ],
      axes: [{ label: "batch size (rows)", ticks: compactTicks }],
      emptyText: "No noise-scale estimate yet (it needs k ≥ 2 micro-batches per step).",
    });
    this.wait = createChart("input-wait", wait.plot, {
      xLabel: "step",
      series: [
        line("step time (s)", { color: color(0), width: 1.5, digits: 3 }),
        line("input wait (s)", { color: color(3), width: 1.5, digits: 3 }),
      ],
      axes: [{ label: "seconds", ticks: fixedTicks(2) }],
      emptyText: "No step times yet (runs from before the input pipeline record no wait).",
    });
    this.lr = createChart("lr", lr.plot, {
      xLabel: "step",
      scales: { y: { range: lrRange(true) }, lr_sparse: { auto: true, range: lrRange(false) } },
      series: [
        line("dense LR", { color: color(4), digits: 6, width: 2 }),
        line("sparse LR", { color: color(5), scale: "lr_sparse", digits: 6, width: 2, dash: [6, 3] }),
      ],
      axes: [
        { label: "dense LR (upper)", ticks: lrTicks, color: color(4) },
        { scale: "lr_sparse", label: "sparse LR (lower)", side: 1, ticks: lrTicks, color: color(5) },
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
    const g = s.gsnr;
    this.noise.set([g.step, g.noise_model, g.noise_dense, g.noise_tables, g.noise_g]);

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
    this.wait.set([t.step, t.step_seconds, t.data_wait_s]);
    const st = last(t.step_seconds);
    const dw = last(t.data_wait_s);
    this.subtitles.wait.textContent = isNum(st) && isNum(dw) && st > 0
      ? `last step ${fmt(st, 3)} s · input wait ${pct(dw / st)}`
      : "";
    const bn = last(g.noise_model);
    const gb = last(g.noise_g);
    this.subtitles.noise.textContent = s.noiseReason
      ? `no estimate: ${s.noiseReason}`
      : isNum(bn) && isNum(gb)
        ? `latest smoothed B_simple ${compact(bn, 3)} · G ${compact(gb, 3)} (the advice below judges the window's estimate)`
        : "";
  }

  destroy() {
    for (const c of [this.loss, this.auc, this.gsnr, this.lr, this.noise, this.wait]) c.destroy();
  }
}

