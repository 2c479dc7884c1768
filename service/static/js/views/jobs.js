// The job list: state, name, kind, progress, best and oracle AUC, rows/s, age. Refreshed
// every few seconds while the tab is visible; rows can be ticked for the compare view.

import { api, query } from "../api.js";
import { ago, badge, batchSize, compact, duration, elapsed, every, fill, fmt, h, int, isNum, progressBar } from "../dom.js";

const STATES = ["queued", "running", "succeeded", "failed", "cancelled"];
const PAGE = 50;
const REFRESH_MS = 3000;

/** Progress label: "52 / 123 steps", "4 steps", or the state. */
export function progressText(job) {
  const p = job.progress || {};
  if (isNum(p.step) && isNum(p.total_steps)) return `${int(p.step)} / ${int(p.total_steps)}`;
  if (isNum(p.step)) return `${int(p.step)} steps`;
  if (isNum(p.fraction)) return `${(100 * p.fraction).toFixed(0)}%`;
  return job.state === "queued" ? "waiting" : "–";
}

/** Fraction done, when it is known (a succeeded job counts as done). */
export function progressFraction(job) {
  const p = job.progress || {};
  if (isNum(p.fraction)) return p.fraction;
  return job.state === "succeeded" ? 1 : null;
}

/** The oracle AUC shown beside a job's best AUC (validation, else test). */
export function oracleAuc(p) {
  return isNum(p.val_oracle_auc) ? p.val_oracle_auc : p.test_oracle_auc;
}

/** "vradam / gsnr_rowwise_adagrad · G 8k · ": what a training job runs, for the list. */
function setup(job) {
  const cfg = job.config || {};
  const optim = cfg.optim || {};
  const run = cfg.run || {};
  if (!optim.dense || !optim.sparse) return "";
  const batch = isNum(run.global_batch) ? ` · G ${batchSize(run.global_batch)}` : "";
  return `${optim.dense.name} / ${optim.sparse.name}${batch} · `;
}

export function jobsView(main) {
  const selected = new Set();
  const stateFilter = new Set();
  let offset = 0;
  let name = "";

  const tbody = h("tbody", { id: "jobs-body" });
  const summary = h("span", { class: "muted", id: "jobs-count" });
  const compareBtn = h("button", { type: "button", class: "btn", id: "compare-selected", disabled: true }, "Compare selected");
  const prev = h("button", { type: "button", class: "btn btn-small" }, "‹ Newer");
  const next = h("button", { type: "button", class: "btn btn-small" }, "Older ›");
  const search = h("input", { type: "search", placeholder: "Filter by name", class: "search", "aria-label": "Filter by name" });
  const chips = STATES.map((s) =>
    h("button", { type: "button", class: "chip", "aria-pressed": "false", dataset: { state: s } }, s),
  );

  compareBtn.addEventListener("click", () => {
    location.href = `/ui/compare${query({ ids: [...selected].join(",") })}`;
  });
  prev.addEventListener("click", () => {
    offset = Math.max(0, offset - PAGE);
    refresh();
  });
  next.addEventListener("click", () => {
    offset += PAGE;
    refresh();
  });
  let typing = null;
  search.addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(() => {
      name = search.value.trim();
      offset = 0;
      refresh();
    }, 250);
  });
  for (const chip of chips) {
    chip.addEventListener("click", () => {
      const s = chip.dataset.state;
      if (stateFilter.has(s)) stateFilter.delete(s);
      else stateFilter.add(s);
      chip.setAttribute("aria-pressed", String(stateFilter.has(s)));
      offset = 0;
      refresh();
    });
  }

  fill(
    main,
    h(
      "div",
      { class: "page-head" },
      h("h1", {}, "Jobs"),
      summary,
      h("div", { class: "spacer" }),
      compareBtn,
    ),
    h("div", { class: "toolbar" }, search, h("div", { class: "chips" }, chips)),
    h(
      "div",
      { class: "card table-card" },
      h(
        "table",
        { class: "data jobs", id: "jobs" },
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            h("th", { class: "check", title: "Select for comparison" }, ""),
            h("th", {}, "State"),
            h("th", {}, "Name"),
            h("th", {}, "Kind"),
            h("th", { class: "progress-col" }, "Progress"),
            h("th", { class: "num", title: "Best validation AUC so far" }, "Best AUC"),
            h("th", { class: "num", title: "AUC of the true click probabilities on the same rows: the best any model can reach" }, "Oracle AUC"),
            h("th", { class: "num", title: "Oracle AUC minus best AUC" }, "Gap"),
            h("th", { class: "num" }, "Rows/s"),
            h("th", {}, "Created"),
            h("th", { class: "num" }, "Run time"),
          ),
        ),
        tbody,
      ),
    ),
    h("div", { class: "pager" }, prev, next),
  );
  document.title = "Jobs — dlrm-vrgd";

  function row(job) {
    const p = job.progress || {};
    const oracle = oracleAuc(p);
    const best = isNum(p.best_val_auc) ? p.best_val_auc : p.test_auc;
    const box = h("input", { type: "checkbox", "aria-label": `select ${job.name}` });
    box.checked = selected.has(job.id);
    box.addEventListener("change", () => {
      if (box.checked) selected.add(job.id);
      else selected.delete(job.id);
      updateCompare();
    });
    const link = h("a", { href: `/ui/jobs/${encodeURIComponent(job.id)}`, class: "job-link" }, job.name);
    return h(
      "tr",
      { dataset: { jobId: job.id, state: job.state } },
      h("td", { class: "check" }, box),
      h("td", {}, badge(job.state)),
      h("td", { class: "name" }, link, h("div", { class: "muted small sub", title: `${setup(job)}${job.id}` }, setup(job), h("span", { class: "mono" }, job.id))),
      h("td", {}, job.kind, job.slurm_job_id ? h("div", { class: "muted small mono" }, `Slurm ${job.slurm_job_id}`) : null),
      h("td", { class: "progress-col" }, progressBar(progressFraction(job), progressText(job))),
      h("td", { class: "num", dataset: { col: "best-auc" } }, fmt(best)),
      h("td", { class: "num", dataset: { col: "oracle-auc" } }, fmt(oracle)),
      h("td", { class: "num" }, isNum(best) && isNum(oracle) ? fmt(oracle - best) : "–"),
      h("td", { class: "num", dataset: { col: "rows-per-s" } }, compact(p.rows_per_s)),
      h("td", { title: job.created_at }, ago(job.created_at)),
      h("td", { class: "num" }, duration(elapsed(job))),
    );
  }

  function updateCompare() {
    compareBtn.disabled = selected.size < 2;
    compareBtn.textContent = selected.size ? `Compare selected (${selected.size})` : "Compare selected";
  }

  async function refresh() {
    const page = await api(`/jobs${query({ state: [...stateFilter], name: name || null, limit: PAGE, offset })}`);
    if (!page.data.length) {
      const what = stateFilter.size || name ? "No job matches these filters." : "No jobs yet. Submit one with POST /api/v1/jobs, or run make demo.";
      fill(tbody, h("tr", {}, h("td", { colspan: 11, class: "empty" }, what)));
    } else {
      fill(tbody, page.data.map(row));
    }
    const first = page.count ? offset + 1 : 0;
    summary.textContent = `${first}–${offset + page.data.length} of ${page.count}`;
    prev.disabled = offset === 0;
    next.disabled = offset + PAGE >= page.count;
    updateCompare();
  }

  refresh().catch((err) => fill(tbody, h("tr", {}, h("td", { colspan: 11, class: "empty error" }, err.message))));
  return { stop: every(REFRESH_MS, refresh) };
}
