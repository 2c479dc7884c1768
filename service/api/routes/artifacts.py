"""``/jobs/{id}/result``, ``/logs`` and ``/artifacts``: what a job leaves behind."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from fastapi.responses import FileResponse, PlainTextResponse, StreamingResponse

from service.api.deps import JobId, ServiceDep
from service.api.responses import DAMAGED, INVALID, NOT_FOUND
from service.errors import InvalidInput
from service.jobs.files import tar_stream
from service.schemas import ArtifactPublic, ArtifactsPublic

router = APIRouter(prefix="/jobs", tags=["artifacts"])


@router.get("/{job_id}/result", response_model=dict[str, Any], responses={**NOT_FOUND})
def get_result(job_id: JobId, service: ServiceDep) -> dict[str, Any]:
    """The run's result.json: final val/test metrics beside the oracle's, best val AUC,
    timings, optimizers, config, versions. 404 until the job has succeeded."""
    return service.result(job_id)


@router.get(
    "/{job_id}/logs",
    response_class=PlainTextResponse,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
        **NOT_FOUND,
        **INVALID,
    },
)
def get_logs(
    job_id: JobId,
    service: ServiceDep,
    tail: Annotated[int, Query(ge=1, le=10_000, description="Last N lines")] = 100,
    offset: Annotated[
        int | None,
        Query(ge=0, le=1 << 50, description="Bytes of the log from this offset (not `tail`)"),
    ] = None,
    follow: Annotated[
        bool, Query(description="Stream new bytes (from `offset`, else from now) until it ends")
    ] = False,
    task: Annotated[
        int | None,
        Query(
            ge=0,
            le=65_535,
            description="Only the lines of this srun task (Slurm: one task per node, the lines "
            "`srun --label` starts with `T: `); not a training rank",
        ),
    ] = None,
    rank: Annotated[
        str | None,
        Query(
            max_length=16, description="Refused: use `task` (the log labels srun tasks, not ranks)"
        ),
    ] = None,
) -> Response:
    """The job's stdout and stderr, every attempt's (progress-bar redraws collapsed). By
    default its last ``tail`` lines; with ``offset`` its bytes from there, the offset to ask
    from next in the ``X-Log-Offset`` header; with ``follow=true`` a stream of its new bytes
    until the job has finished. ``task`` keeps the lines srun labelled with that task (under
    Slurm, one per node). Which task hosts which training rank is up to torchrun's
    rendezvous and the log does not say, so there is no filter by rank: ``rank`` answers 422."""
    if rank is not None:
        raise InvalidInput(
            "rank",
            "the log's lines are labelled by srun task (one per node), not by training rank "
            "(torchrun's rendezvous decides which task hosts which rank): use task=",
            ("query", "rank"),
        )
    if follow:
        service.get(job_id)
        return StreamingResponse(
            service.log_follow(job_id, offset, task), media_type="text/plain; charset=utf-8"
        )
    if offset is not None:
        data, end = service.log_from(job_id, offset, task)
        return Response(
            data, media_type="text/plain; charset=utf-8", headers={"X-Log-Offset": str(end)}
        )
    lines = service.log_tail(job_id, tail, task)
    return PlainTextResponse("\n".join(lines) + ("\n" if lines else ""))


@router.get(
    "/{job_id}/model",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/x-tar": {"schema": {"type": "string"}}}},
        **NOT_FOUND,
        **DAMAGED,
    },
)
def get_model(job_id: JobId, service: ServiceDep) -> StreamingResponse:
    """A succeeded train job's model (``dlrm-vrgd export``: weights, feature layout, config,
    torch.export program, manifest with SHA-256) as one tar archive, ``model-ID/...``. Load it
    with ``dlrm_vrgd.serve.model.load_model`` or score with ``dlrm-vrgd score --model``.
    Every file is checked against the manifest first: 409 for a model altered on disk (and an
    archive cut short if a file changes while it is sent); links are never followed."""
    model, manifest = service.model(job_id)
    return StreamingResponse(
        tar_stream(model, f"model-{job_id}", manifest.get("files")),
        media_type="application/x-tar",
        headers={"Content-Disposition": f'attachment; filename="model-{job_id}.tar"'},
    )


@router.get("/{job_id}/artifacts", response_model=ArtifactsPublic, responses={**NOT_FOUND})
def list_artifacts(
    job_id: JobId,
    service: ServiceDep,
    prefix: Annotated[
        str,
        Query(
            max_length=1024,
            description="Only paths that start with this, e.g. `checkpoints/`",
        ),
    ] = "",
) -> ArtifactsPublic:
    """Files of the run directory, sorted by path: config.json, metrics.jsonl, gsnr.jsonl,
    result.json, checkpoints/step_XXXXXXXX/{rank0.pt,manifest.json} (only the newest
    ``run.keep_checkpoints`` are kept: list them before downloading one)."""
    found = [a for a in service.artifacts(job_id) if a.path.startswith(prefix)]
    return ArtifactsPublic(
        data=[ArtifactPublic(path=a.path, bytes=a.bytes, modified_at=a.modified_at) for a in found],
        count=len(found),
    )


@router.get(
    "/{job_id}/artifacts/{path:path}",
    response_class=FileResponse,
    responses={
        200: {"content": {"application/octet-stream": {"schema": {"type": "string"}}}},
        **NOT_FOUND,
        **INVALID,
    },
)
def get_artifact(job_id: JobId, path: str, service: ServiceDep) -> FileResponse:
    """Download one artifact. Paths are relative to the run directory; absolute paths,
    ``..`` segments and anything resolving outside the run directory are refused."""
    target = service.artifact_path(job_id, path)
    return FileResponse(target, filename=target.name)
