// Compare jobs: validation AUC curves of two or more jobs on one chart (each beside its own
// oracle AUC, dashed), their training loss, and a table of what differs (optimizers, batch,
// learning rates) and how they ended. The selection lives in the URL (?ids=a,b,c).

import { api, query } from "../api.js";
import { chartCard, color, createChart, destroyAll, fade, fixedTicks, join, line } from "../charts.js";
import { badge, batchSize, compact, every, fill, fmt, h, isNum } from "../dom.js";
import { oracleAuc } from "./jobs.js";

const REFRESH_MS = 5000;
const LOSS_POINTS = 400;

function selectedIds() {
  const raw = new URLSearchParams(location.search).get("ids") || "";
  return [...new Set(raw.split(",").map((s) => s.trim()).filter(Boolean))];
}

/** One job's curves: val evals (all of them) and downsampled train losses. */
async function loadCurves(job) {
  const base = `/jobs/${encodeURIComponent(job.id)}/metrics`;
  const [evals, train] = await Promise.all([
    api(`${base}${query({ kind: "eval", split: "val" })}`),
    api(`${base}${query({ kind: "train", max_points: LOSS_POINTS })}`),
  ]);
  const pick = (recs, key) => recs.map((r) => (isNum(r[key]) ? r[key] : null));
  return {
    job,
    val: { samples: pick(evals.data, "samples"), step: pick(evals.data, "step"), auc: pick(evals.data, "auc"), oracle: pick(evals.data, "oracle_auc") },
    train: { samples: pick(train.data, "samples"), step: pick(train.data, "step"), loss: pick(train.data, "loss") },
  };
}

