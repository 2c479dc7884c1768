"""SQLAlchemy 2 tables of the store: one row per job, one row per record of a job's series.

``records`` holds every time-ordered thing a job produces, numbered per job by ``seq``
(1, 2, ...): metric records and GSNR records tailed from the run directory, and the job's state
changes. One sequence gives the event stream a single resumable cursor (``Last-Event-ID``).
``data`` is the record as JSON text, ``seq`` included, so that series are served without
re-encoding.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on SQLite (which stores naive ones)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class JobRow(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32), default="train")
    state: Mapped[str] = mapped_column(String(16), index=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    timeout_s: Mapped[float | None] = mapped_column(Float, default=None)
    #: Process of the job (the leader of its process group) and its start time in clock ticks
    #: since boot (/proc/PID/stat field 22), which tells a live job from a reused pid.
    pid: Mapped[int | None] = mapped_column(Integer, default=None)
    pgid: Mapped[int | None] = mapped_column(Integer, default=None)
    proc_start: Mapped[str | None] = mapped_column(String(32), default=None)
    #: The backend that launched it ("local", "slurm"; None = local, before backends) and,
    #: for Slurm, its Slurm job id (set once sbatch accepted it).
    backend: Mapped[str | None] = mapped_column(String(16), default=None)
    slurm_job_id: Mapped[str | None] = mapped_column(String(32), default=None)
    #: Exit status of the process; negative = killed by that signal (subprocess convention).
    exit_code: Mapped[int | None] = mapped_column(Integer, default=None)
    #: Why a job failed (exit status and last log lines) or how it ended when not plain.
    error: Mapped[str | None] = mapped_column(Text, default=None)
    progress: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    #: The run's result.json, copied in when the job succeeds.
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    #: Byte offsets already ingested from metrics.jsonl / gsnr.jsonl.
    metrics_offset: Mapped[int] = mapped_column(Integer, default=0)
    gsnr_offset: Mapped[int] = mapped_column(Integer, default=0)
    next_seq: Mapped[int] = mapped_column(Integer, default=1)
    #: Inodes of metrics.jsonl / gsnr.jsonl when last read: a resumed run rewrites them (an
    #: atomic replace), which the runner reconciles record by record.
    metrics_inode: Mapped[int | None] = mapped_column(Integer, default=None)
    gsnr_inode: Mapped[int | None] = mapped_column(Integer, default=None)
    #: Retries after an infrastructure failure (node lost, rank killed by a signal...).
    max_retries: Mapped[int | None] = mapped_column(Integer, default=None)
    #: The attempt running or last run (1 = the first; 0 = not started yet) and one record per
    #: attempt: {attempt, started_at, ended_at, ended, resumed_from_step, backend_id, nodes}.
    attempt: Mapped[int | None] = mapped_column(Integer, default=None)
    attempts: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, default=None)
    #: What the backend says of the job now ("queued: Resources", "running on n[1-2]",
    #: "requeued after NODE_FAIL on n2") and the nodes it runs on.
    backend_state: Mapped[str | None] = mapped_column(Text, default=None)
    nodes: Mapped[str | None] = mapped_column(String(200), default=None)
    #: A client-chosen id: a retried POST with the same id returns this job (unique).
    submission_id: Mapped[str | None] = mapped_column(String(128), default=None, unique=True)
    #: SHA-256 of the validated request that used ``submission_id`` (its id left out): a later
    #: request under the id with another body is refused (409).
    submission_digest: Mapped[str | None] = mapped_column(String(64), default=None)
    #: Per-job scheduler options (partition, account, ... see service/jobs/options.py).
    scheduler: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    #: Labels that group jobs (``GET /jobs?tag=``), e.g. an experiment's name.
    tags: Mapped[list[str] | None] = mapped_column(JSON, default=None)


#: Columns added after the first release: (name, SQL type), added to an older store on open.
ADDED_JOB_COLUMNS = (
    ("backend", "VARCHAR(16)"),
    ("slurm_job_id", "VARCHAR(32)"),
    ("metrics_inode", "INTEGER"),
    ("gsnr_inode", "INTEGER"),
    ("max_retries", "INTEGER"),
    ("attempt", "INTEGER"),
    ("attempts", "JSON"),
    ("backend_state", "TEXT"),
    ("nodes", "VARCHAR(200)"),
    ("submission_id", "VARCHAR(128)"),
    ("submission_digest", "VARCHAR(64)"),
    ("scheduler", "JSON"),
    ("tags", "JSON"),
)


class RecordRow(Base):
    __tablename__ = "records"

    job_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    #: "metrics", "gsnr" or "state".
    stream: Mapped[str] = mapped_column(String(8))
    #: For metrics: "train" or "eval" (and the eval's split).
    kind: Mapped[str | None] = mapped_column(String(16), default=None)
    split: Mapped[str | None] = mapped_column(String(16), default=None)
    step: Mapped[int | None] = mapped_column(Integer, default=None)
    data: Mapped[str] = mapped_column(Text)

    __table_args__ = (Index("ix_records_job_stream_seq", "job_id", "stream", "seq"),)
