// Results written as files into a job's run directory — a batch-size study's Markdown table,
// its PNG plots, JSON and CSV — shown from the artifacts API: Markdown rendered, plots inline,
// data files as downloads. Any job that leaves such files gets this section; a study job is
// the one that does. Nothing is shown while there are none.

import { artifactBlob, artifactText, downloadArtifact } from "../api.js";
import { bytes, fill, h, toast } from "../dom.js";
import { renderMarkdown } from "../markdown.js";

const MAX_MARKDOWN = 4;
const MAX_PLOTS = 24;
const MAX_DATA_FILES = 30;
const MAX_MARKDOWN_BYTES = 512 << 10;
/** Files of a training run's own that are not "results" (they have their own views). */
const RUN_FILES = new Set(["metrics.jsonl", "gsnr.jsonl", "config.json"]);

const depth = (p) => p.split("/").length;
const byDepthThenName = (a, b) => depth(a.path) - depth(b.path) || a.path.localeCompare(b.path);

/** Split artifacts into what the results view shows. */
export function pickResults(artifacts) {
  const files = artifacts.filter((a) => !a.path.startsWith("checkpoints/") && !a.path.split("/").some((p) => p.startsWith(".")));
  const markdown = files.filter((a) => /\.md$/i.test(a.path)).sort(byDepthThenName);
  const plots = files.filter((a) => /\.(png|jpe?g|svg|webp)$/i.test(a.path)).sort(byDepthThenName);
  // data files of the top level only (a study's cells/ hold hundreds: see the Artifacts tab)
  const data = files.filter((a) => /\.(json|csv)$/i.test(a.path) && !a.path.includes("/") && !RUN_FILES.has(a.path)).sort(byDepthThenName);
  return { markdown, plots, data };
}

export class ResultsSection {
  constructor(container, jobId) {
    this.container = container;
    this.jobId = jobId;
    this.urls = [];
    this.signature = "";
    container.hidden = true;
  }

  /** Re-read the artifact list; re-render only when the result files changed. */
  async refresh(artifacts) {
    const picked = pickResults(artifacts);
    const shown = [...picked.markdown.slice(0, MAX_MARKDOWN), ...picked.plots.slice(0, MAX_PLOTS)];
    const signature = JSON.stringify([...shown, ...picked.data].map((a) => [a.path, a.bytes, a.modified_at]));
    if (signature === this.signature) return;
    this.signature = signature;
    if (!picked.markdown.length && !picked.plots.length) {
      this.container.hidden = true;
      return;
    }
    await this.render(picked);
  }

  async render({ markdown, plots, data }) {
    for (const url of this.urls) URL.revokeObjectURL(url);
    this.urls = [];
    const body = h("div", { class: "results-body" });
    fill(
      this.container,
      h("div", { class: "card-head" }, h("h2", {}, "Results"), h("span", { class: "muted small" }, "files the job wrote into its run directory")),
      body,
    );
    this.container.hidden = false;

    for (const a of markdown.slice(0, MAX_MARKDOWN)) {
      const box = h("article", { class: "md", dataset: { path: a.path } }, h("h3", { class: "file-title mono" }, a.path));
      body.append(box);
      if (a.bytes > MAX_MARKDOWN_BYTES) {
        box.append(h("p", { class: "muted" }, `${bytes(a.bytes)}: too large to show here; download it below.`));
        continue;
      }
      try {
        box.append(renderMarkdown(await artifactText(this.jobId, a.path)));
      } catch (err) {
        box.append(h("p", { class: "error" }, `could not load ${a.path}: ${err.message}`));
      }
    }

    if (plots.length) {
      const gallery = h("div", { class: "plots", id: "result-plots" });
      body.append(h("h3", {}, "Plots"), gallery);
      if (plots.length > MAX_PLOTS) body.append(h("p", { class: "muted small" }, `showing ${MAX_PLOTS} of ${plots.length} images`));
      await Promise.all(plots.slice(0, MAX_PLOTS).map(async (a) => {
        const img = h("img", { alt: a.path, loading: "lazy" });
        const fig = h("figure", { class: "plot", dataset: { path: a.path } }, img, h("figcaption", { class: "mono small" }, a.path));
        gallery.append(fig);
        try {
          const url = URL.createObjectURL(await artifactBlob(this.jobId, a.path));
          this.urls.push(url);
          img.src = url;
          img.addEventListener("click", () => window.open(url, "_blank", "noopener"));
          img.title = "open full size";
        } catch (err) {
          fig.append(h("p", { class: "error small" }, err.message));
        }
      }));
    }

    if (data.length) {
      body.append(
        h("h3", {}, "Data files"),
        h("div", { class: "file-list" }, data.slice(0, MAX_DATA_FILES).map((a) => {
          const b = h("button", { type: "button", class: "btn btn-small mono", dataset: { path: a.path } }, `${a.path} (${bytes(a.bytes)})`);
          b.addEventListener("click", () => downloadArtifact(this.jobId, a.path).catch((err) => toast(err.message, "error")));
          return b;
        })),
      );
      if (data.length > MAX_DATA_FILES) {
        body.append(h("p", { class: "muted small" }, `and ${data.length - MAX_DATA_FILES} more in the Artifacts tab`));
      }
    }
  }

  destroy() {
    for (const url of this.urls) URL.revokeObjectURL(url);
    this.urls = [];
  }
}
