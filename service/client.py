"""A small synchronous client of the service API (httpx), with server-sent-event parsing.

Used by ``dlrm-vrgd demo``, the load bench and the tests; a handy start for scripts too::

    client = ServiceClient("http://127.0.0.1:8000", token)
    job = client.submit("my-run", config_dict)
    for event in client.events(job["id"]):
        ...
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

API = "/api/v1"
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
#: Most bytes of one answer (or one event-stream line) the client reads: a server that sends
#: more is refused (:class:`BadAnswer`), not buffered without end.
MAX_ANSWER_BYTES = 64 << 20
MAX_LINE_BYTES = 1 << 20


class ApiError(RuntimeError):
    """A 4xx/5xx answer; ``detail`` is the decoded body."""

    def __init__(self, status_code: int, detail: Any) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


class BadAnswer(RuntimeError):
    """An answer that is not what the API documents (not JSON, too large, a stream line
    without end): whoever answered is not a working dlrm-vrgd service."""


@dataclass(frozen=True)
class Event:
    """One server-sent event: ``event`` name, ``data`` decoded from JSON, ``id`` if any."""

    event: str
    data: Any
    id: int | None


def parse_sse(lines: Iterator[str]) -> Iterator[Event]:
    """Events from the lines of a ``text/event-stream`` body (comments skipped)."""
    name, data, event_id = "message", [], None
    for line in lines:
        if line == "":
            if data:
                text = "\n".join(data)
                try:
                    payload: Any = json.loads(text)
                except ValueError:
                    payload = text
                yield Event(name, payload, event_id)
            name, data, event_id = "message", [], None
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if key == "event":
            name = value
        elif key == "data":
            data.append(value)
        elif key == "id":
            event_id = int(value) if value.isascii() and value.isdigit() else None


def bounded_lines(chunks: Iterator[bytes], limit: int = MAX_LINE_BYTES) -> Iterator[str]:
    """The lines of a byte stream (``\n``, ``\r\n`` or ``\r`` ended, as event streams
    allow), decoded as UTF-8; a line longer than ``limit`` bytes is :class:`BadAnswer`."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        while True:
            cut = min((i for i in (pending.find(b"\n"), pending.find(b"\r")) if i >= 0), default=-1)
            if cut < 0:
                break
            line, rest = pending[:cut], pending[cut + 1 :]
            if pending[cut : cut + 1] == b"\r" and rest.startswith(b"\n"):
                rest = rest[1:]
            elif pending[cut : cut + 1] == b"\r" and not rest:
                break  # a CR at a chunk's end: its LF may follow in the next one
            pending = rest
            yield line.decode("utf-8", errors="replace")
        if len(pending) > limit:
            raise BadAnswer(f"an event-stream line longer than {limit >> 20} MiB")
    if pending:
        yield pending.rstrip(b"\r").decode("utf-8", errors="replace")


