// Study jobs (batch-size sweeps): a list of them; each one's page shows its results table and
// plots (views/results.js). A service that does not know the "study" kind yet answers the
// filter with 422, and the page says so instead of failing.

import { ApiError, api, query } from "../api.js";
import { ago, badge, duration, elapsed, every, fill, h, progressBar } from "../dom.js";
import { progressFraction, progressText } from "./jobs.js";

const REFRESH_MS = 5000;

export function studiesView(main) {
  const body = h("div", { id: "studies" });
  fill(
    main,
    h("div", { class: "page-head" }, h("h1", {}, "Studies")),
    h(
      "p",
      { class: "muted lead" },
      "A study trains a grid of global batch sizes × optimizer pairs (base vs VR-*) × learning rates × seeds, ",
      "and writes a results table and plots (AUC vs batch size, AUC vs rows seen, GSNR ratio over training). ",
      "Open a study to see them.",
    ),
    body,
  );
  document.title = "Studies — dlrm-vrgd";

  async function refresh() {
    let page;
    try {
      page = await api(`/jobs${query({ kind: "study", limit: 100 })}`);
    } catch (err) {
      if (err instanceof ApiError && err.status === 422) {
        fill(body, h("section", { class: "card notice", id: "no-studies" },
          h("h2", {}, "No study jobs on this service"),
          h("p", {}, "This service does not run study jobs yet (its job kinds do not include \"study\"). ",
            "Once it does, studies submitted with ", h("code", {}, "kind: study"), " are listed here.")));
        return;
      }
      throw err;
    }
    if (!page.data.length) {
      fill(body, h("section", { class: "card notice", id: "no-studies" },
        h("h2", {}, "No study jobs yet"),
        h("p", {}, "Submit one (", h("code", {}, "POST /api/v1/jobs"), " with ", h("code", {}, "\"kind\": \"study\""), ") and it appears here.")));
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
  }

  refresh().catch((err) => fill(body, h("p", { class: "error" }, err.message)));
  return { stop: every(REFRESH_MS, refresh) };
}
