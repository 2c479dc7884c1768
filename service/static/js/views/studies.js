// Study jobs (batch-size sweeps): the list of them, and the results (Markdown table, plots,
// data files; views/results.js) of the newest one that has written any. Each study's own page
// shows its results too. A service that does not know the "study" kind yet answers the filter
// with 422, and the page says so instead of failing.

import { ApiError, api, query } from "../api.js";
import { ago, badge, duration, elapsed, every, fill, h, progressBar } from "../dom.js";
import { progressFraction, progressText } from "./jobs.js";
import { ResultsSection, pickResults } from "./results.js";

const REFRESH_MS = 5000;

export function studiesView(main) {
  const body = h("div", { id: "studies" });
  const latestHead = h("div", { class: "latest-head" });
  const latestBox = h("section", { class: "card results", id: "study-results" });
  const latestWrap = h("div", { id: "latest-study", hidden: true }, latestHead, latestBox);
  let shownFor = null;
  let results = null;

  fill(
    main,
    h("div", { class: "page-head" }, h("h1", {}, "Studies")),
    h(
      "p",
      { class: "muted lead" },
      "A study trains a grid of global batch sizes × optimizer pairs (base vs VR-*) × learning rates × seeds, ",
      "and writes a results table and plots (AUC vs batch size, AUC vs rows seen, GSNR ratio over training). ",
      "The newest study's results are shown below the list; every study's page shows its own.",
    ),
    body,
    latestWrap,
  );
  document.title = "Studies — dlrm-vrgd";

  function notice(title, ...text) {
    fill(body, h("section", { class: "card notice", id: "no-studies" }, h("h2", {}, title), h("p", {}, ...text)));
    latestWrap.hidden = true;
  }

  /** The newest study (newest first) whose run directory holds results; null if none. */
  async function newestWithResults(studies) {
    for (const job of studies.slice(0, 10)) {
      if (job.state === "queued") continue;
      const list = await api(`/jobs/${encodeURIComponent(job.id)}/artifacts`);
      const picked = pickResults(list.data);
      if (picked.markdown.length || picked.plots.length) return { job, artifacts: list.data };
    }
    return null;
  }

  async function refresh() {
    let page;
    try {
      page = await api(`/jobs${query({ kind: "study", limit: 100 })}`);
    } catch (err) {
      if (err instanceof ApiError && err.status === 422) {
        notice(
          "No study jobs on this service",
          "This service does not run study jobs yet (its job kinds do not include \"study\"). ",
          "Once it does, studies submitted with ", h("code", {}, "kind: study"), " are listed here.",
        );
        return;
      }
      throw err;
    }
    if (!page.data.length) {
      notice("No study jobs yet", "Submit one (", h("code", {}, "POST /api/v1/jobs"), " with ", h("code", {}, "\"kind\": \"study\""), ") and it appears here.");
      return;
    }
    fill(body, h("div", { class: "card table-card" }, h("table", { class: "data", id: "studies-table" },
      h("thead", {}, h("tr", {}, ...["State", "Name", "Progress", "Created", "Run time", ""].map((t) => h("th", {}, t)))),
      h("tbody", {}, page.data.map((j) => h("tr", { dataset: { jobId: j.id } },
        h("td", {}, badge(j.state)),
        h("td", {}, h("a", { href: `/ui/jobs/${encodeURIComponent(j.id)}` }, j.name)),
        h("td", { class: "progress-col" }, progressBar(progressFraction(j), progressText(j))),
        h("td", { title: j.created_at }, ago(j.created_at)),
        h("td", {}, duration(elapsed(j))),
        h("td", {}, h("a", { href: `/ui/jobs/${encodeURIComponent(j.id)}#results` }, "results"))))))));

    const newest = await newestWithResults(page.data);
    if (!newest) {
      latestWrap.hidden = true;
      return;
    }
    if (newest.job.id !== shownFor) {
      results?.destroy();
      results = new ResultsSection(latestBox, newest.job.id);
      shownFor = newest.job.id;
    }
    fill(latestHead, h("h2", { class: "section-title" }, "Latest results: ", h("a", { href: `/ui/jobs/${encodeURIComponent(newest.job.id)}` }, newest.job.name), " ", badge(newest.job.state)));
    latestWrap.hidden = false;
    await results.refresh(newest.artifacts);
  }

  refresh().catch((err) => fill(body, h("p", { class: "error" }, err.message)));
  const stop = every(REFRESH_MS, refresh);
  return {
    stop() {
      stop();
      results?.destroy();
    },
  };
}
