"""Request and response schemas of the REST API (``/api/v1``).

Requests: :class:`JobCreate` (a name and a :class:`~dlrm_vrgd.config.TrainConfig`, validated
by the very model the CLI uses, so a bad field answers 422 naming it). Responses:
:class:`JobPublic`, :class:`JobsPublic` (``data`` + ``count``), series pages, artifacts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StringConstraints,
    Tag,
)

from dlrm_vrgd.config import MAX_NAME_BYTES, MAX_PATH_CHARS, TrainConfig
from dlrm_vrgd.redact import redact, redact_obj
from dlrm_vrgd.study.config import StudyConfig
from service.errors import InvalidInput
from service.jobs.options import SlurmOptions
from service.jobs.states import JobKind, JobState
from service.jobs.store import Job

#: Longest job timeout accepted (30 days).
MAX_TIMEOUT_S = 30 * 86400.0

JobName = Annotated[
    str,
    StringConstraints(
        strip_whitespace=True, min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$"
    ),
    Field(strict=True),
]
#: A job's wall-clock limit: a finite number of seconds (not a bool, not a string).
Timeout = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S, strict=True, allow_inf_nan=False)]


def _check_input_name(name: str) -> str:
    for part in name.split("/"):
        if len(os.fsencode(part)) > MAX_NAME_BYTES:
            raise ValueError(f"a component is longer than {MAX_NAME_BYTES} bytes")
    return name


#: A path relative to the data root: no control character (NUL included), no component the
#: file system could not name.
InputName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_PATH_CHARS, pattern=r"^[^\x00-\x1f\x7f]+$"),
    Field(strict=True),
    AfterValidator(_check_input_name),
]


#: Most retries a job may ask for.
MAX_RETRIES = 100
#: A client-chosen id that makes a submission idempotent (Ray's ``submission_id``).
SubmissionId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")]
#: A label that groups jobs (``GET /jobs?tag=``): letters, digits and ``_ . : -``.
JobTag = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
MAX_TAGS = 20


class JobSubmission(BaseModel):
    """What every kind of job takes besides its config: retries, an idempotency id and
    scheduler options."""

    model_config = ConfigDict(extra="forbid")

    #: Retries after an infrastructure failure (node lost, rank killed by a signal,
    #: collective timeout); default: the service's DLRM_VRGD_MAX_RETRIES for train and
    #: study jobs, 0 for score jobs. Config errors and a NaN loss are never retried.
    max_retries: Annotated[int, Field(ge=0, le=MAX_RETRIES, strict=True)] | None = None
    #: A retried POST with the same id returns the job the first one made.
    submission_id: SubmissionId | None = None
    #: Slurm options of this job (the Slurm backend only).
    slurm: SlurmOptions | None = None
    #: Labels that group jobs (an experiment, a sweep): ``GET /jobs?tag=`` keeps them.
    tags: list[JobTag] = Field(default_factory=list, max_length=MAX_TAGS)


class TrainJobCreate(JobSubmission):
    """A training job: ``config`` is a full TrainConfig (unknown keys are errors, missing ones
    take the trainer's defaults)."""

    model_config = ConfigDict(extra="forbid")

    name: JobName
    kind: Literal["train"] = "train"
    config: TrainConfig
    #: Wall-clock limit in seconds (the service default when omitted).
    timeout_s: Timeout | None = None


def _finite(value: Any, where: tuple[str | int, ...] = ("config",)) -> Any:
    """``value`` as sent, after looking at every number in it: a NaN or an infinity is
    :class:`InvalidInput` (422) naming its field (``config.base.run.global_batch``,
    ``config.optimizers.0.dense.lr``), before the study's own checks, which would see it only
    in a cell's config, or not at all where a cell overrides the field."""
    if isinstance(value, float) and not math.isfinite(value):
        field = ".".join(map(str, where))
        raise InvalidInput(
            field, f"{value!r} is not a finite number (NaN and Infinity are refused)",
            ("body", *where),
        )  # fmt: skip
    if isinstance(value, dict):
        for k, v in value.items():
            _finite(v, (*where, str(k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _finite(v, (*where, i))
    return value


class StudyJobCreate(JobSubmission):
    """A batch-size study (``dlrm-vrgd study``): ``config`` is a StudyConfig — a grid of
    batch sizes x optimizers x learning rates x seeds over a base TrainConfig."""

    model_config = ConfigDict(extra="forbid")

    name: JobName
    kind: Literal["study"]
    #: (a non-finite number anywhere in it is refused naming its field, see ``_finite``)
    config: Annotated[StudyConfig, BeforeValidator(_finite)]
    timeout_s: Timeout | None = None


class ScoreConfig(BaseModel):
    """What a ``score`` job scores: the model of a succeeded train job (its ``model``
    artifact, ``dlrm-vrgd export``) on files under the service's data root
    (``DLRM_VRGD_DATA_ROOT``, default ``DATA_DIR/data``), as ``dlrm-vrgd score`` does."""

    model_config = ConfigDict(extra="forbid")

    #: Id of a succeeded train job.
    model_job: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{1,64}$"), Field(strict=True)]
    #: Paths relative to the data root: raw Criteo files (TSV/CSV, gzip), directories of them,
    #: or preprocessed directories.
    inputs: list[InputName] = Field(min_length=1, max_length=1000)
    output_format: Literal["csv", "parquet"] = "csv"
    labels: Literal["auto", "yes", "no"] = "auto"
    skip_bad_rows: StrictBool = False


class ScoreJobCreate(JobSubmission):
    """Batch scoring (``dlrm-vrgd score``) with a train job's model."""

    model_config = ConfigDict(extra="forbid")

    name: JobName
    kind: Literal["score"]
    config: ScoreConfig
    timeout_s: Timeout | None = None


def _job_kind(value: Any) -> str:
    kind = value.get("kind", "train") if isinstance(value, dict) else getattr(value, "kind", None)
    return kind if kind in ("train", "study", "score") else "train"


#: A job to run, by ``kind`` (default "train"); the tag never appears in error locations.
JobCreate = Annotated[
    Annotated[TrainJobCreate, Tag("train")]
    | Annotated[StudyJobCreate, Tag("study")]
    | Annotated[ScoreJobCreate, Tag("score")],
    Discriminator(_job_kind),
]


class JobProgress(BaseModel):
    """What the job has done so far, from its metrics and GSNR records."""

    model_config = ConfigDict(extra="allow")

    step: int | None = None
    total_steps: int | None = None
    fraction: float | None = None
    samples: int | None = None
    epoch: float | None = None
    loss: float | None = None
    lr_dense: float | None = None
    lr_sparse: float | None = None
    rows_per_s: float | None = None
    #: Dense layers: element-weighted mean GSNR ratio and fraction clipped at gamma.
    gsnr_ratio: float | None = None
    gsnr_frac_clipped: float | None = None
    #: Embedding tables: mean of the per-table ratios and fractions clipped.
    table_gsnr_ratio: float | None = None
    table_frac_clipped: float | None = None
    val_auc: float | None = None
    val_logloss: float | None = None
    val_oracle_auc: float | None = None
    best_val_auc: float | None = None
    best_val_step: int | None = None
    test_auc: float | None = None
    test_logloss: float | None = None
    test_oracle_auc: float | None = None
    eval_step: int | None = None
    updated_at: datetime | None = None


class AttemptPublic(BaseModel):
    """One attempt of a job (a retry after an infrastructure failure is the next one)."""

    model_config = ConfigDict(extra="allow")

    attempt: int
    started_at: datetime | None = None
    ended_at: datetime | None = None
    #: Why it ended (``NODE_FAIL on n2``, ``killed by SIGKILL``); null while it runs.
    ended: str | None = None
    exit_code: int | None = None
    #: The checkpoint step it resumed from (0: from the start; null: not a train job or
    #: the first attempt).
    resumed_from_step: int | None = None
    #: The pid (local) or Slurm job id of the attempt.
    backend_id: str | None = None
    nodes: str | None = None


class JobPublic(BaseModel):
    id: str
    name: str
    kind: JobKind
    state: JobState
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    timeout_s: float | None
    #: Leader of the job's process group while it runs (and after, for the record).
    pid: int | None
    #: Exit status of a finished job (negative: killed by that signal); null while it runs,
    #: for a job that never started, and where it cannot be known (a job re-attached after a
    #: restart whose supervisor was SIGKILLed): the dashboard says "exit unknown" then.
    exit_code: int | None
    #: Why the job failed: exit status and the last log lines.
    error: str | None
    #: What ran it: "local" or "slurm" (null while queued and not handed over).
    backend: str | None = None
    #: The Slurm job id (``squeue -j``, ``scancel``), once Slurm accepted the job.
    slurm_job_id: str | None = None
    progress: JobProgress
    has_result: bool
    #: The resolved config (defaults filled in).
    config: dict[str, Any]
    #: What the backend says now: ``queued: Resources``, ``held: PartitionNodeLimit``,
    #: ``running on n[1-2]``, ``requeued after NODE_FAIL on n2; queued: Resources``,
    #: ``ended: COMPLETED``.
    backend_state: str | None = None
    #: The nodes of the current (or last) attempt, as Slurm writes them (``n[1-2]``).
    nodes: str | None = None
    #: The attempt running or last run (1 = the first; 0 = not started).
    attempt: int = 0
    max_retries: int = 0
    #: One record per attempt: why it ended, from which step it resumed.
    attempts: list[AttemptPublic] = []
    submission_id: str | None = None
    #: The job's own Slurm options (the service's defaults apply to the rest).
    slurm: dict[str, Any] | None = None
    #: The job's tags.
    tags: list[str] = []

    @classmethod
    def from_job(cls, job: Job, show: Callable[[str], str] = redact) -> JobPublic:
        """The job as the API shows it: ``show`` (secrets masked, paths relative) on its
        error, secrets masked in its config and progress."""
        return cls(
            id=job.id,
            name=job.name,
            kind=job.kind,  # type: ignore[arg-type]
            state=job.state,  # type: ignore[arg-type]
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            timeout_s=job.timeout_s,
            pid=job.pid,
            exit_code=job.exit_code,
            error=None if job.error is None else show(job.error),
            backend=job.backend or ("local" if job.pid is not None else None),
            slurm_job_id=job.slurm_job_id,
            progress=JobProgress.model_validate(redact_obj(job.progress)),
            has_result=job.result is not None,
            config=redact_obj(job.config),
            backend_state=None if job.backend_state is None else show(job.backend_state),
            nodes=job.nodes,
            attempt=job.attempt,
            max_retries=job.max_retries,
            attempts=[AttemptPublic.model_validate(redact_obj(a)) for a in job.attempts],
            submission_id=job.submission_id,
            slurm=job.scheduler or None,
            tags=job.tags,
        )


class JobsPublic(BaseModel):
    data: list[JobPublic]
    #: Jobs matching the filters in all (``data`` is one page of them).
    count: int


class SeriesPage(BaseModel):
    """Records of a job's metrics or GSNR series, in ``seq`` order.

    Metric records are the trainer's ``metrics.jsonl`` lines (``kind`` "train": step, samples,
    loss, lr_dense, lr_sparse, rows_per_s, gsnr_ratio...; ``kind`` "eval": split, auc, logloss,
    ne, calibration, oracle_auc...). GSNR records are ``gsnr.jsonl`` lines (step, ``dense``
    per tensor, ``tables`` per table). Each has ``seq``, its place in the job's record sequence.
    """

    job_id: str
    count: int
    #: Pass as ``after`` to get the next page; null on the last page.
    next_after: int | None
    data: list[dict[str, Any]]


class ArtifactPublic(BaseModel):
    #: Path relative to the run directory, e.g. ``checkpoints/step_00000004/rank0.pt``.
    path: str
    bytes: int
    modified_at: datetime


class ArtifactsPublic(BaseModel):
    data: list[ArtifactPublic]
    count: int


class HealthPublic(BaseModel):
    status: Literal["ok"]
    version: str


class Message(BaseModel):
    detail: str


class ValidationIssue(BaseModel):
    loc: list[str | int]
    #: Dotted name of the offending field, e.g. ``config.optim.dense.lr``.
    field: str
    msg: str
    type: str


class ValidationMessage(BaseModel):
    detail: list[ValidationIssue]
