// A small Markdown renderer for the study's results (headings, paragraphs, lists, pipe tables,
// fenced code, **bold**, *italic*, `code`, [links](https://...)). It builds DOM nodes from text
// and never parses HTML, so a results file cannot inject markup or scripts.

import { h } from "./dom.js";

const TABLE_ROW = /^\s*\|.*\|\s*$/;
const TABLE_RULE = /^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$/;

/** Inline formatting of one line of text -> an array of nodes. */
export function inline(text) {
  const out = [];
  // code spans first, then links, bold, italic
  const pattern = /(`[^`]+`)|\[([^\]]+)\]\(([^)\s]+)\)|\*\*([^*]+)\*\*|(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])|_([^_\s][^_]*)_(?!\w)/g;
  let last = 0;
  for (const m of text.matchAll(pattern)) {
    if (m.index > last) out.push(text.slice(last, m.index));
    if (m[1]) out.push(h("code", {}, m[1].slice(1, -1)));
    else if (m[2]) {
      const href = m[3];
      // only web links and relative paths; never javascript: or data: URLs
      out.push(/^(https?:\/\/|#)/.test(href) ? h("a", { href, target: "_blank", rel: "noopener noreferrer" }, m[2]) : m[2]);
    } else if (m[4]) out.push(h("strong", {}, m[4]));
    else if (m[5]) out.push(h("em", {}, m[5]));
    else if (m[6]) out.push(h("em", {}, m[6]));
    last = m.index + m[0].length;
  }
  if (last < text.length) out.push(text.slice(last));
  return out;
}

function cells(row) {
  let s = row.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|")) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

function alignments(rule) {
  return cells(rule).map((c) => (c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : null));
}

function table(header, rule, rows) {
  const align = alignments(rule);
  const numeric = /^[-+]?[\d.,]+(\s*±\s*[\d.,]+)?%?$/;
  const th = cells(header).map((c, i) => h("th", { style: align[i] ? { textAlign: align[i] } : null }, inline(c)));
  const body = rows.map((r) =>
    h("tr", {}, cells(r).map((c, i) => h("td", {
      class: numeric.test(c) ? "num" : null,
      style: align[i] ? { textAlign: align[i] } : null,
    }, inline(c)))),
  );
  return h("div", { class: "table-scroll" }, h("table", { class: "data md-table" }, h("thead", {}, h("tr", {}, th)), h("tbody", {}, body)));
}

/** Render Markdown text into a document fragment. */
export function renderMarkdown(text) {
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  const frag = document.createDocumentFragment();
  let para = [];
  const flush = () => {
    if (para.length) frag.append(h("p", {}, inline(para.join(" "))));
    para = [];
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    if (/^\s*```/.test(line)) {
      flush();
      const code = [];
      for (i += 1; i < lines.length && !/^\s*```/.test(lines[i]); i++) code.push(lines[i]);
      frag.append(h("pre", { class: "code" }, code.join("\n")));
      continue;
    }
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    if (heading) {
      flush();
      const level = Math.min(6, heading[1].length + 2); // the page has h1/h2 already
      frag.append(h(`h${level}`, { class: "md-heading" }, inline(heading[2])));
      continue;
    }
    if (TABLE_ROW.test(line) && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
      flush();
      const rows = [];
      let j = i + 2;
      for (; j < lines.length && TABLE_ROW.test(lines[j]); j++) rows.push(lines[j]);
      frag.append(table(line, lines[i + 1], rows));
      i = j - 1;
      continue;
    }
    if (/^\s*([-*+]|\d+\.)\s+/.test(line)) {
      flush();
      const ordered = /^\s*\d+\./.test(line);
      const items = [];
      for (; i < lines.length && /^\s*([-*+]|\d+\.)\s+/.test(lines[i]); i++) {
        items.push(h("li", {}, inline(lines[i].replace(/^\s*([-*+]|\d+\.)\s+/, ""))));
      }
      i -= 1;
      frag.append(h(ordered ? "ol" : "ul", {}, items));
      continue;
    }
    if (/^\s*$/.test(line)) {
      flush();
      continue;
    }
    para.push(line.trim());
  }
  flush();
  return frag;
}
