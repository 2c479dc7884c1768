"""The stop request (dlrm_vrgd/train/stop.py): the first SIGTERM/SIGINT asks for a stop after the
step; the same signal delivered twice at once (to the process group and again by the supervisor
or launcher that forwards it) is still that request — the service's cancel hit this: the trainer
got two SIGTERMs, stopped mid-step and wrote no status; a second signal later stops at once."""

from __future__ import annotations

import signal

import pytest

from dlrm_vrgd.train import stop


def test_a_forwarded_copy_is_the_same_request_and_a_later_one_stops_at_once(monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(stop.time, "monotonic", lambda: clock[0])
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop.install(cooperative=True)
        stop._request(signal.SIGTERM, None)
        clock[0] += 0.01  # the group's copy and the supervisor's, milliseconds apart
        stop._request(signal.SIGTERM, None)
        assert stop.requested() == "SIGTERM"
        clock[0] += stop.SAME_REQUEST_S
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            stop._request(signal.SIGINT, None)  # a user's second Ctrl-C
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        stop._requested.clear()