class ServiceClient:
    """Calls ``/api/v1`` with the bearer token; raises :class:`ApiError` on 4xx/5xx."""

    def __init__(self, base_url: str, token: str | None, timeout: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def url(self, path: str) -> str:
        return f"{self.base_url}{API}{path}"

    def _read(self, method: str, path: str, **kwargs: Any) -> tuple[int, bytes, Any]:
        """(status, body, headers) of one request, the body read up to
        :data:`MAX_ANSWER_BYTES`."""
        with self.http.stream(method, f"{API}{path}", **kwargs) as response:
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    raise BadAnswer(
                        f"{method} {path}: the answer is larger than {MAX_ANSWER_BYTES >> 20} MiB"
                    )
            return response.status_code, bytes(body), response.headers

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        status, body, _ = self._read(method, path, **kwargs)
        if status >= 400:
            try:
                decoded = json.loads(body)
            except (ValueError, RecursionError):
                decoded = body.decode("utf-8", errors="replace")
            detail = decoded.get("detail") if isinstance(decoded, dict) else decoded
            raise ApiError(status, detail)
        if status == 204:
            return None
        if status != 200 and status != 201:
            raise BadAnswer(f"{method} {path}: status {status}, not an answer of the API")
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as err:
            raise BadAnswer(
                f"{method} {path}: the answer is not JSON ({type(err).__name__})"
            ) from None

    def _text(self, path: str, **params: Any) -> tuple[str, Any]:
        """A text answer and its headers (ApiError for 4xx/5xx)."""
        status, body, headers = self._read("GET", path, params=params)
        text = body.decode("utf-8", errors="replace")
        if status >= 400:
            raise ApiError(status, text)
        return text, headers

    # ---------------------------------------------------------------------------- calls
    def health(self) -> dict[str, Any]:
        return self._json("GET", "/health")

    def submit(
        self,
        name: str,
        config: dict[str, Any],
        timeout_s: float | None = None,
        kind: str = "train",
        **options: Any,
    ) -> dict[str, Any]:
        """POST /jobs; ``options``: more fields of the body (``max_retries``,
        ``submission_id``, ``slurm``), None ones left out."""
        body: dict[str, Any] = {"name": name, "kind": kind, "config": config}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        body.update({k: v for k, v in options.items() if v is not None})
        return self._json("POST", "/jobs", json=body)

    def job(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/jobs/{job_id}")

    def jobs(self, **params: Any) -> dict[str, Any]:
        return self._json("GET", "/jobs", params=params)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/jobs/{job_id}/cancel")

    def resubmit(self, job_id: str) -> dict[str, Any]:
        """Queue a failed or cancelled job again; it resumes from its newest checkpoint."""
        return self._json("POST", f"/jobs/{job_id}/resubmit")

    def delete(self, job_id: str) -> None:
        self._json("DELETE", f"/jobs/{job_id}")

    def metrics(self, job_id: str, **params: Any) -> dict[str, Any]:
        return self._json("GET", f"/jobs/{job_id}/metrics", params=params)

    def gsnr(self, job_id: str, **params: Any) -> dict[str, Any]:
        return self._json("GET", f"/jobs/{job_id}/gsnr", params=params)

    def advice(self, job_id: str, **params: Any) -> dict[str, Any]:
        """The batch-size advice from the job's gradient noise scale (``dlrm-vrgd advise``)."""
        return self._json("GET", f"/jobs/{job_id}/advice", params=params)

    def result(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/jobs/{job_id}/result")

    def artifacts(self, job_id: str, **params: Any) -> dict[str, Any]:
        """The job's files (``prefix=`` keeps those under a folder)."""
        return self._json("GET", f"/jobs/{job_id}/artifacts", params=params)

    def download(self, job_id: str, path: str) -> bytes:
        response = self.http.get(f"{API}/jobs/{job_id}/artifacts/{path}")
        if response.status_code >= 400:
            raise ApiError(response.status_code, response.text)
        return response.content

    def model(self, job_id: str) -> bytes:
        """A succeeded train job's model directory as a tar archive (``model-ID/...``)."""
        response = self.http.get(f"{API}/jobs/{job_id}/model")
        if response.status_code >= 400:
            raise ApiError(response.status_code, response.text)
        return response.content

    def logs(self, job_id: str, tail: int = 100) -> str:
        return self._text(f"/jobs/{job_id}/logs", tail=tail)[0]

    def log_chunk(self, job_id: str, offset: int) -> tuple[str, int]:
        """The log's whole lines from byte ``offset`` (up to the server's chunk) and the
        offset to ask from next (``X-Log-Offset``)."""
        text, headers = self._text(f"/jobs/{job_id}/logs", offset=offset)
        nxt = headers.get("X-Log-Offset", "")
        if not (nxt.isascii() and nxt.isdigit()) or int(nxt) < offset:
            raise BadAnswer(f"GET /jobs/{job_id}/logs: X-Log-Offset {nxt[:40]!r} is not an offset")
        return text, int(nxt)

    def follow_log(self, job_id: str, offset: int) -> Iterator[str]:
        """The log's new text from byte ``offset`` as it comes, until the job has ended."""
        with self.http.stream(
            "GET",
            f"{API}/jobs/{job_id}/logs",
            params={"offset": offset, "follow": "true"},
            timeout=httpx.Timeout(self.http.timeout.connect, read=None),
        ) as response:
            if response.status_code >= 400:
                response.read()
                raise ApiError(response.status_code, response.text[:2000])
            yield from response.iter_text()

    def wait(self, job_id: str, timeout: float = 300.0, poll: float = 0.25) -> dict[str, Any]:
        """Poll until the job is finished; the final job (TimeoutError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["state"] in TERMINAL:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout:.0f} s")
            time.sleep(poll)

    def events(self, job_id: str, after: int | None = None, reconnect: int = 5) -> Iterator[Event]:
        """Follow the job's event stream until its ``end`` event, reconnecting (from the last
        event id) up to ``reconnect`` times when the connection drops."""
        last = after
        failures = 0
        while True:
            headers = {"Last-Event-ID": str(last)} if last is not None else {}
            try:
                with self.http.stream(
                    "GET",
                    f"{API}/jobs/{job_id}/events",
                    headers=headers,
                    timeout=httpx.Timeout(self.http.timeout.connect, read=None),
                ) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise ApiError(response.status_code, response.text)
                    for event in parse_sse(bounded_lines(response.iter_bytes())):
                        if event.id is not None:
                            last = event.id
                        yield event
                        if event.event == "end":
                            return
            except (httpx.TransportError, httpx.RemoteProtocolError):
                failures += 1
                if failures > reconnect:
                    raise
                time.sleep(min(2.0, 0.2 * failures))
                continue
            return
