"""Ingestion: tail a run directory's JSON-lines files into the store (:func:`ingest_job`) and
summarize them into a job's progress.

The trainer appends whole lines (``dlrm_vrgd.rundir``); a reader may still catch the file
between two writes of a multi-write line on some filesystems, so only bytes up to the last
newline are consumed and the offset advances exactly over them.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlrm_vrgd import safejson
from service.jobs import reading
from service.jobs.models import utcnow
from service.jobs.reading import JobFileError

if TYPE_CHECKING:
    from service.jobs.files import JobFiles
    from service.jobs.store import Store

logger = logging.getLogger(__name__)

#: Most bytes read from one file per tick (bounds memory on a huge backlog).
MAX_READ_BYTES = 8 << 20


def clean(value: Any) -> Any:
    """NaN/Inf -> None, recursively (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return value


class RecordError(JobFileError):
    """A line of a job's JSON-lines file that is not a JSON object within bounds (too long,
    nested too deep, not JSON): the job fails, naming the file and the line."""

    def __init__(self, name: str, line: int, reason: str) -> None:
        super().__init__(f"{name}:{line}", reason)
        self.line = line


def _line_at(path: Path, offset: int, within: Path | None) -> int:
    """The 1-based number of the line that starts at byte ``offset``."""
    lines, at = 1, 0
    while at < offset:
        got = reading.read_range(path, at, min(MAX_READ_BYTES, offset - at), within)
        if not got or not got[0]:
            break
        lines += got[0].count(b"\n")
        at += len(got[0])
    return lines


def read_new_records(
    path: Path, offset: int, max_bytes: int = MAX_READ_BYTES, within: Path | None = None
) -> tuple[list[dict[str, Any]], int] | None:
    """Complete JSON-object lines of ``path`` from byte ``offset``, and the offset after them.

    Returns None when the file is shorter than ``offset`` (it was rewritten: start over).
    A missing file reads as nothing new. The file is read as every job file is
    (:mod:`service.jobs.reading`: no link below ``within``, a regular file, at most
    ``max_bytes`` a call); a line longer than ``max_bytes``, nested deeper than
    :data:`dlrm_vrgd.safejson.MAX_DEPTH`, or that is not a JSON object raises
    :class:`RecordError` naming the file and the line.
    """
    got = reading.read_range(path, offset, max_bytes, within)
    if got is None:
        return [], offset  # not written yet (or removed): nothing new, keep what is stored
    data, size = got
    if size < offset:
        return None
    name = reading.name_of(path, within)
    end = data.rfind(b"\n")
    if end < 0:
        if len(data) >= max_bytes:
            line = _line_at(path, offset, within)
            raise RecordError(name, line, f"a line longer than {max_bytes:,} bytes")
        return [], offset
    records: list[dict[str, Any]] = []
    for i, line in enumerate(data[: end + 1].split(b"\n")[:-1]):
        if not line.strip():
            continue
        try:
            rec = safejson.loads(line)
        except ValueError as err:
            number = _line_at(path, offset, within) + i
            raise RecordError(name, number, f"not JSON ({safejson.describe(err)})") from None
        if not isinstance(rec, dict):
            number = _line_at(path, offset, within) + i
            raise RecordError(name, number, "not a JSON object")
        records.append(clean(rec))
    return records, offset + end + 1


def file_inode(path: Path) -> int | None:
    """The file's inode number (None when it does not exist): a run that resumes rewrites its
    JSON-lines files by an atomic replace, which gives them a new inode."""
    try:
        return path.lstat().st_ino
    except OSError:
        return None


def read_all_records(path: Path, within: Path | None = None) -> tuple[list[dict[str, Any]], int]:
    """Every complete JSON-object line of ``path`` and the offset after the last one."""
    records: list[dict[str, Any]] = []
    offset = 0
    while True:
        got = read_new_records(path, offset, within=within)
        if got is None:  # rewritten again while being read: start over
            records, offset = [], 0
            continue
        more, end = got
        if end == offset:
            return records, offset
        records += more
        offset = end


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def update_progress(
    progress: dict[str, Any], metrics: list[dict[str, Any]], gsnr: list[dict[str, Any]]
) -> dict[str, Any]:
    """Fold new records into a job's progress summary (a new dict; the input is untouched).

    Keys: step, samples, epoch, loss, lr_dense, lr_sparse, rows_per_s, gsnr_ratio,
    gsnr_frac_clipped (dense, element-weighted), table_gsnr_ratio, table_frac_clipped (mean over
    tables), val_auc, val_oracle_auc, best_val_auc, best_val_step, test_auc, test_oracle_auc,
    eval_step; total_steps and fraction when the total is known. A study's records are its
    finished cells: ``best_val_auc`` is then the best validation AUC over them (with that
    cell's id, ``best_cell``, and its test AUC, ``best_cell_test_auc``), val_auc / test_auc the
    last cell's. A score job's: rows, rows_per_s, fraction, and at the end (labelled rows) auc
    and logloss.
    """
    p = dict(progress)
    for rec in metrics:
        kind = rec.get("kind")
        if kind == "start" and _int(rec.get("total_steps")) is not None:
            p["total_steps"] = rec["total_steps"]
        elif kind == "cell":  # a study: one record per finished cell
            p["step"] = _int(rec.get("step"))
            p["total_steps"] = _int(rec.get("total_cells"))
            p["last_cell"] = rec.get("cell")
            for key in ("val_auc", "test_auc"):
                p[f"{key}"] = _num(rec.get(key))
            p["test_oracle_auc"] = _num(rec.get("oracle_auc"))
            auc = p["val_auc"]
            if auc is not None and auc > (p.get("best_val_auc") or -1.0):
                p["best_val_auc"] = auc
                p["best_cell"] = rec.get("cell") if isinstance(rec.get("cell"), str) else None
                p["best_cell_test_auc"] = p["test_auc"]
        elif kind == "score":  # a score job: rows done and the fraction of the input read
            p["rows"] = _int(rec.get("rows"))
            p["rows_per_s"] = _num(rec.get("rows_per_s"))
            p["fraction"] = _num(rec.get("fraction"))
            for key in ("auc", "logloss"):  # labelled rows: on the last record
                if _num(rec.get(key)) is not None:
                    p[key] = _num(rec[key])
        elif kind == "train":
            for key in ("step", "samples"):
                if _int(rec.get(key)) is not None:
                    p[key] = rec[key]
            for key in ("epoch", "loss", "lr_dense", "lr_sparse", "rows_per_s"):
                if key in rec:
                    p[key] = _num(rec[key])
            for key in ("gsnr_ratio", "gsnr_frac_clipped"):
                if _num(rec.get(key)) is not None:
                    p[key] = _num(rec[key])
        elif kind == "eval":
            split = rec.get("split")
            auc = _num(rec.get("auc"))
            if split not in ("val", "test"):
                continue
            p[f"{split}_auc"] = auc
            p[f"{split}_logloss"] = _num(rec.get("logloss"))
            p[f"{split}_oracle_auc"] = _num(rec.get("oracle_auc"))
            p["eval_step"] = _int(rec.get("step"))
            if split == "val" and auc is not None and auc > (p.get("best_val_auc") or -1.0):
                p["best_val_auc"] = auc
                p["best_val_step"] = _int(rec.get("step"))
    for rec in gsnr:
        tables = [t for t in rec.get("tables") or [] if isinstance(t, dict)]
        ratios = [_num(t.get("ratio")) for t in tables]
        ratios = [r for r in ratios if r is not None]
        if ratios:
            p["table_gsnr_ratio"] = sum(ratios) / len(ratios)
            clipped = [_num(t.get("frac_clipped")) for t in tables]
            clipped = [c for c in clipped if c is not None]
            p["table_frac_clipped"] = sum(clipped) / len(clipped) if clipped else None
    total = _int(p.get("total_steps"))
    step = _int(p.get("step"))
    if total and step is not None:
        p["fraction"] = min(1.0, step / total)
    return p


def ingest_job(store: Store, job_id: str, files: JobFiles) -> int:
    """Tail the job's metrics.jsonl and gsnr.jsonl into the store.

    A file rewritten since the last look (a new inode, or shorter: a resumed attempt keeps
    only the records up to its checkpoint) is reconciled record by record: the records
    the attempts share stay (same ``seq``), those after the resume point go, the new
    attempt's follow. The series thus continue across attempts with no step twice.

    Raises :class:`~service.jobs.reading.JobFileError` (:class:`RecordError` for a bad line)
    when a file is not one the service reads: the runner fails that job alone."""
    job = store.get_job(job_id)
    if job is None:
        return 0
    reads = {}
    changed = 0
    for stream, path, offset, inode in (
        ("metrics", files.metrics, job.metrics_offset, job.metrics_inode),
        ("gsnr", files.gsnr, job.gsnr_offset, job.gsnr_inode),
    ):
        now_inode = file_inode(path)
        got = read_new_records(path, offset, within=files.root)
        replaced = inode is not None and now_inode is not None and now_inode != inode
        if got is None or replaced:
            records, end = read_all_records(path, files.root)
            gone, added = store.reconcile_stream(job_id, stream, records, end, now_inode)
            logger.info(
                "job %s: %s was rewritten (a resumed run): %d record(s) dropped, %d added",
                job_id,
                path.name,
                gone,
                added,
            )
            changed += gone + added
            if stream == "metrics":
                progress = update_progress(
                    {k: v for k, v in job.progress.items() if k == "total_steps"},
                    records,
                    [],
                )
                progress["updated_at"] = utcnow().isoformat()
                store.update_job(job_id, progress=progress)
            job = store.get_job(job_id) or job
            got = ([], end)
            now_inode = file_inode(path) if now_inode is None else now_inode
        reads[stream] = (*got, now_inode)
    (metrics, m_off, m_ino), (gsnr, g_off, g_ino) = reads["metrics"], reads["gsnr"]
    same_inodes = (m_ino, g_ino) == (job.metrics_inode, job.gsnr_inode)
    if not metrics and not gsnr and (m_off, g_off) == (job.metrics_offset, job.gsnr_offset):
        if not same_inodes:
            store.update_job(job_id, metrics_inode=m_ino, gsnr_inode=g_ino)
        return changed
    progress = update_progress(job.progress, metrics, gsnr)
    progress["updated_at"] = utcnow().isoformat()
    return changed + store.ingest(
        job_id, metrics, m_off, gsnr, g_off, progress, inodes=(m_ino, g_ino)
    )
