// Thin wrappers around uPlot (vendored, loaded as window.uPlot): a consistent look, sizing to
// the container, an empty-state overlay, zoom that survives live updates, and a registry.
//
// window.dashboard.charts[name] is the uPlot instance of every chart on the page; its `.data`
// is what is drawn (x values first, then one array per series). The browser tests read it.

import { compact, h } from "./dom.js";

const uPlot = window.uPlot;
const registry = ((window.dashboard ??= {}).charts ??= {});

export const COLORS = [
  "#1f6fb4", "#e8710a", "#2a9d3a", "#c8323c", "#8a5cc2",
  "#8c564b", "#d6589f", "#6b7280", "#a3a51b", "#139cad",
];

/** A colour of the palette, cycling. */
export const color = (i) => COLORS[i % COLORS.length];

/** A faded version of a hex colour (for oracle lines, bands). */
export function fade(hex, alpha = 0.35) {
  const n = parseInt(hex.slice(1), 16);
  return `rgba(${(n >> 16) & 255},${(n >> 8) & 255},${n & 255},${alpha})`;
}

const FONT = '11px system-ui, -apple-system, "Segoe UI", Roboto, sans-serif';
const AXIS = { stroke: "#5b6472", font: FONT, grid: { stroke: "#eceef2", width: 1 }, ticks: { stroke: "#d7dbe2", width: 1, size: 4 } };

/**
 * Tick labels for rows / steps: 1200000 -> "1.2M", with as many decimals as the tick spacing
 * (uPlot's `incr`) needs, so neighbouring ticks never read the same ("1.2k", "1.4k").
 */
export const compactTicks = (u, values, axis, space, incr) =>
  values.map((v) => {
    if (v == null) return "";
    const a = Math.abs(v);
    const [scale, unit] = a >= 1e9 ? [1e9, "G"] : a >= 1e6 ? [1e6, "M"] : a >= 1e3 ? [1e3, "k"] : [1, ""];
    const digits = Math.min(3, Math.max(0, Math.ceil(-Math.log10((incr || scale) / scale) - 1e-9)));
    return `${(v / scale).toFixed(digits)}${unit}`;
  });
/** Tick labels with fixed decimals. */
export const fixedTicks = (digits) => (u, values) => values.map((v) => (v == null ? "" : v.toFixed(digits)));

/**
 * A line series. Options: color, dash (e.g. [6, 4]), width, points (true: always draw
 * markers, for sparse series such as evals), pointSize, pointFill (default white: hollow),
 * scale (y scale key), digits (legend value).
 */
export function line(label, { color: stroke = COLORS[0], dash, width = 1.75, points = false, pointSize = 6, pointFill = "#fff", scale = "y", digits = 4, show = true } = {}) {
  return {
    label,
    stroke,
    width,
    dash,
    scale,
    show,
    spanGaps: true, // joined series have nulls where another series has an x value
    points: points ? { show: true, size: pointSize, width: 1.5, fill: pointFill } : { show: false },
    value: (u, v) => (v == null ? "–" : v.toFixed(digits)),
  };
}

/**
 * Legend markers drawn as a short piece of the series' line: solid, dashed or dotted as the
 * series is (dashboard.css keeps only the top border), so a dashed series and a solid one of
 * the same colour read apart in the legend too.
 */
const MARKERS = {
  width: 3,
  dash: (u, i) => {
    const dash = u.series[i].dash;
    return !dash || !dash.length ? "solid" : dash[0] <= 2 ? "dotted" : "dashed";
  },
  fill: () => "transparent",
};

/**
 * y range of `key` fitted to its values with `pad` of their span on each side (a flat series
 * gets a span of 10% of its value): for charts whose auto range would squeeze the points.
 */
export function fittedRange(pad = 0.15, minSpan = 1e-6) {
  return (u, min, max) => {
    if (min == null || max == null || !isFinite(min) || !isFinite(max)) return [0, 1];
    const span = Math.max(max > min ? max - min : Math.abs(max) * 0.1, minSpan);
    return [min - pad * span, max + pad * span];
  };
}

/**
 * Create a chart inside `container` (a .chart card's plot area) and register it as `name`.
 * spec: {series: [line(...)...], height, xLabel, xTicks, axes: [{scale, label, side, ticks, color}],
 *        scales: {key: {range}}, legend (default true), small (compact margins)}.
 * Returns a handle: {u, set(data), destroy()}.
 */
