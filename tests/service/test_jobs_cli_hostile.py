"""``dlrm-vrgd jobs`` against a hostile or broken server (issue 39, item 9): the real CLI (a
subprocess) talks to a scripted HTTP server on 127.0.0.1 that answers what no dlrm-vrgd
service would. Every answer and every bad argument ends in one line of error (or the output,
made printable), never a traceback; no terminal escape sequence from the server reaches the
terminal raw."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

#: A job id the scripted server knows.
JOB = "0123456789abcdef"
#: Sequences that would act on a terminal: clear the screen, OSC 52 (write the clipboard), set
#: the title, a C1 CSI, a right-to-left override.
ESCAPES = "\x1b[2J\x1b]52;c;aGVsbG8=\x07\x1b]0;owned\x07\x9b31m\u202e"
#: Raw control characters that must never appear in what the CLI prints.
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def job(**fields: Any) -> dict[str, Any]:
    return {"id": JOB, "name": "j", "kind": "train", "state": "running", **fields}


class Script:
    """(method, path) -> (status, headers, body); the body may be an iterator of chunks."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], tuple[int, dict[str, str], Any]] = {}

    def set(self, method: str, path: str, status: int, body: Any, **headers: str) -> None:
        if isinstance(body, dict | list):
            body = json.dumps(body).encode()
            headers.setdefault("Content-Type", "application/json")
        elif isinstance(body, str):
            body = body.encode()
        self.routes[(method, path)] = (status, headers, body)


@pytest.fixture
def server() -> Iterator[tuple[str, Script]]:
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self, method: str) -> None:
            path = self.path.split("?")[0]
            status, headers, body = script.routes.get(
                (method, path), (404, {}, b'{"detail": "no such route"}')
            )
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            if isinstance(body, bytes):
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.end_headers()
            try:
                for chunk in body():
                    self.wfile.write(chunk)
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass

        def do_GET(self) -> None:  # noqa: N802
            self._answer("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", script
    finally:
        httpd.shutdown()
        httpd.server_close()


def jobs(url: str, *args: str, token: str = "t0ken", timeout: float = 120):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DLRM_VRGD_")}
    env = {**clean, "XDG_CONFIG_HOME": "/nonexistent", "DLRM_VRGD_URL": url,
           "DLRM_VRGD_TOKEN": token, "DLRM_VRGD_PROGRESS_EVERY_S": "0"}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "jobs", *args],
        capture_output=True, text=True, env=env, timeout=timeout, errors="replace",
    )  # fmt: skip


def assert_safe(done: subprocess.CompletedProcess[str], code: int | None = 1) -> None:
    said = done.stdout + done.stderr
    assert "Traceback" not in said, said[-3000:]
    assert not RAW.search(said), repr(said[-3000:])
    if code is not None:
        assert done.returncode == code, (done.returncode, said[-3000:])
    if done.returncode:
        assert done.stderr.startswith(("error: ", "usage: ")), done.stderr[-3000:]


def _deep() -> Iterator[bytes]:
    yield b"[" * 200_000


def _huge() -> Iterator[bytes]:
    for _ in range(70):
        yield b" " * (1 << 20)