export async function compareView(main) {
  let ids = selectedIds();
  let xKey = "samples";
  const picker = h("div", { class: "picker", id: "compare-picker" });
  const factsBody = h("tbody");
  const xToggle = h(
    "div",
    { class: "segmented", role: "group", "aria-label": "x axis" },
    h("button", { type: "button", "aria-pressed": "true", dataset: { x: "samples" } }, "rows seen"),
    h("button", { type: "button", "aria-pressed": "false", dataset: { x: "step" } }, "step"),
  );
  const aucCard = chartCard("Validation AUC", { help: "Solid: model AUC at each eval. Dashed, same colour: that job's oracle AUC (the ceiling for its data).", wide: true });
  const lossCard = chartCard("Training loss", { help: `Per-step training loss (at most ${LOSS_POINTS} points per job).`, wide: true });
  const chartsBox = h("div", { class: "chart-grid single" }, aucCard.card, lossCard.card);
  const note = h("p", { class: "muted", id: "compare-note" });

  fill(
    main,
    h("div", { class: "page-head" }, h("h1", {}, "Compare jobs"), h("div", { class: "spacer" }), h("span", { class: "muted small" }, "x axis "), xToggle),
    h("section", { class: "card" }, h("div", { class: "card-head" }, h("h2", {}, "Jobs"), h("span", { class: "muted small" }, "tick two or more")), picker),
    note,
    chartsBox,
    h("section", { class: "card table-card" }, h("table", { class: "data", id: "compare-table" },
      h("thead", {}, h("tr", {}, ...["", "Job", "State", "Dense optimizer", "Tables", "Global batch", "Rows seen", "Best val AUC", "Oracle AUC", "Gap", "Test AUC"].map((t, i) => h("th", { class: i >= 5 ? "num" : null }, t)))),
      factsBody)),
  );
  document.title = "Compare — dlrm-vrgd";

  for (const b of xToggle.querySelectorAll("button")) {
    b.addEventListener("click", () => {
      xKey = b.dataset.x;
      for (const o of xToggle.querySelectorAll("button")) o.setAttribute("aria-pressed", String(o === b));
      draw();
    });
  }

  let aucChart = null;
  let lossChart = null;
  let curves = [];

  async function renderPicker() {
    const recent = await api(`/jobs${query({ limit: 100 })}`);
    // jobs named in the URL but older than the 100 newest are fetched one by one
    const known = new Map(recent.data.map((j) => [j.id, j]));
    for (const id of ids) {
      if (!known.has(id)) {
        try {
          known.set(id, await api(`/jobs/${encodeURIComponent(id)}`));
        } catch {
          // unknown id: dropped below
        }
      }
    }
    ids = ids.filter((id) => known.has(id));
    const jobs = [...known.values()].filter((j) => j.kind === "train" || ids.includes(j.id));
    fill(picker, jobs.length ? jobs.map((j) => {
      const box = h("input", { type: "checkbox", value: j.id });
      box.checked = ids.includes(j.id);
      box.addEventListener("change", () => {
        ids = box.checked ? [...ids, j.id] : ids.filter((x) => x !== j.id);
        history.replaceState(null, "", `/ui/compare${query({ ids: ids.join(",") || null })}`);
        load();
      });
      const p = j.progress || {};
      return h("label", { class: "pick", dataset: { jobId: j.id } }, box, h("span", { class: "pick-name" }, j.name), badge(j.state), h("span", { class: "muted small" }, isNum(p.best_val_auc) ? `AUC ${fmt(p.best_val_auc)}` : ""));
    }) : h("p", { class: "muted" }, "No jobs yet."));
    return known;
  }

  function facts(c, i) {
    const j = c.job;
    const cfg = j.config || {};
    const optim = cfg.optim || {};
    const run = cfg.run || {};
    const p = j.progress || {};
    const oracle = oracleAuc(p);
    const opt = (o) => (o ? `${o.name}${isNum(o.lr) ? ` lr ${o.lr}` : ""}` : "–");
    const batch = isNum(run.global_batch) ? `${batchSize(run.global_batch)}${isNum(run.micro_batch) ? ` (${run.global_batch / run.micro_batch}×${batchSize(run.micro_batch)})` : ""}` : "–";
    return h(
      "tr",
      { dataset: { jobId: j.id } },
      h("td", {}, h("span", { class: "swatch", style: { background: color(i) } })),
      h("td", {}, h("a", { href: `/ui/jobs/${encodeURIComponent(j.id)}` }, j.name)),
      h("td", {}, badge(j.state)),
      h("td", {}, opt(optim.dense)),
      h("td", {}, opt(optim.sparse)),
      h("td", { class: "num" }, batch),
      h("td", { class: "num" }, compact(p.samples)),
      h("td", { class: "num" }, fmt(p.best_val_auc)),
      h("td", { class: "num" }, fmt(oracle)),
      h("td", { class: "num" }, isNum(oracle) && isNum(p.best_val_auc) ? fmt(oracle - p.best_val_auc) : "–"),
      h("td", { class: "num" }, fmt(p.test_auc)),
    );
  }

  let drawnFor = "";
  function draw() {
    const signature = JSON.stringify([xKey, curves.map((c) => [c.job.id, c.job.name])]);
    if (signature === drawnFor && aucChart) {
      // same jobs, same axis: new data only (keeps a zoom)
      aucChart.set(join(curves.map((c) => [c.val[xKey], c.val.auc, c.val.oracle])));
      lossChart.set(join(curves.map((c) => [c.train[xKey], c.train.loss])));
      return;
    }
    drawnFor = signature;
    aucChart?.destroy();
    lossChart?.destroy();
    aucChart = lossChart = null;
    const xLabel = xKey === "samples" ? "rows seen" : "step";
    if (curves.length === 0) {
      chartsBox.hidden = true;
      return;
    }
    chartsBox.hidden = false;
    aucChart = createChart("compare-auc", aucCard.plot, {
      height: 320,
      xLabel,
      series: curves.flatMap((c, i) => [
        line(c.job.name, { color: color(i), points: true, width: 2 }),
        line(`${c.job.name} oracle`, { color: fade(color(i), 0.55), dash: [6, 4] }),
      ]),
      axes: [{ label: "validation AUC", ticks: fixedTicks(3) }],
      emptyText: "None of these jobs has evaluated yet.",
    });
    aucChart.set(join(curves.map((c) => [c.val[xKey], c.val.auc, c.val.oracle])));
    lossChart = createChart("compare-loss", lossCard.plot, {
      height: 260,
      xLabel,
      series: curves.map((c, i) => line(c.job.name, { color: color(i), width: 1.25 })),
      axes: [{ label: "loss", ticks: fixedTicks(3) }],
    });
    lossChart.set(join(curves.map((c) => [c.train[xKey], c.train.loss])));
  }

  async function load() {
    const known = await renderPicker();
    const chosen = ids.map((id) => known.get(id)).filter(Boolean);
    note.textContent = chosen.length < 2 ? "Tick at least two jobs to compare their curves." : "";
    curves = await Promise.all(chosen.map(loadCurves));
    fill(factsBody, curves.length ? curves.map(facts) : h("tr", {}, h("td", { colspan: 11, class: "empty" }, "No job selected.")));
    draw();
    window.dashboard.compare = { ids: chosen.map((j) => j.id), loaded: true };
  }

  await load();
  const stopRefresh = every(REFRESH_MS, async () => {
    if (curves.some((c) => c.job.state === "running" || c.job.state === "queued")) await load();
  });
  return {
    stop() {
      stopRefresh();
      destroyAll();
    },
  };
}
