"""``/jobs/{id}/metrics`` and ``/jobs/{id}/gsnr``: stored series, paged and downsampled;
``/jobs/{id}/advice``: the batch-size advice from the run's gradient noise scale.

Records are stored as JSON text and served as they are (no re-encoding), which keeps polling
cheap.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response

from service.api.deps import JobId, ServiceDep
from service.api.responses import NOT_FOUND
from service.jobs.store import Series
from service.schemas import SeriesPage

router = APIRouter(prefix="/jobs", tags=["series"])

After = Annotated[
    int, Query(ge=0, le=2**62, description="Only records with seq > after (paging cursor)")
]
Every = Annotated[
    int | None, Query(ge=1, le=1_000_000, description="Keep every N-th record of each series")
]
MaxPoints = Annotated[
    int | None,
    Query(
        ge=1,
        le=100_000,
        description="At most this many evenly spaced records of each series, first and last "
        "included (applied after `every`)",
    ),
]
Limit = Annotated[int, Query(ge=1, le=100_000, description="Page size")]


def _page(job_id: str, series: Series) -> Response:
    head = json.dumps(
        {"job_id": job_id, "count": len(series.data), "next_after": series.next_after}
    )
    body = head[:-1] + ',"data":[' + ",".join(series.data) + "]}"
    return Response(content=body.encode(), media_type="application/json")


@router.get("/{job_id}/metrics", response_model=SeriesPage, responses={**NOT_FOUND})
def get_metrics(
    job_id: JobId,
    service: ServiceDep,
    kind: Annotated[Literal["train", "eval"] | None, Query()] = None,
    split: Annotated[Literal["val", "test"] | None, Query(description="Eval split")] = None,
    after: After = 0,
    every: Every = None,
    max_points: MaxPoints = None,
    limit: Limit = 10_000,
) -> Response:
    """Metric records (train steps and evals). Downsampling applies to each series — train,
    eval/val, eval/test — separately, so evals are never crowded out by steps."""
    series = service.series(job_id, "metrics", after, kind, split, every, max_points, limit)
    return _page(job_id, series)


@router.get("/{job_id}/gsnr", response_model=SeriesPage, responses={**NOT_FOUND})
def get_gsnr(
    job_id: JobId,
    service: ServiceDep,
    after: After = 0,
    every: Every = None,
    max_points: MaxPoints = None,
    limit: Limit = 10_000,
) -> Response:
    """GSNR records: per step, ``dense`` (per tensor: raw_gsnr, ratio, frac_clipped...),
    ``tables`` (per table: touched_rows, multi_group_rows, ratio, frac_clipped...) and
    ``noise_scale`` (the gradient noise scale B_simple, smoothed and raw, with |G|² and S, for
    the whole model, the dense layers, the tables, per tensor and per table)."""
    series = service.series(job_id, "gsnr", after, None, None, every, max_points, limit)
    return _page(job_id, series)


@router.get("/{job_id}/advice", response_model=dict[str, Any], responses={**NOT_FOUND})
def get_advice(
    job_id: JobId,
    service: ServiceDep,
    last: Annotated[
        float,
        Query(gt=0.0, le=1.0, description="Judge on the last fraction of the steps recorded"),
    ] = 0.5,
) -> dict[str, Any]:
    """``dlrm-vrgd advise`` for a train job, finished or still running: B_simple over the
    last part of training (the window's ratio of means, with its 95% interval where the
    records carry one) for the model, its dense layers and its tables, where the job's global
    batch G stands relative to it, and McCandlish et al.'s trade-off at G/4 … 4G (the paper's
    model, not a promise); ``text`` is what the CLI prints. 404 for a job that is not a train
    job."""
    return service.advice(job_id, last)
