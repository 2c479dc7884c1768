"""The logs endpoint as users read it, through a real service: ``?offset=N`` returns the bytes
from there and the next offset, ``?follow=true`` streams new bytes only until the job ends,
and progress is written as whole plain lines (no carriage-return redraws)."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from service.client import API, ServiceClient
from service.launcher import LocalService

from .conftest import long_job, wait_for


def test_offset_and_follow_return_new_bytes_only(
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    svc = start_service(DLRM_VRGD_PROGRESS_EVERY_S="0.2")
    client = client_of(svc)
    job = client.submit("chatty", long_job())
    log = svc.data_dir / "jobs" / job["id"] / "train.log"
    wait_for(lambda: log.exists() and log.read_bytes().count(b"\nstep ") >= 2, timeout=120)

    def shown(raw: bytes) -> bytes:  # the service's paths relative to its data directory
        return raw.replace(f"{svc.data_dir}/jobs/".encode(), b"jobs/")

    first = client.http.get(f"{API}/jobs/{job['id']}/logs", params={"offset": 0})
    assert first.status_code == 200
    end = int(first.headers["X-Log-Offset"])
    assert shown(log.read_bytes()[:end]) == first.content and first.content.endswith(b"\n")
    wait_for(lambda: log.stat().st_size > end + 100, timeout=60)
    more = client.http.get(f"{API}/jobs/{job['id']}/logs", params={"offset": end})
    after = int(more.headers["X-Log-Offset"])
    assert shown(log.read_bytes()[end:after]) == more.content and more.content.endswith(b"\n")

    start = after
    got = b""
    params = {"offset": start, "follow": "true"}
    with client.http.stream(
        "GET", f"{API}/jobs/{job['id']}/logs", params=params, timeout=httpx.Timeout(60)
    ) as response:
        assert response.status_code == 200
        for chunk in response.iter_bytes():
            got += chunk
            if got.count(b"\n") >= 3 and client.job(job["id"])["state"] == "running":
                client.http.post(f"{API}/jobs/{job['id']}/cancel")  # the stream ends with it
    assert got and shown(log.read_bytes()[start:]) == got  # every new line once, none before
    text = log.read_text()
    assert "\r" not in text  # progress as periodic plain lines
    steps = [ln for ln in text.splitlines() if ln.startswith("step ")]
    assert len(steps) >= 3 and all(" loss " in ln and "rows/s" in ln for ln in steps)
    tail = client.logs(job["id"], tail=5)
    assert tail.splitlines() == text.splitlines()[-5:]
    none = client.http.get(f"{API}/jobs/{job['id']}/logs", params={"task": 0})
    assert none.status_code == 200 and none.text == ""  # no srun here: no task labels
    # ?rank= filtered by srun's task, not by training rank: refused, saying so
    rank = client.http.get(f"{API}/jobs/{job['id']}/logs", params={"rank": 0})
    assert rank.status_code == 422, rank.text
    issue = rank.json()["detail"][0]
    assert issue["field"] == "rank" and "task=" in issue["msg"], issue
    bad = client.http.get(f"{API}/jobs/{job['id']}/logs", params={"offset": -1})
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "offset"
