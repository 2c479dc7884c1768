// One job: header (state, timing, cancel), headline figures, live training charts, GSNR small
// multiples, results files (studies), and tabs for logs, config, artifacts, final metrics.
//
// Data flow: the job snapshot and the downsampled history come from the REST API; then the
// event stream (fetch-streamed SSE, see sse.js) delivers every new record, resuming after the
// history's last record so nothing is missed; charts redraw at most every REDRAW_MS.

import { ApiError, api, downloadArtifact } from "../api.js";
import { destroyAll } from "../charts.js";
import { badge, compact, duration, elapsed, fill, fmt, h, int, isNum, localTime, pct, progressBar, toast } from "../dom.js";
import { JobSeries } from "../series.js";
import { followEvents } from "../sse.js";
import { GsnrPanel } from "./gsnr.js";
import { oracleAuc, progressFraction, progressText } from "./jobs.js";
import { artifactsTab, configTab, logsTab, resultTab, tabStrip } from "./panels.js";
import { StudyCells } from "./cells.js";
import { ResultsSection } from "./results.js";
import { TrainingCharts } from "./training.js";

const REDRAW_MS = 250;
/** Seconds between re-reads of the job's summary while it is active. */
const SNAPSHOT_EVERY_S = 3;
const ACTIVE = new Set(["queued", "running"]);
/** History fetched before following the stream (per series; first and last included). */
const HISTORY_METRICS = 2000;
const HISTORY_GSNR = 400;

const STREAM_LABELS = {
  connecting: "connecting…",
  live: "live",
  reconnecting: "reconnecting…",
  ended: "finished",
  error: "stream unavailable",
};

