// The job page's tabs: logs (tail, refreshed while the job is active), config (as YAML),
// artifacts (download through the token), and the final metrics of result.json.

import { api, downloadArtifact } from "../api.js";
import { ago, bytes, fill, fmt, h, isNum, toast } from "../dom.js";

/** A YAML rendering of a JSON value (configs are plain data: maps, lists, scalars). */
export function toYaml(value, indent = "") {
  const scalar = (v) => {
    if (v === null || v === undefined) return "null";
    if (typeof v === "string") {
      return /^[\w./@+-][\w ./@:+-]*$/.test(v) && !/^(true|false|null|yes|no|~|[-+.\d][\d.e+-]*)$/i.test(v) ? v : JSON.stringify(v);
    }
    return String(v);
  };
  if (Array.isArray(value)) {
    if (!value.length) return "[]";
    if (value.every((v) => v === null || typeof v !== "object")) return `[${value.map(scalar).join(", ")}]`;
    return value.map((v) => `\n${indent}- ${toYaml(v, `${indent}  `).replace(/^\n\s*/, "")}`).join("");
  }
  if (value && typeof value === "object") {
    const keys = Object.keys(value);
    if (!keys.length) return "{}";
    return keys
      .map((k) => {
        const v = value[k];
        const nested = v && typeof v === "object" && !(Array.isArray(v) && v.every((x) => x === null || typeof x !== "object"));
        return `\n${indent}${k}:${nested ? "" : " "}${toYaml(v, `${indent}  `)}`;
      })
      .join("");
  }
  return scalar(value);
}

/** A tab strip; `tabs` = [{id, label, render(panel)}]. The first tab is open. */
export function tabStrip(container, tabs) {
  const buttons = [];
  const panel = h("div", { class: "tab-panel", role: "tabpanel" });
  let current = null;
  const open = (tab) => {
    current?.leave?.();
    current = tab;
    for (const b of buttons) b.setAttribute("aria-selected", String(b.dataset.tab === tab.id));
    panel.replaceChildren();
    tab.render(panel);
  };
  for (const tab of tabs) {
    const b = h("button", { type: "button", role: "tab", class: "tab", dataset: { tab: tab.id } }, tab.label);
    b.addEventListener("click", () => open(tab));
    buttons.push(b);
  }
  fill(container, h("div", { class: "tabs", role: "tablist" }, buttons), panel);
  open(tabs[0]);
  return { refresh: () => current && open(current), current: () => current?.id };
}

/** Logs: the last lines of train.log; refreshed every 3 s while `isActive()`. */
export function logsTab(jobId, isActive) {
  let timer = null;
  return {
    id: "logs",
    label: "Logs",
    render(panel) {
      const pre = h("pre", { class: "logs", id: "logs" }, "loading…");
      const follow = h("input", { type: "checkbox", checked: true });
      const lines = h("select", { "aria-label": "lines" }, [100, 500, 2000].map((n) => h("option", { value: n }, `last ${n} lines`)));
      panel.append(h("div", { class: "panel-tools" }, lines, h("label", { class: "small" }, follow, " follow the end")), pre);
      const load = async () => {
        const res = await api(`/jobs/${encodeURIComponent(jobId)}/logs?tail=${lines.value}`, { raw: true });
        const text = await res.text();
        const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 20;
        pre.textContent = text || "(no output yet)";
        if (follow.checked && atEnd) pre.scrollTop = pre.scrollHeight;
      };
      lines.addEventListener("change", load);
      const tick = async () => {
        try {
          await load();
        } catch (err) {
          pre.textContent = `could not load the log: ${err.message}`;
        }
        if (isActive()) timer = setTimeout(tick, 3000);
        else timer = null;
      };
      tick().then(() => {
        pre.scrollTop = pre.scrollHeight;
      });
    },
    leave() {
      clearTimeout(timer);
      timer = null;
    },
  };
}

/** Config: the resolved config the job runs, as YAML, with a copy button (JSON). */
export function configTab(job) {
  return {
    id: "config",
    label: "Config",
    render(panel) {
      const copy = h("button", { type: "button", class: "btn btn-small" }, "Copy as JSON");
      copy.addEventListener("click", async () => {
        try {
          await navigator.clipboard.writeText(JSON.stringify(job.config, null, 2));
          toast("Config copied as JSON");
        } catch {
          toast("The browser refused the clipboard", "error");
        }
      });
      panel.append(
        h("div", { class: "panel-tools" }, h("span", { class: "muted small" }, "The resolved config (defaults filled in)."), copy),
        h("pre", { class: "code config", id: "config" }, toYaml(job.config).replace(/^\n/, "")),
      );
    },
  };
}

