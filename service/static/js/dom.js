// DOM building and number/time formatting. Data from the service (job names, logs, configs)
// is only ever inserted as text, never as HTML.

/**
 * h("div", {class: "x", onclick: fn, dataset: {a: 1}}, "text", child, [more]) -> Element.
 * Attributes: class, dataset, style (object), on<event> handlers, boolean true/false, others
 * as attributes. Children: strings (as text), nodes, arrays, null/false (skipped).
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key === "style") Object.assign(el.style, value);
    else if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2), value);
    } else if (value === true) el.setAttribute(key, "");
    else el.setAttribute(key, String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** Replace an element's children. */
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export const isNum = (v) => typeof v === "number" && Number.isFinite(v);

/** Fixed decimals, or an en dash for a missing value. */
export function fmt(v, digits = 4) {
  return isNum(v) ? v.toFixed(digits) : "–";
}

/** 1234 -> "1.2k", 2500000 -> "2.5M". */
export function compact(v, digits = 1) {
  if (!isNum(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e9) return `${(v / 1e9).toFixed(digits)}G`;
  if (a >= 1e6) return `${(v / 1e6).toFixed(digits)}M`;
  if (a >= 1e3) return `${(v / 1e3).toFixed(digits)}k`;
  return Number.isInteger(v) ? String(v) : v.toPrecision(3);
}

/** A batch size as people say it: 8192 -> "8k", 524288 -> "512k" (powers of 1024), else 1,000. */
export function batchSize(n) {
  if (!isNum(n)) return "–";
  return n >= 1024 && n % 1024 === 0 ? `${n / 1024}k` : int(n);
}

/** Integer with thousands separators. */
export function int(v) {
  return isNum(v) ? Math.round(v).toLocaleString("en-US") : "–";
}

export function pct(v, digits = 0) {
  return isNum(v) ? `${(100 * v).toFixed(digits)}%` : "–";
}

export function bytes(n) {
  if (!isNum(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return i ? `${n.toFixed(1)} ${units[i]}` : `${n} B`;
}

/** "4 s", "3 min 12 s", "2 h 05 min". */
export function duration(seconds) {
  if (!isNum(seconds) || seconds < 0) return "–";
  const s = Math.round(seconds);
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, "0")} s`;
  const m = Math.floor(s / 60);
  return `${Math.floor(m / 60)} h ${String(m % 60).padStart(2, "0")} min`;
}

/** "just now", "5 min ago", or a date for older times. */
export function ago(iso) {
  if (!iso) return "–";
  const t = new Date(iso).getTime();
  const s = (Date.now() - t) / 1000;
  if (s < 45) return "just now";
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return new Date(t).toLocaleDateString(undefined, { month: "short", day: "numeric" });
}

export function localTime(iso) {
  return iso ? new Date(iso).toLocaleString() : "–";
}

/** Seconds a job has run (until now while it runs). */
export function elapsed(job) {
  if (!job.started_at) return null;
  const end = job.finished_at ? new Date(job.finished_at) : new Date();
  return (end - new Date(job.started_at)) / 1000;
}

/** A coloured state badge. */
export function badge(state) {
  return h("span", { class: `badge badge-${state}`, dataset: { state } }, state);
}

/** A progress bar with a label; `fraction` may be null (unknown total). */
export function progressBar(fraction, label) {
  const bar = h("div", { class: "progress" }, h("div", { class: "progress-fill" }));
  if (isNum(fraction)) bar.firstChild.style.width = `${Math.min(100, 100 * fraction).toFixed(1)}%`;
  else bar.classList.add("progress-unknown");
  return h("div", { class: "progress-wrap" }, bar, h("span", { class: "progress-label" }, label));
}

/** Show a short message in the corner; kind "error" stays longer. */
export function toast(message, kind = "info") {
  const box = document.getElementById("toasts");
  if (!box) return;
  const el = h("div", { class: `toast toast-${kind}` }, message);
  box.append(el);
  setTimeout(() => el.remove(), kind === "error" ? 8000 : 4000);
}

/** Run `fn` every `ms` while the page is visible (and once when it becomes visible). */
export function every(ms, fn) {
  let timer = null;
  const tick = async () => {
    timer = null;
    if (document.visibilityState === "visible") {
      try {
        await fn();
      } catch (err) {
        console.warn("periodic refresh failed", err);
      }
    }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  let stopped = false;
  timer = setTimeout(tick, ms);
  return () => {
    stopped = true;
    if (timer) clearTimeout(timer);
  };
}

/** Short tensor names: "dlrm.over_arch.model.0._mlp.0._linear.weight" -> "over_arch.0.0.weight". */
export function shortTensorName(name) {
  return name
    .replace(/^dlrm\./, "")
    .split(".")
    .filter((p) => !["model", "_mlp", "_linear"].includes(p))
    .join(".");
}
