// Server-sent events over fetch streaming.
//
// EventSource cannot send an Authorization header, and the token must never be put in a URL,
// so the stream is read with fetch(): the body is parsed as text/event-stream here. A dropped
// connection is resumed after the last event id received (the service replays from there), so
// nothing is missed and nothing is delivered twice.

import { API, AuthError, authHeaders, refuse } from "./api.js";

/** Incremental text/event-stream parser: feed() text chunks, get complete events back. */
export class SSEParser {
  constructor() {
    this.buffer = "";
    this.retry = null;
    this.reset();
  }

  reset() {
    this.event = "";
    this.data = [];
    this.id = null;
  }

  /** Parse a chunk; returns the events it completed: {event, data (string), id}. */
  feed(chunk) {
    this.buffer += chunk;
    const out = [];
    // Keep a trailing "\r": it may be the first half of a "\r\n" split across chunks.
    let cut = this.buffer.length;
    if (this.buffer.endsWith("\r")) cut -= 1;
    const text = this.buffer.slice(0, cut);
    const lines = text.split(/\r\n|\r|\n/);
    this.buffer = lines.pop() + this.buffer.slice(cut);
    for (const line of lines) {
      if (line === "") {
        if (this.data.length) {
          out.push({ event: this.event || "message", data: this.data.join("\n"), id: this.id });
        }
        this.reset();
        continue;
      }
      if (line.startsWith(":")) continue; // comment (keep-alive)
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") this.event = value;
      else if (field === "data") this.data.push(value);
      else if (field === "id") this.id = value;
      else if (field === "retry" && /^\d+$/.test(value)) this.retry = Number(value);
    }
    return out;
  }
}

/**
 * Follow a job's event stream until its `end` event or until `signal` aborts.
 *
 * onEvent(name, data, id) gets each event with `data` decoded from JSON; onStatus(status)
 * gets "connecting" | "live" | "reconnecting" | "ended" | "error". `after` is the record
 * seq to start after. Returns a promise that settles when following stops.
 */
export async function followEvents(jobId, { after = 0, onEvent, onStatus = () => {}, signal }) {
  let cursor = after;
  let delay = 1000;
  let attempts = 0;
  const base = `${API}/jobs/${encodeURIComponent(jobId)}/events`;
  while (!signal?.aborted) {
    onStatus(attempts++ ? "reconnecting" : "connecting");
    const parser = new SSEParser();
    try {
      const headers = { ...authHeaders(), Accept: "text/event-stream" };
      if (cursor > 0) headers["Last-Event-ID"] = String(cursor);
      const res = await fetch(base, { headers, signal, cache: "no-store" });
      if (res.status === 401) throw refuse();
      if (res.status === 404) {
        onStatus("error");
        return;
      }
      if (!res.ok || !res.body) throw new Error(`event stream answered HTTP ${res.status}`);
      onStatus("live");
      delay = 1000;
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        for (const ev of parser.feed(value)) {
          let data = ev.data;
          try {
            data = JSON.parse(ev.data);
          } catch {
            // not JSON: pass the text on
          }
          if (ev.id !== null && /^\d+$/.test(ev.id)) cursor = Math.max(cursor, Number(ev.id));
          onEvent(ev.event, data, ev.id === null ? null : Number(ev.id));
          if (ev.event === "end") {
            onStatus("ended");
            await reader.cancel().catch(() => {});
            return;
          }
        }
      }
    } catch (err) {
      if (signal?.aborted) return;
      if (err instanceof AuthError) {
        onStatus("error");
        return;
      }
      // network error or the service went away: retry below
    }
    // The stream closed without `end` (service restarting, proxy timeout): resume after the
    // last event received, backing off up to 15 s.
    onStatus("reconnecting");
    await sleep(Math.max(delay, parser.retry ?? 0), signal);
    delay = Math.min(delay * 2, 15_000);
  }
}

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => {
      clearTimeout(timer);
      resolve();
    });
  });
}
