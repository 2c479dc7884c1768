// The service API as the dashboard uses it: the token, authenticated fetches, downloads.
//
// The token lives in sessionStorage (this tab, until it is closed) and travels only in the
// Authorization header. It never goes into a URL: artifact links are fetched with the header
// and handed to the browser as blob: URLs.

export const API = "/api/v1";
const TOKEN_KEY = "dlrm-vrgd.token";

/** The request was refused for want of a (valid) token. */
export class AuthError extends Error {}

/** A 4xx/5xx answer; `detail` is the decoded body's detail. */
export class ApiError extends Error {
  constructor(status, detail) {
    super(`HTTP ${status}: ${describe(detail)}`);
    this.status = status;
    this.detail = detail;
  }
}

/** A human-readable message from a FastAPI error detail (string or list of issues). */
export function describe(detail) {
  if (Array.isArray(detail)) {
    return detail.map((d) => (d && d.field ? `${d.field}: ${d.msg}` : JSON.stringify(d))).join("; ");
  }
  return typeof detail === "string" ? detail : JSON.stringify(detail);
}

export function getToken() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function setToken(token) {
  sessionStorage.setItem(TOKEN_KEY, token);
}

export function clearToken() {
  sessionStorage.removeItem(TOKEN_KEY);
}

let unauthorized = () => {};

/** Called (with a message) when the service answers 401: the app shows the sign-in form. */
export function onUnauthorized(handler) {
  unauthorized = handler;
}

export function authHeaders(token = getToken()) {
  if (!token) throw new AuthError("not signed in");
  return { Authorization: `Bearer ${token}` };
}

/** Handle a 401 the same way wherever it comes from. */
export function refuse() {
  clearToken();
  unauthorized("The service refused the token (401). Sign in again.");
  return new AuthError("token refused");
}

/**
 * fetch(API + path) with the bearer token; JSON in and out.
 * Options: method, body (an object, sent as JSON), signal, raw (return the Response).
 */
export async function api(path, { method = "GET", body, signal, raw = false } = {}) {
  const headers = authHeaders();
  const init = { method, headers, signal, cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const res = await fetch(API + path, init);
  if (res.status === 401) throw refuse();
  if (!res.ok) {
    let detail = res.statusText;
    try {
      detail = (await res.json()).detail ?? detail;
    } catch {
      // not JSON: keep the status text
    }
    throw new ApiError(res.status, detail);
  }
  if (raw) return res;
  return res.status === 204 ? null : res.json();
}

/** True when `token` is accepted (one cheap authenticated request). */
export async function tokenIsValid(token) {
  const res = await fetch(`${API}/jobs?limit=1`, {
    headers: authHeaders(token),
    cache: "no-store",
  });
  if (res.status === 401) return false;
  if (!res.ok) throw new ApiError(res.status, res.statusText);
  return true;
}

/** Query string from an object; arrays repeat the key; null/undefined values are left out. */
export function query(params) {
  const q = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value === null || value === undefined) continue;
    for (const v of Array.isArray(value) ? value : [value]) q.append(key, String(v));
  }
  const s = q.toString();
  return s ? `?${s}` : "";
}

function artifactPath(jobId, path) {
  const encoded = path.split("/").map(encodeURIComponent).join("/");
  return `/jobs/${encodeURIComponent(jobId)}/artifacts/${encoded}`;
}

/** An artifact's bytes as a Blob (fetched with the token). */
export async function artifactBlob(jobId, path, signal) {
  const res = await api(artifactPath(jobId, path), { raw: true, signal });
  return res.blob();
}

/** An artifact's text. */
export async function artifactText(jobId, path, signal) {
  const res = await api(artifactPath(jobId, path), { raw: true, signal });
  return res.text();
}

/** Save an artifact through the browser's download (a blob: URL, no token in it). */
export async function downloadArtifact(jobId, path) {
  const blob = await artifactBlob(jobId, path);
  const url = URL.createObjectURL(blob);
  const a = document.createElement("a");
  a.href = url;
  a.download = path.split("/").pop();
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}