/** Artifacts: the run directory's files; a click downloads one with the token. */
export function artifactsTab(jobId) {
  return {
    id: "artifacts",
    label: "Artifacts",
    async render(panel) {
      const body = h("tbody", {}, h("tr", {}, h("td", { colspan: 4, class: "empty" }, "loading…")));
      panel.append(
        h("table", { class: "data artifacts", id: "artifacts" },
          h("thead", {}, h("tr", {}, h("th", {}, "File"), h("th", { class: "num" }, "Size"), h("th", {}, "Modified"), h("th", {}, ""))),
          body),
      );
      try {
        const list = await api(`/jobs/${encodeURIComponent(jobId)}/artifacts`);
        if (!list.data.length) {
          fill(body, h("tr", {}, h("td", { colspan: 4, class: "empty" }, "No files in the run directory yet.")));
          return;
        }
        fill(body, list.data.map((a) => {
          const get = h("button", { type: "button", class: "btn btn-small", dataset: { path: a.path } }, "Download");
          get.addEventListener("click", async () => {
            get.disabled = true;
            try {
              await downloadArtifact(jobId, a.path);
            } catch (err) {
              toast(`Download failed: ${err.message}`, "error");
            } finally {
              get.disabled = false;
            }
          });
          return h("tr", {}, h("td", { class: "mono" }, a.path), h("td", { class: "num" }, bytes(a.bytes)), h("td", { title: a.modified_at }, ago(a.modified_at)), h("td", { class: "num" }, get));
        }));
      } catch (err) {
        fill(body, h("tr", {}, h("td", { colspan: 4, class: "empty error" }, err.message)));
      }
    },
  };
}

/** Final metrics: val/test AUC beside the oracle, logloss, NE, calibration; timings. */
export function resultTab(jobId) {
  return {
    id: "result",
    label: "Final metrics",
    async render(panel) {
      panel.append(h("p", { class: "muted" }, "loading…"));
      let result;
      try {
        result = await api(`/jobs/${encodeURIComponent(jobId)}/result`);
      } catch (err) {
        fill(panel, h("p", { class: "muted" }, err.status === 404 ? "No result yet: result.json is written when the job succeeds." : err.message));
        return;
      }
      const rows = ["val", "test", "train"].filter((k) => result[k] && typeof result[k] === "object").map((k) => {
        const m = result[k];
        const gap = isNum(m.oracle_auc) && isNum(m.auc) ? m.oracle_auc - m.auc : null;
        return h("tr", {}, h("td", {}, k), ...[m.auc, m.oracle_auc, gap, m.logloss, m.ne, m.calibration].map((v) => h("td", { class: "num" }, fmt(v))));
      });
      const facts = [];
      if (isNum(result.steps)) facts.push(["steps", result.steps.toLocaleString("en-US")]);
      if (isNum(result.samples)) facts.push(["rows", result.samples.toLocaleString("en-US")]);
      const timings = result.timings || {};
      // the run's average over its training steps (the list and the tile show the last step's)
      if (isNum(timings.rows_per_s)) facts.push(["rows/s (run average)", Math.round(timings.rows_per_s).toLocaleString("en-US")]);
      if (isNum(timings.train_seconds)) facts.push(["train time", `${timings.train_seconds.toFixed(1)} s`]);
      if (isNum(timings.rows_per_s_per_rank) && isNum(result.world_size) && result.world_size > 1) facts.push(["rows/s per rank", Math.round(timings.rows_per_s_per_rank).toLocaleString("en-US")]);
      if (result.best_val && isNum(result.best_val.auc)) facts.push(["best val AUC", `${fmt(result.best_val.auc)} at step ${result.best_val.step}`]);
      // run.target_auc: MLPerf's time to train is the wall clock to the eval that reached it
      const target = result.target;
      if (target && isNum(target.target_auc)) {
        facts.push(["target AUC", target.reached && isNum(target.wall_seconds)
          ? `${fmt(target.target_auc)} reached at step ${target.step} (${fmt(target.epochs, 3)} epochs): ${target.wall_seconds.toFixed(1)} s wall clock, ${fmt(target.train_seconds, 1)} s training`
          : `${fmt(target.target_auc)} not reached`]);
      }
      const opt = result.optimizers || {};
      if (opt.dense) facts.push(["optimizers", `dense ${opt.dense}, tables ${opt.sparse ?? "?"}${opt.sparse_gsnr_estimator ? ` (${opt.sparse_gsnr_estimator} estimator, ${opt.sparse_gsnr_placement ?? "gradient"} placement)` : ""}`]);
      fill(
        panel,
        rows.length
          ? h("table", { class: "data", id: "final-metrics" },
              h("thead", {}, h("tr", {}, ...["split", "AUC", "oracle AUC", "gap", "logloss", "NE", "calibration"].map((t, i) => h("th", { class: i ? "num" : null }, t)))),
              h("tbody", {}, rows))
          : null,
        h("dl", { class: "facts" }, facts.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
      );
    },
  };
}
