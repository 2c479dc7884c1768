"""``/jobs/{id}/events``: server-sent events of one job."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.responses import StreamingResponse

from service.api.deps import JobId, ServiceDep
from service.api.responses import NOT_FOUND

router = APIRouter(prefix="/jobs", tags=["events"])
#: A record seq as this stream writes it (``str.isdigit`` takes "²", which ``int`` refuses).
_SEQ = re.compile(r"[0-9]{1,19}")


def _cursor(after: int | None, last_event_id: str | None) -> int:
    """Where the stream starts: ``after``, else a ``Last-Event-ID`` of ASCII digits (a record
    seq this stream sent), else the first record. Any other header (``²``, ``-1``, text) is
    ignored as the SSE specification says of an id the client could not have been sent."""
    if after is not None:
        return after
    text = (last_event_id or "").strip()
    if _SEQ.fullmatch(text):
        return min(int(text), 2**62)
    return 0


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
            "description": "An event stream; see the description",
        },
        **NOT_FOUND,
    },
)
def job_events(
    job_id: JobId,
    service: ServiceDep,
    after: Annotated[
        int | None, Query(ge=0, le=2**62, description="Start after this record seq")
    ] = None,
    last_event_id: Annotated[str | None, Header(max_length=32)] = None,
) -> StreamingResponse:
    """Server-sent events: ``job`` (a JobPublic, first and after each state change),
    ``metrics`` / ``gsnr`` / ``state`` records as they arrive (``id`` = record seq; a
    reconnecting client sends ``Last-Event-ID`` and misses nothing), ``end`` (the final
    JobPublic) when the job has finished; ``: keep-alive`` comments while idle."""
    service.get(job_id)  # 404 before the stream starts
    return StreamingResponse(
        service.events(job_id, _cursor(after, last_event_id)),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