export async function jobView(main, jobId) {
  const stop = new AbortController();
  const state = (window.dashboard.job = { id: jobId, stream: "connecting", events: 0, lastEvent: null });
  const path = `/jobs/${encodeURIComponent(jobId)}`;

  let job;
  try {
    job = await api(path);
  } catch (err) {
    if (err instanceof ApiError && err.status === 404) {
      fill(main, h("section", { class: "card notice" }, h("h1", {}, "No such job"), h("p", {}, `The service has no job ${jobId}.`), h("a", { href: "/ui/" }, "← All jobs")));
      return { stop: () => {} };
    }
    throw err;
  }

  // ------------------------------------------------------------------ layout
  const title = h("h1", { class: "job-title" });
  const stateSlot = h("span", { id: "job-state" });
  const streamBadge = h("span", { class: "stream", id: "stream-status" });
  const meta = h("div", { class: "job-meta muted" });
  const cancelBtn = h("button", { type: "button", class: "btn btn-danger", id: "cancel-job" }, "Cancel job");
  const compareLink = h("a", { class: "btn", href: `/ui/compare?ids=${encodeURIComponent(jobId)}`, title: "Compare this job's AUC curve with others" }, "Compare…");
  compareLink.hidden = job.kind !== "train";
  // a succeeded train job's model (GET /jobs/{id}/model, a tar); a score job's predictions and
  // the job whose model it used
  const modelBtn = h("button", { type: "button", class: "btn", id: "download-model", title: "The exported model (dlrm-vrgd export) as a tar archive" }, "Download model");
  const predictionsBtn = h("button", { type: "button", class: "btn", id: "download-predictions" }, "Download predictions");
  const modelJob = (job.config || {}).model_job;
  const modelJobLink = h("a", { class: "btn", id: "model-job", href: modelJob ? `/ui/jobs/${encodeURIComponent(modelJob)}` : "#" }, "Model's train job");
  modelJobLink.hidden = job.kind !== "score";
  const progressSlot = h("div", { class: "job-progress" });
  const tiles = h("div", { class: "tiles", id: "tiles" });
  const errorBox = h("pre", { class: "error-box", id: "job-error", hidden: true });
  // one line per attempt once a job was retried (a node lost, a rank killed...)
  const attemptsBox = h("ol", { class: "attempts muted small", id: "job-attempts", hidden: true });
  const chartGrid = h("div", { class: "chart-grid", id: "charts" });
  const gsnrSection = h("section", { class: "card gsnr-section", id: "gsnr" });
  // a train job's batch-size advice: the API's `text`, the very words `dlrm-vrgd advise` prints
  const adviceText = h("pre", { class: "code advice-text", id: "advice-text" });
  const adviceSection = h(
    "section",
    { class: "card advice-section", id: "advice", hidden: true },
    h("div", { class: "card-head" }, h("h3", {}, "Batch-size advice"), h("span", { class: "muted small" }, "dlrm-vrgd advise: B_simple over the last half of the steps recorded")),
    adviceText,
  );
  const resultsBox = h("section", { class: "card results", id: "results" });
  const cellsBox = h("section", { class: "card cells-section", id: "study-cells" });
  const tabsBox = h("section", { class: "card tabs-card" });
  const dialog = cancelDialog();

  fill(
    main,
    h("a", { class: "back", href: "/ui/" }, "← All jobs"),
    h(
      "div",
      { class: "job-head" },
      h("div", { class: "job-head-main" }, h("div", { class: "title-row" }, title, stateSlot, streamBadge), meta),
      h("div", { class: "job-actions" }, modelBtn, predictionsBtn, modelJobLink, compareLink, cancelBtn),
    ),
    progressSlot,
    errorBox,
    attemptsBox,
    tiles,
    resultsBox,
    cellsBox,
    chartGrid,
    gsnrSection,
    adviceSection,
    tabsBox,
    dialog.el,
  );

  const series = new JobSeries();
  const isTrain = job.kind === "train";
  let charts = null;
  let gsnr = null;
  /** Training charts for train jobs; for other kinds only once metric records exist. */
  const ensureCharts = () => {
    if (charts) return;
    charts = new TrainingCharts(chartGrid, job.config);
    gsnr = new GsnrPanel(gsnrSection, job.config);
  };
  if (isTrain) ensureCharts();
  else gsnrSection.hidden = true;

  const results = new ResultsSection(resultsBox, jobId);
  const cells = new StudyCells(cellsBox); // a study's cells (metrics records of kind "cell")
  const tabs = tabStrip(tabsBox, [
    logsTab(jobId, () => ACTIVE.has(job.state)),
    configTab(job),
    artifactsTab(jobId),
    resultTab(jobId),
  ]);

  // ------------------------------------------------------------------ header
  function renderHeader() {
    title.textContent = job.name;
    fill(stateSlot, badge(job.state));
    const ran = elapsed(job);
    const parts = [
      h("span", { class: "mono" }, job.id),
      job.kind,
      `created ${localTime(job.created_at)}`,
    ];
    if (job.started_at) parts.push(`${job.finished_at ? "ran" : "running for"} ${duration(ran)}`);
    if (job.finished_at) parts.push(`finished ${localTime(job.finished_at)}`);
    if (isNum(job.exit_code)) parts.push(`exit ${job.exit_code}`);
    else if (job.started_at && job.finished_at) parts.push(h("span", { title: "Nothing recorded how the job's process ended (it was re-attached after a restart and killed outright)" }, "exit unknown"));
    if (job.slurm_job_id) parts.push(h("span", { class: "mono" }, `Slurm job ${job.slurm_job_id}`));
    if (job.attempt > 1) parts.push(h("span", { id: "job-attempt" }, `attempt ${job.attempt} of ${job.max_retries + 1}`));
    if (job.backend_state && ACTIVE.has(job.state)) parts.push(h("span", { id: "job-backend-state", class: "mono" }, job.backend_state));
    fill(meta, parts.flatMap((p, i) => (i ? [" · ", p] : [p])));
    cancelBtn.hidden = !ACTIVE.has(job.state);
    modelBtn.hidden = !(job.kind === "train" && job.state === "succeeded");
    predictionsBtn.hidden = !(job.kind === "score" && job.state === "succeeded");
    const unit = { train: " steps", study: " cells" }[job.kind] ?? "";
    const suffix = isNum((job.progress || {}).step) ? unit : "";
    fill(progressSlot, progressBar(progressFraction(job), `${progressText(job)}${suffix}`));
    errorBox.hidden = !job.error;
    errorBox.textContent = job.error || "";
    renderAttempts();
    renderTiles();
    document.title = `${job.name} · ${job.state} — dlrm-vrgd`;
    state.jobState = job.state;
  }

  function renderAttempts() {
    const attempts = job.attempts || [];
    attemptsBox.hidden = attempts.length < 2;
    fill(
      attemptsBox,
      attempts.map((a) => {
        const bits = [`Attempt ${a.attempt}`];
        if (isNum(a.resumed_from_step)) bits.push(`resumed from step ${int(a.resumed_from_step)}`);
        if (a.nodes) bits.push(`on ${a.nodes}`);
        if (a.backend_id) bits.push(job.backend === "slurm" ? `Slurm job ${a.backend_id}` : `pid ${a.backend_id}`);
        bits.push(a.ended ? `ended: ${a.ended}` : "running");
        return h("li", { dataset: { attempt: a.attempt } }, bits.join(" · "));
      }),
    );
  }

  function tile(label, value, note, key) {
    return h("div", { class: "tile", dataset: { tile: key } }, h("div", { class: "tile-label" }, label), h("div", { class: "tile-value" }, value), h("div", { class: "tile-note muted" }, note || ""));
  }

  function renderTiles() {
    const p = job.progress || {};
    if (job.kind === "study") {
      // the best validation AUC over the finished cells (not the last cell's), then the last cell
      const done = isNum(p.step) ? `${int(p.step)} of ${int(p.total_steps)} cells` : "no cell finished yet";
      fill(
        tiles,
        tile("Best val AUC", fmt(p.best_val_auc), p.best_cell ? `cell ${p.best_cell}` : done, "best-auc"),
        tile("Its test AUC", fmt(p.best_cell_test_auc), "of the best-validation cell", "best-test-auc"),
        tile("Last cell", p.last_cell ? String(p.last_cell) : "–", isNum(p.val_auc) ? `val ${fmt(p.val_auc)} · test ${fmt(p.test_auc)}` : done, "last-cell"),
        tile("Oracle AUC", fmt(p.test_oracle_auc), "the ceiling (last cell's test rows)", "oracle-auc"),
      );
      tiles.hidden = false;
      return;
    }
    if (job.kind === "score") {
      fill(
        tiles,
        tile("Rows scored", int(p.rows), isNum(p.fraction) ? `${pct(p.fraction)} of the input read` : "", "rows"),
        tile("Rows/s", int(p.rows_per_s), "scoring throughput", "rows-per-s"),
        tile("AUC", fmt(p.auc), isNum(p.logloss) ? `logloss ${fmt(p.logloss)}` : ACTIVE.has(job.state) ? "at the end" : "no labels", "auc"),
      );
      tiles.hidden = false;
      return;
    }
    if (!isTrain) {
      // other kinds: whatever progress they report, but what the progress bar shows
      const skip = new Set(["updated_at", "fraction", "step", "total_steps"]);
      const entries = Object.entries(p).filter(([k, v]) => !skip.has(k) && v !== null && typeof v !== "object");
      tiles.hidden = !entries.length;
      fill(tiles, entries.slice(0, 12).map(([k, v]) => tile(k.replaceAll("_", " "), isNum(v) ? (Number.isInteger(v) ? int(v) : fmt(v)) : String(v), "", k)));
      return;
    }
    const oracle = oracleAuc(p);
    const best = p.best_val_auc;
    fill(
      tiles,
      tile("Loss", fmt(p.loss), isNum(p.step) ? `step ${int(p.step)}` : "", "loss"),
      tile("Best val AUC", fmt(best), isNum(p.best_val_step) ? `at step ${int(p.best_val_step)}` : "no eval yet", "best-auc"),
      tile("Oracle AUC", fmt(oracle), isNum(best) && isNum(oracle) ? `gap ${fmt(oracle - best)}` : "the ceiling", "oracle-auc"),
      tile("Test AUC", fmt(p.test_auc), isNum(p.test_oracle_auc) ? `oracle ${fmt(p.test_oracle_auc)}` : ACTIVE.has(job.state) ? "at the end" : "not evaluated", "test-auc"),
      tile("Rows/s (last step)", compact(p.rows_per_s), isNum(p.samples) ? `${compact(p.samples)} rows seen` : "", "rows-per-s"),
      tile("GSNR dense", fmt(p.gsnr_ratio, 3), isNum(p.gsnr_frac_clipped) ? `${pct(p.gsnr_frac_clipped)} clipped` : "mean ratio", "gsnr-dense"),
      tile("GSNR tables", fmt(p.table_gsnr_ratio, 3), isNum(p.table_frac_clipped) ? `${pct(p.table_frac_clipped)} clipped` : "mean ratio", "gsnr-tables"),
    );
  }

  function setStream(status) {
    state.stream = status;
    streamBadge.textContent = STREAM_LABELS[status] ?? status;
    streamBadge.dataset.status = status;
  }

  // ------------------------------------------------------------------ redraws
  let drawn = -1;
  let timer = null;
  function scheduleRedraw() {
    if (timer) return;
    timer = setTimeout(() => {
      timer = null;
      redraw();
    }, REDRAW_MS);
  }
  function redraw() {
    const version = series.version + cells.version;
    if (version === drawn) return;
    drawn = version;
    cells.update();
    if (!charts && (series.train.step.length || series.evals.val.step.length)) ensureCharts();
    if (charts) {
      charts.update(series);
      gsnr.update(series);
      gsnrSection.hidden = false;
    }
    state.drawnVersion = drawn;
  }

  /** The advice as the API words it (GET /jobs/{id}/advice: its `text` is the CLI's). */
  async function refreshAdvice() {
    if (!isTrain) return;
    try {
      const advice = await api(`${path}/advice`, { signal: stop.signal });
      adviceText.textContent = typeof advice.text === "string" ? advice.text : "";
      adviceSection.hidden = !adviceText.textContent;
      state.adviceLoaded = true;
    } catch (err) {
      if (!stop.signal.aborted) console.warn("could not read the advice", err);
    }
  }

  async function refreshResults() {
    try {
      const list = await api(`${path}/artifacts`, { signal: stop.signal });
      const wasHidden = resultsBox.hidden;
      await results.refresh(list.data);
      // /ui/jobs/<id>#results (the studies list links there): scroll once they are shown
      if (wasHidden && !resultsBox.hidden && location.hash === "#results") resultsBox.scrollIntoView();
    } catch (err) {
      if (!stop.signal.aborted) console.warn("could not list artifacts", err);
    }
  }

  // ------------------------------------------------------------------ downloads
  modelBtn.addEventListener("click", async () => {
    try {
      const res = await api(`${path}/model`, { raw: true });
      const url = URL.createObjectURL(await res.blob());
      const a = h("a", { href: url, download: `model-${jobId}.tar` });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 60_000);
    } catch (err) {
      toast(`Download failed: ${err.message}`, "error");
    }
  });
  predictionsBtn.addEventListener("click", async () => {
    try {
      await downloadArtifact(jobId, `predictions.${(job.config || {}).output_format || "csv"}`);
    } catch (err) {
      toast(`Download failed: ${err.message}`, "error");
    }
  });

  // ------------------------------------------------------------------ cancel
  cancelBtn.addEventListener("click", async () => {
    if (!(await dialog.ask(job.name))) return;
    cancelBtn.disabled = true;
    cancelBtn.textContent = "Cancelling…";
    try {
      job = await api(`${path}/cancel`, { method: "POST" });
      toast(`Job ${job.name} is ${job.state}`);
      renderHeader();
    } catch (err) {
      if (err instanceof ApiError && err.status === 409) {
        toast("The job had already finished", "info");
        job = await api(path);
        renderHeader();
      } else {
        toast(`Cancel failed: ${err.message}`, "error");
      }
    } finally {
      cancelBtn.disabled = false;
      cancelBtn.textContent = "Cancel job";
    }
  });

  // ------------------------------------------------------------------ load + follow
  renderHeader();
  setStream("connecting");
  // The stream sends a job snapshot on state changes only; the headline figures (progress,
  // loss, best AUC, rows/s) are the service's summary, re-read every few seconds while active.
  let ticks = 0;
  const clock = setInterval(async () => {
    if (!ACTIVE.has(job.state)) return;
    ticks += 1;
    if (ticks % SNAPSHOT_EVERY_S === 0) {
      try {
        const fresh = await api(path, { signal: stop.signal });
        if (ACTIVE.has(job.state)) job = fresh; // unless the stream already reported the end
      } catch (err) {
        if (!stop.signal.aborted) console.warn("could not refresh the job", err);
      }
    }
    renderHeader(); // the running time, every second
  }, 1000);

  // History: metrics first; its last seq is where the stream starts (anything later of any
  // stream comes through the stream). GSNR records up to then are fetched after it, so none
  // is missed; overlaps are dropped by seq.
  const metrics = await api(`${path}/metrics?max_points=${HISTORY_METRICS}`, { signal: stop.signal });
  const gsnrPage = await api(`${path}/gsnr?max_points=${HISTORY_GSNR}`, { signal: stop.signal });
  const cursor = metrics.data.length ? metrics.data[metrics.data.length - 1].seq : 0;
  for (const rec of metrics.data) {
    if (rec.kind === "cell") cells.add(rec);
    else series.addMetrics(rec);
  }
  for (const rec of gsnrPage.data) series.addGsnr(rec);
  redraw();
  refreshResults();
  refreshAdvice();
  state.historyLastStep = series.lastStep(); // anything beyond came over the stream
  state.historyLoaded = true;

  let resultsTimer = null;
  if (!isTrain && ACTIVE.has(job.state)) {
    // a study writes its result files as it goes
    resultsTimer = setInterval(refreshResults, 15_000);
  }
  // a running train job's advice moves with its gsnr.jsonl
  const adviceTimer = isTrain && ACTIVE.has(job.state) ? setInterval(refreshAdvice, 30_000) : null;

  followEvents(jobId, {
    after: cursor,
    signal: stop.signal,
    onStatus: setStream,
    onEvent(name, data, id) {
      state.events += 1;
      state.lastEvent = name;
      if (name === "metrics") {
        state.metricsEvents = (state.metricsEvents ?? 0) + 1;
        const rec = { ...data, seq: id ?? data.seq };
        if (rec.kind === "cell" ? cells.add(rec) : series.addMetrics(rec)) scheduleRedraw();
      } else if (name === "gsnr") {
        if (series.addGsnr({ ...data, seq: id ?? data.seq })) scheduleRedraw();
      } else if (name === "end" && data && data.deleted) {
        toast("This job was deleted", "error");
        setStream("ended");
      } else if ((name === "job" || name === "end") && data && data.id === jobId) {
        const was = job.state;
        job = data;
        renderHeader();
        if (was !== job.state) {
          refreshResults();
          if (tabs.current() !== "logs") tabs.refresh();
        }
        if (name === "end") {
          clearInterval(resultsTimer);
          clearInterval(adviceTimer);
          refreshAdvice();
          refreshResults();
          tabs.refresh();
        }
      }
    },
  });

  return {
    stop() {
      stop.abort();
      clearInterval(clock);
      clearInterval(resultsTimer);
      clearInterval(adviceTimer);
      clearTimeout(timer);
      results.destroy();
      cells.destroy();
      destroyAll();
    },
  };
}

/** The confirmation dialog of the cancel button (a native <dialog>). */
function cancelDialog() {
  const name = h("strong");
  const keep = h("button", { type: "button", class: "btn", value: "keep" }, "Keep it running");
  const confirm = h("button", { type: "button", class: "btn btn-danger", id: "confirm-cancel", value: "cancel" }, "Cancel job");
  const el = h(
    "dialog",
    { class: "dialog", id: "cancel-dialog" },
    h("h2", {}, "Cancel this job?"),
    h("p", {}, "Job ", name, " gets SIGTERM, then SIGKILL after the grace period. What it logged so far (metrics, GSNR, checkpoints) is kept."),
    h("div", { class: "dialog-actions" }, keep, confirm),
  );
  let resolve = null;
  const close = (answer) => {
    el.close();
    resolve?.(answer);
    resolve = null;
  };
  keep.addEventListener("click", () => close(false));
  confirm.addEventListener("click", () => close(true));
  el.addEventListener("cancel", () => close(false)); // Escape
  return {
    el,
    ask(jobName) {
      name.textContent = jobName;
      el.showModal();
      return new Promise((r) => {
        resolve = r;
      });
    },
  };
}
