"""Job states and the transitions between them (DESIGN.md 5).

``queued -> running -> succeeded | failed | cancelled``; a queued job can also be cancelled
(or fail to launch) without running. A failed or cancelled train or study job may be
*resubmitted* (``POST /jobs/{id}/resubmit``): it goes back to ``queued`` and its next attempt
resumes the run from its newest checkpoint. Nothing else leaves a terminal state.
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
    FAILED: frozenset({QUEUED}),  # resubmit only
    CANCELLED: frozenset({QUEUED}),  # resubmit only
}
#: States a job can be resubmitted from.
RESUBMITTABLE: frozenset[str] = frozenset({FAILED, CANCELLED})


def can_move(src: str, dst: str) -> bool:
    return dst in TRANSITIONS.get(src, frozenset())