export function createChart(name, container, spec) {
  const height = spec.height ?? 240;
  const text = spec.emptyText ?? "Waiting for data…";
  const empty = h("div", { class: "chart-empty" }, text ? h("span", {}, text) : null);
  const target = h("div", { class: "chart-plot" });
  container.replaceChildren(target, empty);

  const yAxes = (spec.axes ?? [{ scale: "y" }]).map((a, i) => ({
    ...AXIS,
    scale: a.scale ?? "y",
    label: spec.small ? undefined : a.label,
    labelFont: FONT,
    labelSize: a.label && !spec.small ? 18 : 0,
    side: a.side ?? (i === 0 ? 3 : 1),
    ...(a.color ? { stroke: a.color } : {}),
    size: spec.small ? 34 : 52,
    values: a.ticks,
    grid: i === 0 ? AXIS.grid : { show: false },
  }));
  // Zoom (drag on the plot) survives live updates; a double click resets it.
  let zoomed = false;
  const opts = {
    width: Math.max(200, target.clientWidth || container.clientWidth || 400),
    height,
    padding: spec.small ? [6, 12, 0, 0] : [10, 16, 0, 4],
    legend: { show: spec.legend ?? true, live: true, markers: MARKERS },
    cursor: { drag: { x: true, y: false }, points: { size: 6 } },
    scales: { x: { time: false }, ...(spec.scales ?? {}) },
    series: [
      { label: spec.xLabel ?? "x", value: (u, v) => (v == null ? "–" : compact(v, 2)) },
      ...spec.series,
    ],
    axes: [
      {
        ...AXIS,
        label: spec.small ? undefined : spec.xLabel,
        labelFont: FONT,
        labelSize: spec.small ? 0 : 18,
        size: spec.small ? 22 : 40,
        values: spec.xTicks ?? compactTicks,
      },
      ...yAxes,
    ],
    hooks: {
      setSelect: [(plot) => {
        if (plot.select.width > 0) zoomed = true;
      }],
    },
  };
  const data = [[], ...spec.series.map(() => [])];
  const u = new uPlot(opts, data, target);
  target.dataset.points = "0";
  container.classList.add("is-empty"); // axes and legend stay hidden until there is data

  u.over.addEventListener("dblclick", () => {
    zoomed = false;
  });

  const resize = new ResizeObserver(() => {
    const width = Math.floor(target.clientWidth);
    if (width > 0 && width !== u.width) u.setSize({ width, height });
  });
  resize.observe(target);
  registry[name] = u;

  return {
    u,
    /** Replace the data: [xs, ys1, ys2, ...]. */
    set(next) {
      u.setData(next, !zoomed);
      // points drawn: the most non-null values of any series
      let points = 0;
      for (let i = 1; i < next.length; i++) {
        let n = 0;
        for (const v of next[i]) if (v != null) n += 1;
        points = Math.max(points, n);
      }
      target.dataset.points = String(points);
      empty.hidden = points > 0;
      container.classList.toggle("is-empty", points === 0);
    },
    destroy() {
      resize.disconnect();
      u.destroy();
      if (registry[name] === u) delete registry[name];
    },
  };
}

/**
 * Align several (xs, ...ys) tables on the union of their x values (uPlot.join), filling gaps
 * with null. tables: [[xs, ys...], ...] each sorted by x. Returns [xs, ys...all].
 */
export function join(tables) {
  const nonEmpty = tables.map((t) => (t[0].length ? t : null));
  if (!nonEmpty.some(Boolean)) return [[], ...tables.flatMap((t) => t.slice(1).map(() => []))];
  // uPlot.join needs at least one point per table: empty ones are padded back afterwards.
  const used = tables.filter((t) => t[0].length);
  const joined = uPlot.join(used);
  const out = [joined[0]];
  let k = 1;
  for (const t of tables) {
    for (let s = 1; s < t.length; s++) {
      out.push(t[0].length ? joined[k++] : new Array(joined[0].length).fill(null));
    }
  }
  return out;
}

/** Destroy every registered chart (when a view is left). */
export function destroyAll() {
  for (const [name, u] of Object.entries(registry)) {
    u.destroy();
    delete registry[name];
  }
}

/** A chart card: title, a subtitle slot, the plot area. Returns {card, plot, subtitle}. */
export function chartCard(title, { help, wide = false } = {}) {
  const subtitle = h("span", { class: "chart-sub" });
  const plot = h("div", { class: "chart" });
  const card = h(
    "section",
    { class: wide ? "card chart-card wide" : "card chart-card" },
    h("div", { class: "card-head" }, h("h3", {}, title), subtitle),
    help ? h("p", { class: "chart-help" }, help) : null,
    plot,
  );
  return { card, plot, subtitle };
}
