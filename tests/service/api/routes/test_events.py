"""/jobs/{id}/events: a snapshot first, keep-alives while idle, state changes live, an end."""

from __future__ import annotations

import threading
import time

import httpx

from service.client import ServiceClient, parse_sse
from service.launcher import LocalService

from ...conftest import tiny_job


def test_event_stream_of_a_queued_job_until_it_is_cancelled(
    api: LocalService, client: ServiceClient
) -> None:
    job = client.submit("watched", tiny_job())
    lines: list[str] = []
    headers = {"Authorization": f"Bearer {api.token}"}
    url = f"{api.base_url}/api/v1/jobs/{job['id']}/events"

    def read() -> None:
        with httpx.stream("GET", url, headers=headers, timeout=30) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                lines.append(line)

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 20
    while ": keep-alive" not in lines and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ": keep-alive" in lines  # idle stream (DLRM_VRGD_SSE_KEEPALIVE_S=1)
    client.cancel(job["id"])
    reader.join(20)
    assert not reader.is_alive()  # the stream ended by itself

    events = list(parse_sse(iter(lines)))
    assert [e.event for e in events] == ["job", "state", "state", "end"]
    assert events[0].data["state"] == "queued"
    assert [e.data["state"] for e in events[1:3]] == ["queued", "cancelled"]
    assert events[-1].data["state"] == "cancelled"
    first, second = events[1].id, events[2].id
    assert first is not None and second is not None and first < second

    # Resuming after the first record replays only what followed it.
    with httpx.stream("GET", url, headers={**headers, "Last-Event-ID": str(first)}) as response:
        resumed = list(parse_sse(response.iter_lines()))
    assert [(e.event, e.id) for e in resumed[1:]] == [("state", second), ("end", None)]
