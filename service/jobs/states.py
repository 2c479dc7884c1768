"""Job states and the transitions between them (DESIGN.md 5).

``queued -> running -> succeeded | failed | cancelled``; a queued job can also be cancelled
(or fail to launch) without running. Terminal states never change.
"""

from __future__ import annotations

from typing import Literal

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
JobKind = Literal["train", "study", "score"]

QUEUED: JobState = "queued"
RUNNING: JobState = "running"
SUCCEEDED: JobState = "succeeded"
FAILED: JobState = "failed"
CANCELLED: JobState = "cancelled"

ACTIVE: frozenset[str] = frozenset({QUEUED, RUNNING})
TERMINAL: frozenset[str] = frozenset({SUCCEEDED, FAILED, CANCELLED})
ALL_STATES: tuple[JobState, ...] = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED)

#: state -> states it may move to.
TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({RUNNING, CANCELLED, FAILED}),
    RUNNING: frozenset({SUCCEEDED, FAILED, CANCELLED}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}


def can_move(src: str, dst: str) -> bool:
    return dst in TRANSITIONS.get(src, frozenset())
