// The job page's data: metric and GSNR records (history from the REST series, then live ones
// from the event stream) kept as column arrays that the charts draw directly.
//
// Records carry `seq`, their place in the job's record sequence: a record at or below the last
// seq seen for its stream is a duplicate (history and stream overlap) and is dropped. A step
// that goes back (a resumed run re-logs steps after its checkpoint) replaces what followed.

import { isNum } from "./dom.js";

/** Most points kept per series before thinning to every other one (keeps redraws cheap). */
const MAX_TRAIN_POINTS = 8000;
const MAX_GSNR_POINTS = 1500;

const TRAIN_KEYS = ["step", "samples", "loss", "lr_dense", "lr_sparse", "rows_per_s", "gsnr_ratio", "gsnr_frac_clipped", "step_seconds", "data_wait_s"];
const EVAL_KEYS = ["step", "samples", "auc", "oracle_auc", "logloss", "ne", "calibration"];

const num = (v) => (isNum(v) ? v : null);

function columns(keys) {
  return Object.fromEntries(keys.map((k) => [k, []]));
}

/** Drop the entries at and after the first index whose x is >= `x` (all columns alike). */
function truncateFrom(cols, xs, x) {
  let i = xs.length;
  while (i > 0 && xs[i - 1] >= x) i -= 1;
  if (i === xs.length) return;
  for (const arr of Object.values(cols)) if (Array.isArray(arr)) arr.length = Math.min(arr.length, i);
}

/** Keep every other entry (and the last) of every column. */
function thin(cols) {
  for (const [key, arr] of Object.entries(cols)) {
    if (!Array.isArray(arr) || arr.length < 2) continue;
    const last = arr[arr.length - 1];
    const kept = arr.filter((_, i) => i % 2 === 0);
    if ((arr.length - 1) % 2 !== 0) kept.push(last);
    cols[key] = kept;
  }
}

/** Per-tensor (or per-table) columns aligned with the GSNR steps. */
class Group {
  constructor(keys) {
    this.keys = keys;
    this.items = new Map(); // name -> {key: []}
  }

  /** Append one step's entries; names absent at this step get null. */
  push(length, entries, nameOf) {
    const seen = new Set();
    for (const entry of entries) {
      const name = nameOf(entry);
      if (typeof name !== "string") continue;
      let item = this.items.get(name);
      if (!item) {
        // a tensor first seen now: pad its history with nulls
        item = Object.fromEntries(this.keys.map((k) => [k, new Array(length).fill(null)]));
        this.items.set(name, item);
      }
      for (const k of this.keys) item[k].push(k === "multi_fraction" ? multiFraction(entry) : num(entry[k]));
      seen.add(name);
    }
    for (const [name, item] of this.items) {
      if (!seen.has(name)) for (const k of this.keys) item[k].push(null);
    }
  }

  truncate(length) {
    for (const item of this.items.values()) for (const k of this.keys) item[k].length = length;
  }

  thin() {
    for (const item of this.items.values()) thin(item);
  }
}

function multiFraction(t) {
  return isNum(t.touched_rows) && t.touched_rows > 0 && isNum(t.multi_group_rows)
    ? t.multi_group_rows / t.touched_rows
    : null;
}

export class JobSeries {
  constructor() {
    this.train = columns(TRAIN_KEYS);
    this.evals = { val: columns(EVAL_KEYS), test: columns(EVAL_KEYS) };
    // noise_*: the gradient noise scale B_simple (model, dense, tables) and the run's global
    // batch G, per GSNR record; noiseReason: why the last record had no estimate (k = 1)
    this.gsnr = { step: [], table_ratio: [], table_frac_clipped: [], noise_model: [], noise_dense: [], noise_tables: [], noise_g: [] };
    this.noiseReason = null;
    this.dense = new Group(["ratio", "frac_clipped", "raw_gsnr", "step_ratio_mean"]);
    this.tables = new Group(["ratio", "frac_clipped", "multi_fraction", "step_ratio_mean"]);
    this.lastSeq = { metrics: 0, gsnr: 0 };
    /** Bumped on every change; views redraw when it moved. */
    this.version = 0;
  }

  /** Add a metrics record (train step or eval); false when it was a duplicate. */
  addMetrics(rec) {
    if (isNum(rec.seq)) {
      if (rec.seq <= this.lastSeq.metrics) return false;
      this.lastSeq.metrics = rec.seq;
    }
    if (!isNum(rec.step)) return false;
    if (rec.kind === "train") {
      truncateFrom(this.train, this.train.step, rec.step);
      for (const k of TRAIN_KEYS) this.train[k].push(num(rec[k]));
      if (this.train.step.length > MAX_TRAIN_POINTS) thin(this.train);
    } else if (rec.kind === "eval" && this.evals[rec.split]) {
      const cols = this.evals[rec.split];
      truncateFrom(cols, cols.step, rec.step);
      for (const k of EVAL_KEYS) cols[k].push(num(rec[k]));
    } else {
      return false;
    }
    this.version += 1;
    return true;
  }

  /** Add a GSNR record (per step: dense tensors, tables); false when it was a duplicate. */
  addGsnr(rec) {
    if (isNum(rec.seq)) {
      if (rec.seq <= this.lastSeq.gsnr) return false;
      this.lastSeq.gsnr = rec.seq;
    }
    if (!isNum(rec.step)) return false;
    const g = this.gsnr;
    if (g.step.length && g.step[g.step.length - 1] >= rec.step) {
      truncateFrom(g, g.step, rec.step);
      this.dense.truncate(g.step.length);
      this.tables.truncate(g.step.length);
    }
    const tables = Array.isArray(rec.tables) ? rec.tables.filter((t) => t && typeof t === "object") : [];
    const dense = Array.isArray(rec.dense) ? rec.dense.filter((t) => t && typeof t === "object") : [];
    const ratios = tables.map((t) => t.ratio).filter(isNum);
    const clipped = tables.map((t) => t.frac_clipped).filter(isNum);
    this.dense.push(g.step.length, dense, (t) => t.name);
    this.tables.push(g.step.length, tables, (t) => t.table);
    g.step.push(rec.step);
    g.table_ratio.push(ratios.length ? mean(ratios) : null);
    g.table_frac_clipped.push(clipped.length ? mean(clipped) : null);
    const ns = rec.noise_scale && typeof rec.noise_scale === "object" ? rec.noise_scale : {};
    const bSimple = (scope) => (ns[scope] && typeof ns[scope] === "object" ? num(ns[scope].b_simple) : null);
    g.noise_model.push(bSimple("model"));
    g.noise_dense.push(bSimple("dense"));
    g.noise_tables.push(bSimple("tables"));
    g.noise_g.push(num(ns.global_batch));
    this.noiseReason = typeof ns.reason === "string" ? ns.reason : null;
    if (g.step.length > MAX_GSNR_POINTS) {
      thin(g);
      this.dense.thin();
      this.tables.thin();
    }
    this.version += 1;
    return true;
  }

  /** The highest step seen in train records (null before any). */
  lastStep() {
    const s = this.train.step;
    return s.length ? s[s.length - 1] : null;
  }
}

function mean(xs) {
  return xs.reduce((a, b) => a + b, 0) / xs.length;
}
