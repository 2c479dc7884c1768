"""The service's answers as the client reads them: checked for shape (:class:`BadAnswer`
otherwise), every string made printable, printed for people; job ids and their prefixes."""

from __future__ import annotations

from typing import Any

from service.client import ApiError, BadAnswer, ServiceClient
from service.jobs_cli.errors import JOB_ID, CliError
from service.terminal import clean, printable


# ------------------------------------------------------------------------------ answers
def as_object(value: Any, what: str) -> dict[str, Any]:
    """``value`` as a JSON object (BadAnswer naming ``what`` otherwise), strings printable."""
    if not isinstance(value, dict):
        raise BadAnswer(f"{what}: expected a JSON object, got {type(value).__name__}")
    return clean(value)


def as_job(value: Any, what: str = "the job") -> dict[str, Any]:
    """A job as the API returns it: an object whose ``id`` is a job id (other fields are read
    type-tolerantly where they are printed)."""
    job = as_object(value, what)
    if not isinstance(job.get("id"), str) or not JOB_ID.fullmatch(job["id"]):
        raise BadAnswer(f"{what}: no job id in the answer")
    return job


def as_page(value: Any) -> tuple[list[dict[str, Any]], int]:
    page = as_object(value, "the job list")
    data, count = page.get("data"), page.get("count")
    if not isinstance(data, list) or isinstance(count, bool) or not isinstance(count, int):
        raise BadAnswer("the job list: expected {data: [...], count: N}")
    return [as_job(j, "a job of the list") for j in data], count


# ------------------------------------------------------------------------------ printing
def _fmt(value: Any, spec: str = ".4f") -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    return format(value, spec)


def field(job: dict[str, Any], key: str) -> str:
    """A job's field as one line of text ("-" when missing or not a plain value)."""
    value = job.get(key)
    if isinstance(value, bool) or value is None or isinstance(value, dict | list):
        return "-"
    return printable(str(value), keep_newlines=False)


def _when(value: Any) -> str:
    return printable(str(value)[:19].replace("T", " "), False) if value else "-"


def progress_of(job: dict[str, Any]) -> dict[str, Any]:
    progress = job.get("progress")
    return progress if isinstance(progress, dict) else {}


def _count(value: Any) -> str:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else "-"


def print_jobs(jobs: list[dict[str, Any]]) -> None:
    """One line per job; ids whole (``jobs status`` takes them, or any unique prefix)."""
    width = max([16, *(len(j["id"]) for j in jobs)])
    print(
        f"{'ID':{width}s} {'NAME':24s} {'KIND':6s} {'STATE':10s} {'STEP':>11s} "
        f"{'BEST VAL AUC':>12s}  CREATED"
    )
    for job in jobs:
        progress = progress_of(job)
        steps = f"{_count(progress.get('step'))}/{_count(progress.get('total_steps'))}"
        print(
            f"{job['id']:{width}s} {field(job, 'name')[:24]:24s} {field(job, 'kind')[:6]:6s} "
            f"{field(job, 'state')[:10]:10s} {steps:>11s} "
            f"{_fmt(progress.get('best_val_auc')):>12s}  {_when(job.get('created_at'))}"
        )


def print_job(job: dict[str, Any]) -> None:
    progress = progress_of(job)
    steps = f"{_count(progress.get('step'))}/{_count(progress.get('total_steps'))}"
    lines = [
        ("id", job["id"]),
        ("name", field(job, "name")),
        ("kind", field(job, "kind")),
        ("state", field(job, "state")),
        ("backend", field(job, "backend")),
        ("created", _when(job.get("created_at"))),
        ("started", _when(job.get("started_at"))),
        ("finished", _when(job.get("finished_at"))),
        ("step", steps),
        ("loss", _fmt(progress.get("loss"))),
        ("val AUC", _fmt(progress.get("val_auc"))),
        ("best val AUC", _fmt(progress.get("best_val_auc"))),
        ("test AUC", _fmt(progress.get("test_auc"))),
    ]
    tags = job.get("tags")
    if isinstance(tags, list) and tags:
        lines.insert(4, ("tags", ", ".join(printable(str(t), False) for t in tags)))
    if job.get("slurm_job_id"):
        lines.insert(5, ("slurm job", field(job, "slurm_job_id")))
    if job.get("exit_code") is not None:
        lines.append(("exit code", field(job, "exit_code")))
    if job.get("error"):
        lines.append(("error", field(job, "error")))
    for key, value in lines:
        print(f"{key + ':':14s}{value}")


# ------------------------------------------------------------------------------ job ids
def resolve_id(client: ServiceClient, given: str) -> str:
    """The job id ``given`` names: itself when a job has it, else the one job whose id starts
    with it (a unique prefix, as ``jobs list`` once cut ids short)."""
    if not JOB_ID.fullmatch(given):
        raise CliError(f"{printable(given[:80], False)!r} is not a job id (letters and digits)")
    try:
        return as_job(client.job(given))["id"]
    except ApiError as err:
        if err.status_code != 404:
            raise
    found: list[str] = []
    offset = 0
    while True:
        jobs, count = as_page(client.jobs(limit=1000, offset=offset))
        found += [j["id"] for j in jobs if j["id"].startswith(given)]
        offset += len(jobs)
        if not jobs or offset >= count or len(found) > 10:
            break
    if not found:
        raise CliError(f"no job has the id {given} (or an id starting with it)")
    if len(found) > 1:
        raise CliError(f"{given} starts {len(found)} job ids: {', '.join(found[:10])}; say more")
    return found[0]
