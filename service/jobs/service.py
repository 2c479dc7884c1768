"""The job layer the routes call: submit, look up, cancel, delete, series, files, events.

Blocking methods (store and file access) are plain functions that FastAPI runs in its thread
pool; methods that touch the runner or the notifier are coroutines on the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DBAPIError, IntegrityError

from dlrm_vrgd.advice import advise_records, noise_records
from dlrm_vrgd.config import CriteoData, TrainConfig
from dlrm_vrgd.redact import redact
from dlrm_vrgd.resources import ResourceError, check_fits, check_study_fits
from dlrm_vrgd.study.config import StudyConfig
from service.errors import (
    ArtifactDamaged,
    ArtifactNotFound,
    IllegalTransition,
    InvalidInput,
    JobNotFound,
    ResultNotFound,
    StorageError,
    SubmissionConflict,
    Unavailable,
)
from service.jobs import files as jobfiles
from service.jobs import logs as joblogs
from service.jobs import reading
from service.jobs.gpus import gpu_request
from service.jobs.ingest import MAX_READ_BYTES
from service.jobs.kinds import KINDS
from service.jobs.notifier import Notifier
from service.jobs.runner import Runner
from service.jobs.states import QUEUED, RESUBMITTABLE, SUCCEEDED, TERMINAL
from service.jobs.store import Job, Series, Store
from service.jobs.supervise import EXIT_FILE
from service.jobs.tracking import check_mlflow, withheld_note
from service.schemas import JobCreate, JobPublic, ScoreConfig
from service.settings import Settings
from service.shown import shown, shown_obj

logger = logging.getLogger(__name__)

#: Records per database read of an event stream.
EVENT_PAGE = 500
#: An idle event stream re-reads the store this often even without a wake-up.
EVENT_RECHECK_S = 5.0
#: A followed log is looked at this often for new bytes.
LOG_FOLLOW_S = 0.25


#: A job directory's name (:func:`new_job_id`).
_JOB_ID = re.compile(r"[0-9a-f]{16}")


def new_job_id() -> str:
    return uuid.uuid4().hex[:16]


class JobService:
    def __init__(
        self, settings: Settings, store: Store, runner: Runner, notifier: Notifier
    ) -> None:
        self.settings = settings
        self.store = store
        self.runner = runner
        self.notifier = notifier
        #: Set by the server: True once it is shutting down (event streams end).
        self.should_exit: Callable[[], bool] = lambda: False
        for left in (*settings.jobs_dir.glob(".new-*"), *settings.jobs_dir.glob(".deleted-*")):
            shutil.rmtree(left, ignore_errors=True)  # a submission or deletion cut short
        self._remove_orphans()

    def _remove_orphans(self) -> None:
        """Job directories no stored job owns, left by a service killed between writing a
        new job's directory and its row: removed when they hold only what a submission
        writes (``config.yaml``); any other one is kept and named in the log (nothing a job
        wrote is removed without its job)."""
        root = self.settings.jobs_dir
        try:
            named = [e for e in os.scandir(root) if _JOB_ID.fullmatch(e.name)]
        except OSError:
            return
        known = self.store.has_jobs(e.name for e in named)
        for entry in named:
            if entry.name in known or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                held = set(os.listdir(entry.path))
            except OSError:
                continue
            if held <= {jobfiles.CONFIG}:
                logger.warning("removing %s: a submission cut short (no job owns it)", entry.name)
                jobfiles.remove_tree(Path(entry.path))
            else:
                logger.warning(
                    "jobs/%s belongs to no stored job and holds files; left in place", entry.name
                )

    def files(self, job_id: str) -> jobfiles.JobFiles:
        return self.runner.files(job_id)

    def show(self, text: str) -> str:
        """``text`` as the API may show it: secrets masked, the service's paths relative."""
        return shown(text, self.settings)

    def public(self, job: Job) -> JobPublic:
        return JobPublic.from_job(job, self.show)

    # ----------------------------------------------------------------------------- jobs
    def submit_once(self, body: JobCreate) -> tuple[Job, bool]:
        """Submit, or, for a ``submission_id`` already used with the same body, the job it
        made: (job, created). The id used with another body: :class:`SubmissionConflict`."""
        if body.submission_id is not None:
            first = self.store.by_submission(body.submission_id)
            if first is not None:
                return _same_submission(first, body), False
        try:
            return self.submit(body), True
        except _SubmittedMeanwhile as race:
            return _same_submission(race.job, body), False

    def submit(self, body: JobCreate) -> Job:
        """Store a new queued job (its config written to its directory) and wake the runner.

        A job that cannot fit a node's memory is refused (422 naming the fields that drive the
        estimate, see :mod:`dlrm_vrgd.resources`), as is a Criteo path the host cannot open."""
        if isinstance(body.config, StudyConfig):
            study = body.config
            base = study.cell_config(study.cells()[0]).run.mlflow
            check_mlflow(base, self.settings, "config.base.run.mlflow")
            self._check_memory(body.config, ("body", "config"))
            return self._create(body, body.config.model_dump(mode="json"))
        if isinstance(body.config, ScoreConfig):
            return self._create(body, self._resolve_score(body.config))
        config = body.config
        check_mlflow(config.run.mlflow, self.settings, "config.run.mlflow")
        if isinstance(config.data, CriteoData):
            path = config.data.path.expanduser()
            if not path.is_absolute():
                path = Path.cwd() / path
            where = ("body", "config", "data", "path")
            try:
                is_dir = path.is_dir()
            except OSError as err:  # a name too long, a permission, a loop of links
                raise InvalidInput(
                    "config.data.path", f"cannot open on the service host: {err.strerror}", where
                ) from None
            if not is_dir:
                raise InvalidInput(
                    "config.data.path", f"no such directory on the service host: {path}", where
                )
            data = config.data.model_copy(update={"path": path})
            config = config.model_copy(update={"data": data})
        self._check_memory(config, ("body", "config"))
        return self._create(body, config.to_dict())

    def _resolve_score(self, config: ScoreConfig) -> dict[str, Any]:
        """A score job's config with the model directory and input paths made absolute; 422
        naming the field for a model job without a model or an input outside the data root."""
        job = self.store.get_job(config.model_job)
        loc = ("body", "config", "model_job")
        if job is None or job.kind != "train":
            raise InvalidInput("config.model_job", f"no train job {config.model_job}", loc)
        model_dir = self.files(job.id).model_dir
        if job.state != SUCCEEDED or not (model_dir / "manifest.json").is_file():
            raise InvalidInput(
                "config.model_job",
                f"job {job.id} is {job.state} and has no model (only a succeeded train job has)",
                loc,
            )
        root = self.settings.inputs_root.resolve()
        paths: list[str] = []
        seen: list[tuple[Path, int]] = []
        for i, name in enumerate(config.inputs):
            field, iloc = f"config.inputs.{i}", ("body", "config", "inputs", i)
            parts = name.split("/")
            if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise InvalidInput(field, f"{name!r}: a path relative to the data root", iloc)
            try:
                path = (root / name).resolve()
                found = path.is_relative_to(root) and path.exists()
            except (OSError, ValueError, RuntimeError):  # a name the OS cannot look up
                found = False
            if not found:
                raise InvalidInput(field, f"{name!r}: not found under the data root", iloc)
            for other, j in seen:  # each row is scored once: no file given twice
                if path == other or path.is_relative_to(other) or other.is_relative_to(path):
                    raise InvalidInput(
                        field,
                        f"{name!r}: the same file(s) as config.inputs.{j}; every input row is "
                        "scored once",
                        iloc,
                    )
            seen.append((path, i))
            paths.append(str(root / name))  # resolved again, and confined, when the job runs
        return {**config.model_dump(mode="json"), "model_dir": str(model_dir),
                "input_paths": paths, "input_root": str(root)}  # fmt: skip

    def _check_memory(self, config: TrainConfig | StudyConfig, loc: tuple[str, ...]) -> None:
        limit = self.settings.job_memory_bytes
        try:
            if isinstance(config, StudyConfig):
                check_study_fits(config, limit)
            else:
                check_fits(config, limit)
        except ResourceError as err:
            first, *rest = [f"config.{f}" for f in err.fields]
            raise InvalidInput(
                first, str(err), (*loc, *first.split(".")[1:]), also=tuple(rest)
            ) from None

    def _scheduler_options(self, body: JobCreate, resolved: dict[str, Any]) -> dict[str, Any]:
        """The job's own scheduler options, checked against what the backend has (``sinfo``):
        422 naming the field for one no node or partition can satisfy."""
        backend = self.runner.backend
        options = body.slurm.model_dump(exclude_none=True) if body.slurm is not None else {}
        if options.get("extra_flags") == []:
            del options["extra_flags"]
        if options and backend.name != "slurm":
            raise InvalidInput(
                "slurm",
                f"Slurm options, but this service runs jobs with the {backend.name} backend "
                "(DLRM_VRGD_BACKEND)",
                ("body", "slurm"),
            )
        problem = backend.check_request(body.kind, resolved, options)
        if problem is not None:
            field, message = problem
            raise InvalidInput(field, message, ("body", *field.split(".")))
        return options

    def _create(self, body: JobCreate, resolved: dict[str, Any]) -> Job:
        problem = self.runner.backend.available()
        if problem is not None:
            raise Unavailable(f"cannot take jobs now: {problem}")
        scheduler = self._scheduler_options(body, resolved)
        max_retries = body.max_retries
        if max_retries is None:
            max_retries = 0 if body.kind == "score" else self.settings.max_retries
        need, field = gpu_request(resolved)
        if not self.runner.queues_jobs and need > self.runner.gpus.capacity:
            have = ",".join(self.runner.gpus.devices) or "none"
            raise InvalidInput(
                field,
                f"the job asks for {need} GPU(s) (run.device cuda) but this host has "
                f"{self.runner.gpus.capacity} for jobs ({have}; see DLRM_VRGD_GPUS)",
                ("body", *field.split(".")),
            )
        job_id = new_job_id()
        files = self.files(job_id)
        progress = KINDS[body.kind].initial_progress(resolved)
        # All or nothing: the directory is assembled under a hidden name and renamed into
        # place whole; the row is written last, and the directory goes if the row fails.
        staging = files.root.with_name(f".new-{job_id}")
        try:
            jobfiles.write_config(staging / files.config.name, resolved)
            os.replace(staging, files.root)
        except OSError as err:
            shutil.rmtree(staging, ignore_errors=True)
            raise StorageError.from_os_error("the job's config", err) from None
        try:
            job = self.store.create_job(
                job_id,
                body.name,
                body.kind,
                resolved,
                body.timeout_s,
                progress=progress,
                max_retries=max_retries,
                submission_id=body.submission_id,
                submission_digest=submission_digest(body) if body.submission_id else None,
                scheduler=scheduler or None,
                tags=list(body.tags) or None,
            )
        except BaseException as err:
            shutil.rmtree(files.root, ignore_errors=True)
            if isinstance(err, IntegrityError) and body.submission_id is not None:
                first = self.store.by_submission(body.submission_id)
                if first is not None:  # the same submission, posted twice at once
                    raise _SubmittedMeanwhile(first) from None
            if isinstance(err, OSError):
                raise StorageError.from_os_error("the job", err) from None
            if isinstance(err, DBAPIError):  # SQLite: "database or disk is full", ...
                raise StorageError(
                    f"cannot store the job in the service's database: {err.orig}; nothing was kept"
                ) from None
            raise
        withheld = withheld_note(body.kind, resolved, self.settings)
        if withheld is not None:
            logger.warning("job %s: %s", job.id, withheld)
            self.store.note(job.id, withheld)
        self.runner.wake()
        return job

    def get(self, job_id: str) -> Job:
        job = self.store.get_job(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def list_jobs(
        self,
        states: Sequence[str],
        kind: str | None,
        name: str | None,
        limit: int,
        offset: int,
        tags: Sequence[str] = (),
    ) -> tuple[list[Job], int]:
        return self.store.list_jobs(states, kind, name, limit, offset, tags)

    async def cancel(self, job_id: str) -> Job:
        job = await self.runner.cancel(job_id)
        self.notifier.notify(job_id)
        return job

    def resubmit(self, job_id: str) -> Job:
        """Queue a failed or cancelled train or study job again: its next attempt resumes its
        run from the newest checkpoint (409 for any other state or kind)."""
        job = self.get(job_id)
        if job.kind == "score":
            raise IllegalTransition(f"job {job_id} is a score job: submit it again instead")
        if job.state not in RESUBMITTABLE:
            raise IllegalTransition(
                f"job {job_id} is {job.state}: only a failed or cancelled job is resubmitted"
            )
        (self.files(job_id).root / EXIT_FILE).unlink(missing_ok=True)  # the last attempt's
        moved = self.store.transition(
            job_id, RESUBMITTABLE, QUEUED, "resubmitted: the next attempt resumes the run",
            finished_at=None, exit_code=None, error=None, pid=None, pgid=None, proc_start=None,
            backend_state="queued: resubmitted",
        )  # fmt: skip
        if moved is None:  # changed meanwhile (deleted, or resubmitted by another request)
            raise IllegalTransition(f"job {job_id} changed while being resubmitted")
        self.runner.wake()
        self.notifier.notify(job_id)
        return moved

    def delete(self, job_id: str) -> None:
        """Forget a finished job and remove its files; 409 while it is queued or running."""
        job = self.get(job_id)
        deleted = self.store.delete_job(job_id, TERMINAL)
        if deleted is None:
            raise JobNotFound(job_id)
        if not deleted:
            raise IllegalTransition(f"job {job_id} is {job.state}: cancel it before deleting it")
        jobfiles.remove_tree(self.files(job_id).root)
        self.runner.wake()

    # --------------------------------------------------------------------------- series
    def series(
        self,
        job_id: str,
        stream: str,
        after: int,
        kind: str | None = None,
        split: str | None = None,
        every: int | None = None,
        max_points: int | None = None,
        limit: int = 10_000,
    ) -> Series:
        self.get(job_id)
        return self.store.series(job_id, stream, after, kind, split, every, max_points, limit)

    def advice(self, job_id: str, last: float) -> dict[str, Any]:
        """``dlrm-vrgd advise`` of a train job's run directory, finished or running (its
        gsnr.jsonl as it stands; no records yet: the advice says so)."""
        job = self.get(job_id)
        if job.kind != "train":
            raise ArtifactNotFound(f"job {job_id} is a {job.kind} job: advice is per train run")
        return self._read(_advice, self.files(job_id), last)

    def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a read of a job's files, off the request thread and bounded in time
        (:func:`service.jobs.reading.bounded`)."""
        return reading.bounded(self.settings.file_read_timeout_s, fn, *args)

    # ---------------------------------------------------------------------------- files
    def result(self, job_id: str) -> dict[str, Any]:
        """The run's result.json (stored copy, else the file); 404 while there is none."""
        job = self.get(job_id)
        result = job.result
        if result is None:
            result = self._read(jobfiles.read_result, self.files(job_id), True)
        if result is None:
            raise ResultNotFound(f"job {job_id} has no result ({job.state})")
        return shown_obj(result)

    def log_tail(self, job_id: str, lines: int, task: int | None = None) -> list[str]:
        """The log's last lines, as the API shows text (secrets masked, paths relative)."""
        self.get(job_id)  # 404 for an unknown id
        files = self.files(job_id)
        if task is None:
            found = self._read(jobfiles.tail_lines, files.log, lines, files.root)
            return [self.show(ln) for ln in found]
        found = self._read(jobfiles.tail_lines, files.log, 1_000_000, files.root)
        return [self.show(ln) for ln in joblogs.task_lines(found, task)[-lines:]]

    def log_from(self, job_id: str, offset: int, task: int | None = None) -> tuple[bytes, int]:
        """The log's whole lines from ``offset`` (one srun task's with ``task``; a running job's
        last line once it is whole) and the offset to ask from next. The offsets are those of
        ``train.log``; the text is shown as the API shows text (secrets masked, the service's
        paths relative), so it may be shorter than the bytes between them."""
        job = self.get(job_id)
        files = self.files(job_id)
        data, end = self._read(joblogs.read_from, files.log, offset, joblogs.MAX_CHUNK, files.root)
        if job.state not in TERMINAL and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1  # a path cut in two would not be recognised
            data, end = data[:cut], end - (len(data) - cut)
        return self._shown_bytes(joblogs.TaskFilter(task).feed(data, final=True)), end

    async def log_follow(
        self, job_id: str, offset: int | None, task: int | None = None
    ) -> AsyncIterator[bytes]:
        """The log's new bytes as they come, from ``offset`` (default: its end now), until
        the job has finished and all of its log was sent (or the server stops)."""
        await asyncio.to_thread(self.get, job_id)  # 404 for an unknown id
        files = self.files(job_id)
        path, limit = files.log, self.settings.file_read_timeout_s

        async def read(at: int) -> tuple[bytes, int]:
            return await reading.bounded_async(
                limit, joblogs.read_from, path, at, joblogs.MAX_CHUNK, files.root
            )

        if offset is None:
            got = await reading.bounded_async(limit, reading.read_range, path, 0, 0, files.root)
            offset = got[1] if got is not None else 0
        lines = joblogs.TaskFilter(task)
        partial = b""  # a line not yet whole waits for its end (rank or not)
        while not self.should_exit():
            data, offset = await read(offset)
            if data:
                data, partial = partial + data, b""
                cut = data.rfind(b"\n") + 1
                data, partial = data[:cut], data[cut:]
                out = lines.feed(data)
                if out:
                    yield self._shown_bytes(out)
                continue
            current = await asyncio.to_thread(self.store.get_job, job_id)
            if current is None or current.state in TERMINAL:
                data, offset = await read(offset)
                out = lines.feed(partial + data, final=True)
                if out:
                    yield self._shown_bytes(out)
                return
            await asyncio.sleep(LOG_FOLLOW_S)

    def _shown_bytes(self, data: bytes) -> bytes:
        """Log bytes as the API shows text (whole lines: the callers hand out complete ones)."""
        return self.show(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")

    def artifacts(self, job_id: str) -> list[jobfiles.Artifact]:
        self.get(job_id)
        return jobfiles.list_artifacts(self.files(job_id))

    def model(self, job_id: str) -> tuple[Path, dict[str, Any]]:
        """A train job's exported model directory and its verified manifest; 404 until the job
        has one, 409 when the model on disk is not the one its manifest describes (a file
        altered, added, removed or replaced by a link)."""
        from dlrm_vrgd.serve.model import ModelError, read_manifest  # imports torch: on use

        job = self.get(job_id)
        files = self.files(job_id)
        model = files.model_dir
        if job.kind != "train" or not (model / "manifest.json").exists():
            raise ArtifactNotFound(f"job {job_id} has no model ({job.kind}, {job.state})")
        if not jobfiles.is_real_dir(files.run_dir, model):
            raise ArtifactDamaged(f"job {job_id}: its model directory is a link; not served")
        try:
            manifest = read_manifest(model, verify=True)
            if not isinstance(manifest.get("files"), dict):
                raise ModelError(f"{model / 'manifest.json'}: no table of files")
            for name in ("manifest.json", *manifest["files"]):
                if "/" in name or name.startswith(".") or not jobfiles.is_regular(model / name):
                    raise ModelError(f"{model / name}: not a regular file (a link?)")
        except (ModelError, OSError, KeyError, TypeError, AttributeError) as err:
            raise ArtifactDamaged(
                f"job {job_id}: its model does not match its manifest, not served: "
                f"{type(err).__name__}: {err}"
            ) from None
        return model, manifest

    def artifact_path(self, job_id: str, name: str) -> Path:
        jobfiles.check_artifact_name(name)
        self.get(job_id)
        return jobfiles.resolve_artifact(self.files(job_id), name)

    # --------------------------------------------------------------------------- events
    async def events(self, job_id: str, after: int) -> AsyncIterator[bytes]:
        """Server-sent events of one job, from record ``after`` on.

        ``job`` (a JobPublic snapshot) first and after every state change; ``metrics``,
        ``gsnr`` and ``state`` records with ``id`` = their seq (so ``Last-Event-ID`` resumes);
        ``end`` (the final JobPublic) once the job is finished and everything was sent;
        a ``: keep-alive`` comment when idle.
        """
        store = self.store
        keepalive = self.settings.sse_keepalive_s
        yield b"retry: 3000\n\n"
        job = await asyncio.to_thread(store.get_job, job_id)
        if job is None:
            return
        yield _sse("job", self.public(job).model_dump_json())
        cursor = after
        last_sent = last_read = time.monotonic()
        read = backlog = True  # the snapshot already reflects the backlog's state changes
        while not self.should_exit():
            if read:
                job = await asyncio.to_thread(store.get_job, job_id)
                if job is None:
                    yield _sse("end", json.dumps({"deleted": True, "id": job_id}))
                    return
                terminal = job.state in TERMINAL
                rows = await asyncio.to_thread(store.records_after, job_id, cursor, EVENT_PAGE)
                saw_state = False
                for seq, stream, data in rows:
                    yield _sse(stream, redact(data), seq)
                    cursor = seq
                    saw_state = saw_state or stream == "state"
                last_read = time.monotonic()
                if rows:
                    last_sent = last_read
                if len(rows) == EVENT_PAGE:
                    continue
                if terminal:
                    yield _sse("end", self.public(job).model_dump_json())
                    return
                if saw_state and not backlog:
                    yield _sse("job", self.public(job).model_dump_json())
                backlog = False
            woke = await self.notifier.wait(job_id, min(1.0, keepalive))
            now = time.monotonic()
            read = woke or now - last_read >= EVENT_RECHECK_S
            if not read and now - last_sent >= keepalive:
                yield b": keep-alive\n\n"
                last_sent = now


def _advice(files: jobfiles.JobFiles, last: float) -> dict[str, Any]:
    """``dlrm-vrgd advise`` of the run's gsnr.jsonl as it stands, read as every job file is
    (no link, a regular file, lines over :data:`~service.jobs.ingest.MAX_READ_BYTES` left
    out)."""
    try:
        fd = reading.open_in(files.gsnr, files.root)
    except FileNotFoundError:
        return advise_records([], last)
    with os.fdopen(fd, "rb") as f:
        return advise_records(noise_records(_bounded_lines(f, MAX_READ_BYTES)), last)


def _bounded_lines(f: Any, limit: int) -> Iterator[bytes]:
    """The lines of ``f`` up to ``limit`` bytes each; a longer line is skipped whole."""
    while line := f.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while (rest := f.readline(limit)) and not rest.endswith(b"\n"):
            pass  # the rest of an overlong line


def submission_digest(body: JobCreate) -> str:
    """What makes two requests under one ``submission_id`` the same: the validated body
    (defaults filled in, so a default spelled out changes nothing), its id left out, as
    canonical JSON, hashed."""
    data = body.model_dump(mode="json", exclude={"submission_id"})
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _same_submission(first: Job, body: JobCreate) -> Job:
    """``first``, the job made under ``body``'s submission_id, if ``body`` is its request
    again; else SubmissionConflict naming the id and the job. A job stored by a service that
    kept no digest is taken as the same (as that service answered)."""
    digest = first.submission_digest
    if digest is not None and digest != submission_digest(body):
        raise SubmissionConflict(
            f"submission_id {body.submission_id!r} was used by job {first.id} with another "
            "request body; a retried POST must repeat its body exactly, another job needs "
            "another submission_id"
        )
    return first


class _SubmittedMeanwhile(Exception):
    """Another request with the same submission_id stored its job first."""

    def __init__(self, job: Job) -> None:
        super().__init__(job.id)
        self.job = job


def _sse(event: str, data: str, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {data}\n\n".encode()
