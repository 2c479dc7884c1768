"""The persistent store: jobs and their records in one SQLite file, through SQLAlchemy 2.

The schema is created on open. SQLite runs in WAL mode so that readers never wait for the
writer; every write transaction starts with ``BEGIN IMMEDIATE`` so that concurrent writers
queue on the busy timeout instead of failing to upgrade a read lock. State changes are
conditional updates (``WHERE state IN (...)``): of two racing transitions exactly one wins, and
each winning transition appends a ``state`` record in the same transaction.

Methods return detached :class:`Job` snapshots, never live ORM objects, so that callers on any
thread can use them freely.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, delete, event, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.jobs.models import ADDED_JOB_COLUMNS, Base, JobRow, RecordRow, utcnow
from service.jobs.states import QUEUED, can_move

logger = logging.getLogger(__name__)

STREAMS = ("metrics", "gsnr", "state")
#: Most ``seq`` values bound into one ``IN (...)`` query.
_IN_CHUNK = 500


@dataclass(frozen=True)
class Job:
    """A snapshot of one job row."""

    id: str
    name: str
    kind: str
    state: str
    config: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    timeout_s: float | None
    pid: int | None
    pgid: int | None
    proc_start: str | None
    exit_code: int | None
    error: str | None
    progress: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    metrics_offset: int = 0
    gsnr_offset: int = 0
    backend: str | None = None
    slurm_job_id: str | None = None
    metrics_inode: int | None = None
    gsnr_inode: int | None = None
    max_retries: int = 0
    attempt: int = 0
    attempts: list[dict[str, Any]] = field(default_factory=list)
    backend_state: str | None = None
    nodes: str | None = None
    submission_id: str | None = None
    submission_digest: str | None = None
    scheduler: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)

    @classmethod
    def from_row(cls, row: JobRow) -> Job:
        return cls(
            id=row.id,
            name=row.name,
            kind=row.kind,
            state=row.state,
            config=row.config,
            created_at=row.created_at,
            started_at=row.started_at,
            finished_at=row.finished_at,
            timeout_s=row.timeout_s,
            pid=row.pid,
            pgid=row.pgid,
            proc_start=row.proc_start,
            exit_code=row.exit_code,
            error=row.error,
            progress=dict(row.progress or {}),
            result=row.result,
            metrics_offset=row.metrics_offset,
            gsnr_offset=row.gsnr_offset,
            backend=row.backend,
            slurm_job_id=row.slurm_job_id,
            metrics_inode=row.metrics_inode,
            gsnr_inode=row.gsnr_inode,
            max_retries=row.max_retries or 0,
            attempt=row.attempt or 0,
            attempts=[dict(a) for a in row.attempts or []],
            backend_state=row.backend_state,
            nodes=row.nodes,
            submission_id=row.submission_id,
            submission_digest=row.submission_digest,
            scheduler=dict(row.scheduler or {}),
            tags=list(row.tags or []),
        )


@dataclass(frozen=True)
class Series:
    """Selected records of one stream: their JSON texts, in ``seq`` order."""

    data: list[str]
    #: ``seq`` of the last record returned when more records follow it (next page), else None.
    next_after: int | None


def _sqlite_engine(path: Path, immediate: bool, pool_size: int) -> Engine:
    engine = create_engine(
        f"sqlite:///{path}",
        connect_args={"check_same_thread": False, "timeout": 30},
        pool_size=pool_size,
        max_overflow=pool_size * 4,
        pool_timeout=30,
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (below)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def pick_indices(n: int, every: int | None = None, max_points: int | None = None) -> list[int]:
    """Indices kept when downsampling ``n`` points: every ``every``-th (0, every, 2*every...),
    then at most ``max_points`` evenly spaced ones that include the first and the last."""
    idx = list(range(0, n, every)) if every and every > 1 else list(range(n))
    if max_points is not None and len(idx) > max_points:
        m = len(idx)
        if max_points == 1:
            return [idx[-1]]
        chosen = sorted({round(i * (m - 1) / (max_points - 1)) for i in range(max_points)})
        idx = [idx[i] for i in chosen]
    return idx


class Store:
    """Jobs and records in ``path`` (SQLite); thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = _sqlite_engine(self.path, immediate=True, pool_size=2)
        self._reader = _sqlite_engine(self.path, immediate=False, pool_size=8)
        Base.metadata.create_all(self._writer)
        self._add_missing_columns()
        self._write = sessionmaker(self._writer, expire_on_commit=False)
        self._read = sessionmaker(self._reader, expire_on_commit=False)

    def _add_missing_columns(self) -> None:
        """Bring a store written by an older service up to date (new nullable columns)."""
        with self._writer.connect() as conn:
            have = {row[1] for row in conn.exec_driver_sql("PRAGMA table_info(jobs)")}
            for name, sql_type in ADDED_JOB_COLUMNS:
                if name not in have:
                    logger.info("store: adding column jobs.%s", name)
                    conn.exec_driver_sql(f"ALTER TABLE jobs ADD COLUMN {name} {sql_type}")
            # a column added by ALTER TABLE cannot be UNIQUE: an index makes it so
            conn.exec_driver_sql(
                "CREATE UNIQUE INDEX IF NOT EXISTS ix_jobs_submission_id ON jobs (submission_id)"
            )
            conn.commit()

    def close(self) -> None:
        self._writer.dispose()
        self._reader.dispose()

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with self._write() as session, session.begin():
            yield session

    # ----------------------------------------------------------------------------- jobs
    def create_job(
        self,
        job_id: str,
        name: str,
        kind: str,
        config: dict[str, Any],
        timeout_s: float | None,
        progress: dict[str, Any] | None = None,
        **extra: Any,
    ) -> Job:
        """A new queued job; ``extra``: more columns (max_retries, submission_id, scheduler).
        A ``submission_id`` already taken raises :class:`sqlalchemy.exc.IntegrityError`."""
        now = utcnow()
        with self._tx() as s:
            row = JobRow(
                id=job_id,
                name=name,
                kind=kind,
                state=QUEUED,
                config=config,
                created_at=now,
                timeout_s=timeout_s,
                progress=progress or {},
                metrics_offset=0,
                gsnr_offset=0,
                next_seq=1,
                **extra,
            )
            s.add(row)
            s.flush()
            self._add_state_record(s, row, None, now)
            return Job.from_row(row)

    def get_job(self, job_id: str) -> Job | None:
        with self._read() as s:
            row = s.get(JobRow, job_id)
            return Job.from_row(row) if row is not None else None

    def has_jobs(self, job_ids: Iterable[str]) -> set[str]:
        """Those of ``job_ids`` the store holds."""
        wanted, found = list(job_ids), set()
        with self._read() as s:
            for i in range(0, len(wanted), 500):
                rows = s.execute(select(JobRow.id).where(JobRow.id.in_(wanted[i : i + 500])))
                found |= {r[0] for r in rows}
        return found

    def list_jobs(
        self,
        states: Sequence[str] = (),
        kind: str | None = None,
        name_contains: str | None = None,
        limit: int = 100,
        offset: int = 0,
        tags: Sequence[str] = (),
    ) -> tuple[list[Job], int]:
        """Jobs matching the filters (every one of ``tags``), newest first, and how many
        match in all."""
        where = []
        for tag in tags:  # a JSON array holding the tag (SQLite's json_each)
            each = func.json_each(JobRow.tags).table_valued("value")
            where.append(select(each.c.value).where(each.c.value == tag).exists())
        if states:
            where.append(JobRow.state.in_(list(states)))
        if kind:
            where.append(JobRow.kind == kind)
        if name_contains:
            escaped = name_contains.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            where.append(JobRow.name.like(f"%{escaped}%", escape="\\"))
        with self._read() as s:
            count = s.scalar(select(func.count()).select_from(JobRow).where(*where)) or 0
            rows = s.scalars(
                select(JobRow)
                .where(*where)
                .order_by(JobRow.created_at.desc(), JobRow.id.desc())
                .limit(limit)
                .offset(offset)
            ).all()
            return [Job.from_row(r) for r in rows], int(count)

    def by_submission(self, submission_id: str) -> Job | None:
        """The job submitted with this client-chosen id, if any."""
        with self._read() as s:
            row = s.scalars(select(JobRow).where(JobRow.submission_id == submission_id)).first()
            return Job.from_row(row) if row is not None else None

    def jobs_in_state(self, state: str) -> list[Job]:
        """Jobs in ``state``, oldest first (FIFO)."""
        with self._read() as s:
            rows = s.scalars(
                select(JobRow).where(JobRow.state == state).order_by(JobRow.created_at, JobRow.id)
            ).all()
            return [Job.from_row(r) for r in rows]

    def next_queued(self, exclude: Iterable[str] = ()) -> Job | None:
        """The oldest queued job (FIFO)."""
        with self._read() as s:
            row = s.scalars(
                select(JobRow)
                .where(JobRow.state == QUEUED, JobRow.id.not_in(list(exclude)))
                .order_by(JobRow.created_at, JobRow.id)
                .limit(1)
            ).first()
            return Job.from_row(row) if row is not None else None

    def count_by_state(self) -> dict[str, int]:
        with self._read() as s:
            rows = s.execute(select(JobRow.state, func.count()).group_by(JobRow.state)).all()
            return {state: int(n) for state, n in rows}

    def transition(
        self,
        job_id: str,
        from_states: Iterable[str],
        to_state: str,
        message: str | None = None,
        **fields: Any,
    ) -> Job | None:
        """Move the job to ``to_state`` if it is in one of ``from_states``; set ``fields``.

        Returns the new snapshot, or None when the job is missing or in another state.
        """
        allowed = [s for s in from_states if can_move(s, to_state)]
        if not allowed:
            raise ValueError(f"no legal transition from {list(from_states)} to {to_state}")
        with self._tx() as s:
            row = s.get(JobRow, job_id)
            if row is None or row.state not in allowed:
                return None
            row.state = to_state
            for key, value in fields.items():
                setattr(row, key, value)
            self._add_state_record(s, row, message, utcnow())
            return Job.from_row(row)

    def set_if_state(self, job_id: str, states: Iterable[str], **fields: Any) -> Job | None:
        """Set ``fields`` if the job is in one of ``states`` (no state change); None when it
        is missing or in another state."""
        with self._tx() as s:
            row = s.get(JobRow, job_id)
            if row is None or row.state not in set(states):
                return None
            for key, value in fields.items():
                setattr(row, key, value)
            return Job.from_row(row)

    def update_job(self, job_id: str, **fields: Any) -> Job | None:
        with self._tx() as s:
            row = s.get(JobRow, job_id)
            if row is None:
                return None
            for key, value in fields.items():
                setattr(row, key, value)
            return Job.from_row(row)

    def note(self, job_id: str, message: str) -> None:
        """Append a ``state`` record (the job's current state) carrying ``message``."""
        with self._tx() as s:
            row = s.get(JobRow, job_id)
            if row is not None:
                self._add_state_record(s, row, message, utcnow())

    def delete_job(self, job_id: str, states: Iterable[str]) -> bool | None:
        """Delete the job and its records if it is in one of ``states``.

        Returns True when deleted, False when it exists in another state, None when missing.
        """
        with self._tx() as s:
            row = s.get(JobRow, job_id)
            if row is None:
                return None
            if row.state not in set(states):
                return False
            s.execute(delete(RecordRow).where(RecordRow.job_id == job_id))
            s.delete(row)
            return True

    # -------------------------------------------------------------------------- records
    @staticmethod
    def _add_state_record(s: Session, row: JobRow, message: str | None, at: datetime) -> None:
        seq = row.next_seq
        row.next_seq = seq + 1
        data = {"seq": seq, "state": row.state, "at": at.isoformat(), "message": message}
        s.add(RecordRow(job_id=row.id, seq=seq, stream="state", data=json.dumps(data)))

    def ingest(
        self,
        job_id: str,
        metrics: list[dict[str, Any]],
        metrics_offset: int,
        gsnr: list[dict[str, Any]],
        gsnr_offset: int,
        progress: dict[str, Any] | None,
        inodes: tuple[int | None, int | None] | None = None,
    ) -> int:
        """Append tailed records and advance the file offsets, in one transaction (a crash
        neither loses nor duplicates a record). Returns the number of records added."""
        with self._tx() as s:
            row = s.get(JobRow, job_id)
            if row is None:
                return 0
            seq = row.next_seq
            added = []
            for stream, records in (("metrics", metrics), ("gsnr", gsnr)):
                for rec in records:
                    added.append(_record_row(job_id, seq, stream, rec))
                    seq += 1
            s.add_all(added)
            row.next_seq = seq
            row.metrics_offset = metrics_offset
            row.gsnr_offset = gsnr_offset
            if inodes is not None:
                row.metrics_inode, row.gsnr_inode = inodes
            if progress is not None:
                row.progress = progress
            return len(added)

    def reset_stream(self, job_id: str, stream: str) -> None:
        """Forget a stream's records and read its file again from the start (the file was
        rewritten, e.g. truncated by a resumed run)."""
        with self._tx() as s:
            s.execute(
                delete(RecordRow).where(RecordRow.job_id == job_id, RecordRow.stream == stream)
            )
            offset_col = {"metrics": JobRow.metrics_offset, "gsnr": JobRow.gsnr_offset}[stream]
            s.execute(update(JobRow).where(JobRow.id == job_id).values({offset_col: 0}))

    def reconcile_stream(
        self,
        job_id: str,
        stream: str,
        records: list[dict[str, Any]],
        offset: int,
        inode: int | None,
    ) -> tuple[int, int]:
        """The stream's file was rewritten (a resumed run keeps the records up to its
        checkpoint): ``records`` is the whole file now. Stored records equal to the file's,
        in order, are kept (their ``seq`` too); the stored ones after the first difference are
        deleted and the file's from there on are appended. Returns (deleted, added)."""
        offset_col = {"metrics": "metrics_offset", "gsnr": "gsnr_offset"}[stream]
        with self._tx() as s:
            row = s.get(JobRow, job_id)
            if row is None:
                return 0, 0
            stored = s.execute(
                select(RecordRow.seq, RecordRow.data)
                .where(RecordRow.job_id == job_id, RecordRow.stream == stream)
                .order_by(RecordRow.seq)
            ).all()
            same = 0
            for (_, data), rec in zip(stored, records, strict=False):
                old = json.loads(data)
                old.pop("seq", None)
                if old != json.loads(json.dumps(rec)):
                    break
                same += 1
            gone = [int(seq) for seq, _ in stored[same:]]
            for i in range(0, len(gone), _IN_CHUNK):
                s.execute(
                    delete(RecordRow).where(
                        RecordRow.job_id == job_id, RecordRow.seq.in_(gone[i : i + _IN_CHUNK])
                    )
                )
            seq = row.next_seq
            for rec in records[same:]:
                s.add(_record_row(job_id, seq, stream, rec))
                seq += 1
            row.next_seq = seq
            setattr(row, offset_col, offset)
            setattr(row, f"{stream}_inode", inode)
            return len(gone), len(records) - same

    def records_after(self, job_id: str, after: int, limit: int) -> list[tuple[int, str, str]]:
        """``(seq, stream, data)`` of the job's records with ``seq > after``, in order."""
        with self._read() as s:
            rows = s.execute(
                select(RecordRow.seq, RecordRow.stream, RecordRow.data)
                .where(RecordRow.job_id == job_id, RecordRow.seq > after)
                .order_by(RecordRow.seq)
                .limit(limit)
            ).all()
            return [(int(a), str(b), str(c)) for a, b, c in rows]

    def series(
        self,
        job_id: str,
        stream: str,
        after: int = 0,
        kind: str | None = None,
        split: str | None = None,
        every: int | None = None,
        max_points: int | None = None,
        limit: int = 10_000,
    ) -> Series:
        """Records of one stream after ``after``, downsampled per (kind, split) series.

        ``every`` keeps every N-th record of each series, ``max_points`` then keeps at most
        that many evenly spaced ones (first and last included) of each series.
        """
        where = [RecordRow.job_id == job_id, RecordRow.stream == stream, RecordRow.seq > after]
        if kind is not None:
            where.append(RecordRow.kind == kind)
        if split is not None:
            where.append(RecordRow.split == split)
        with self._read() as s:
            if not every and max_points is None:
                rows = s.execute(
                    select(RecordRow.seq, RecordRow.data)
                    .where(*where)
                    .order_by(RecordRow.seq)
                    .limit(limit + 1)
                ).all()
                more = len(rows) > limit
                rows = rows[:limit]
                return Series(
                    [str(d) for _, d in rows], int(rows[-1][0]) if more and rows else None
                )
            keys = s.execute(
                select(RecordRow.seq, RecordRow.kind, RecordRow.split)
                .where(*where)
                .order_by(RecordRow.seq)
            ).all()
            groups: dict[tuple[str | None, str | None], list[int]] = {}
            for seq, k, sp in keys:
                groups.setdefault((k, sp), []).append(int(seq))
            chosen: list[int] = []
            for seqs in groups.values():
                chosen.extend(seqs[i] for i in pick_indices(len(seqs), every, max_points))
            chosen.sort()
            more = len(chosen) > limit
            chosen = chosen[:limit]
            data: dict[int, str] = {}
            for i in range(0, len(chosen), _IN_CHUNK):
                part = chosen[i : i + _IN_CHUNK]
                for seq, d in s.execute(
                    select(RecordRow.seq, RecordRow.data).where(
                        RecordRow.job_id == job_id, RecordRow.seq.in_(part)
                    )
                ):
                    data[int(seq)] = str(d)
            return Series([data[q] for q in chosen], chosen[-1] if more and chosen else None)


def _record_row(job_id: str, seq: int, stream: str, rec: dict[str, Any]) -> RecordRow:
    step = rec.get("step")
    return RecordRow(
        job_id=job_id,
        seq=seq,
        stream=stream,
        kind=_short(rec.get("kind")) if stream == "metrics" else None,
        split=_short(rec.get("split")) if stream == "metrics" else None,
        step=step if isinstance(step, int) else None,
        data=json.dumps({"seq": seq, **rec}, allow_nan=False),
    )


def _short(value: Any) -> str | None:
    return value[:16] if isinstance(value, str) else None