MALFORMED = {
    "not JSON": (200, "<html>surprise</html>"),
    "a JSON array": (200, [1, 2, 3]),
    "data not a list": (200, {"data": "x", "count": 1}),
    "count not a number": (200, {"data": [], "count": "1"}),
    "a job without an id": (200, {"data": [{"name": "x"}], "count": 1}),
    "a job id that is a path": (200, {"data": [job(id="../../etc")], "count": 1}),
    "invalid UTF-8": (200, b'{"data": [], "count": 0, "x": "\xff\xfe"}'),
    "nested too deep": (200, _deep),
    "larger than 64 MiB": (200, _huge),
    "a redirect": (302, ""),
    "a 500 with escapes": (500, f"internal {ESCAPES} error"),
    "a 422 of another shape": (422, {"detail": [{"loc": "body", "msg": ESCAPES}, 7, None]}),
    "a 401 whose detail is a list": (401, {"detail": [ESCAPES]}),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_answers_end_in_one_line_of_error(server: tuple[str, Script], case: str) -> None:
    url, script = server
    status, body = MALFORMED[case]
    headers = {"Location": "http://example.invalid/"} if status == 302 else {}
    script.set("GET", "/api/v1/jobs", status, body, **headers)
    done = jobs(url, "list")
    assert_safe(done)
    if status == 401:
        assert "--token-file" in done.stderr and "DLRM_VRGD_TOKEN" in done.stderr


def test_escape_sequences_from_the_server_are_shown_never_sent(
    server: tuple[str, Script],
) -> None:
    url, script = server
    evil = job(name=f"n{ESCAPES}", state=f"running{ESCAPES}", error=f"bad\n{ESCAPES}",
               progress={"step": "x", "total_steps": [], "best_val_auc": "0.9"},
               created_at=ESCAPES, tags=[ESCAPES, 3])  # fmt: skip
    script.set("GET", "/api/v1/jobs", 200, {"data": [evil], "count": 1})
    script.set("GET", f"/api/v1/jobs/{JOB}", 200, evil)
    script.set("GET", f"/api/v1/jobs/{JOB}/logs", 200, f"line one\n{ESCAPES}\r\nline\x00 three\n")
    listed = jobs(url, "list")
    assert_safe(listed, 0)
    assert "\\x1b[2J" in listed.stdout  # shown as text, not sent
    status = jobs(url, "status", JOB)
    assert_safe(status, 0)
    assert "\\x1b]52;c;aGVsbG8=\\x07" in status.stdout and "\\u202e" in status.stdout
    logs = jobs(url, "logs", JOB)
    assert_safe(logs, 0)
    assert logs.stdout.splitlines()[0] == "line one" and "line\\x00 three" in logs.stdout
    as_json = jobs(url, "list", "--json")  # JSON escapes them itself
    assert_safe(as_json, 0)
    assert json.loads(as_json.stdout)["data"][0]["name"] == f"n{ESCAPES}"


def test_a_hostile_event_stream_and_log_stream_cannot_break_a_follow(
    server: tuple[str, Script],
) -> None:
    url, script = server
    script.set("GET", f"/api/v1/jobs/{JOB}", 200, job(state="succeeded"))
    events = (
        'id: \u00b2\nevent: metrics\ndata: {"kind": "train", "step": "x", '
        '"loss": [1], "rows_per_s": "fast"}\n\n'
        'event: gsnr\ndata: {"tables": [1, {"ratio": "r"}, null]}\n\n'
        'event: metrics\ndata: {"kind": "eval", "split": {}, "auc": null}\n\n'
        f"event: state\ndata: {json.dumps({'message': ESCAPES})}\n\n"
        "event: state\ndata: not json at all\n\n"
        "event: end\ndata: {}\n\n"
    )
    script.set("GET", f"/api/v1/jobs/{JOB}/events", 200, events,
               **{"Content-Type": "text/event-stream"})  # fmt: skip
    script.set("POST", f"/api/v1/jobs/{JOB}/resubmit", 200, job(state="queued"))
    script.set("GET", f"/api/v1/jobs/{JOB}/artifacts", 200, {"data": [{"path": 5}, "x"]})
    done = jobs(url, "resubmit", JOB, "--follow")
    assert_safe(done, 0)
    assert "\\x1b[2J" in done.stderr  # the state message, shown

    def endless_line() -> Iterator[bytes]:
        yield b"event: metrics\ndata: "
        for _ in range(3):
            yield b"x" * (1 << 20)

    script.set("GET", f"/api/v1/jobs/{JOB}/events", 200, endless_line,
               **{"Content-Type": "text/event-stream"})  # fmt: skip
    assert_safe(jobs(url, "resubmit", JOB, "--follow"))

    script.set("GET", f"/api/v1/jobs/{JOB}/logs", 200, "tail\n", **{"X-Log-Offset": "x"})
    assert_safe(jobs(url, "logs", JOB, "--follow"))


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "../../health"],
        ["status", "a?b"],
        ["status", "\x1b[2J"],
        ["list", "--limit", "-1"],
        ["list", "--limit", "lots"],
        ["list", "--state", "sleeping"],
        ["logs", JOB, "--tail", "0"],
        ["submit", "/nonexistent.yaml"],
        ["submit", "/", "--timeout", "nan"],
        ["--url", "http://[::1", "list"],
        ["--url", "ftp://x", "list"],
        ["list", "--url", "http://127.0.0.1:9/\x1b[2J"],
    ],
)
def test_bad_arguments_end_in_one_line_of_usage_or_error(
    server: tuple[str, Script], argv: list[str]
) -> None:
    url, _ = server
    done = jobs(url, *argv)
    assert_safe(done, None)
    assert done.returncode in (1, 2)


@pytest.mark.parametrize("token", ["two words", "tab\there", "caf\u00e9", "line\nbreak"])
def test_a_token_that_cannot_be_a_header_is_refused_before_sending(
    server: tuple[str, Script], token: str, tmp_path: Path
) -> None:
    url, _ = server
    done = jobs(url, "list", token=token)
    assert_safe(done, 2)
    assert "bearer token" in done.stderr and token not in done.stderr
