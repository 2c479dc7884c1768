"""``/jobs``: submit, list, get, cancel, delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response, status

from service.api.deps import JobId, ServiceDep
from service.api.responses import CONFLICT, INVALID, NOT_FOUND, UNAVAILABLE
from service.jobs.states import JobKind, JobState
from service.schemas import MAX_TAGS, JobCreate, JobPublic, JobsPublic, JobTag, Message

router = APIRouter(prefix="/jobs", tags=["jobs"])


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobPublic,
    responses={
        **INVALID,
        **UNAVAILABLE,
        200: {"description": "The job an earlier request with this submission_id made"},
        409: {
            "model": Message,
            "description": "The submission_id was used by a job with another request body",
        },
    },
)
def create_job(body: JobCreate, service: ServiceDep, response: Response) -> JobPublic:
    """Queue a job. The config is validated by the trainer's own TrainConfig model: unknown
    keys and bad values answer 422 naming the field, and nothing is stored. 503 when the
    backend cannot take jobs now (Slurm's controller unreachable), naming the cause.

    With a ``submission_id`` already used, nothing new is stored: the answer is the job the
    first request made, with status 200 (a retried POST makes one job), when the body is the
    same (after validation: a default spelled out is the same); another body under the id
    answers 409 naming the id and its job."""
    job, created = service.submit_once(body)
    if not created:
        response.status_code = status.HTTP_200_OK
    response.headers["Location"] = f"/api/v1/jobs/{job.id}"
    return service.public(job)


@router.get("", response_model=JobsPublic, responses={**INVALID})
def list_jobs(
    service: ServiceDep,
    state: Annotated[list[JobState], Query(description="Keep jobs in these states")] = [],  # noqa: B006
    kind: Annotated[JobKind | None, Query()] = None,
    name: Annotated[
        str | None, Query(max_length=200, description="Keep jobs whose name contains this")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
    tag: Annotated[
        list[JobTag], Query(max_length=MAX_TAGS, description="Keep jobs with all these tags")
    ] = [],  # noqa: B006
) -> JobsPublic:
    """Jobs, newest first; ``count`` is the number matching the filters."""
    jobs, count = service.list_jobs(state, kind, name, limit, offset, tag)
    return JobsPublic(data=[service.public(j) for j in jobs], count=count)


@router.get("/{job_id}", response_model=JobPublic, responses={**NOT_FOUND})
def get_job(job_id: JobId, service: ServiceDep) -> JobPublic:
    return service.public(service.get(job_id))


@router.post("/{job_id}/cancel", response_model=JobPublic, responses={**NOT_FOUND, **CONFLICT})
async def cancel_job(job_id: JobId, service: ServiceDep) -> JobPublic:
    """Cancel a queued or running job: SIGTERM to its process group, SIGKILL after the grace
    period. Answers once no process of the job is left (state ``cancelled``, or whatever the
    job reached first). 409 for a finished job."""
    return service.public(await service.cancel(job_id))


@router.post("/{job_id}/resubmit", response_model=JobPublic, responses={**NOT_FOUND, **CONFLICT})
def resubmit_job(job_id: JobId, service: ServiceDep) -> JobPublic:
    """Queue a failed or cancelled train or study job again: its next attempt (``attempts``)
    resumes the run from its newest verified checkpoint, and its series go on from there.
    409 for a job in any other state, and for score jobs (submit those again)."""
    return service.public(service.resubmit(job_id))


@router.delete(
    "/{job_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    responses={**NOT_FOUND, **CONFLICT},
)
def delete_job(job_id: JobId, service: ServiceDep) -> Response:
    """Forget a finished job and delete its files (409 while queued or running)."""
    service.delete(job_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
