"""The ``dlrm-vrgd jobs`` subcommands, one function each: (client, args) -> exit status."""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

from service.client import ServiceClient
from service.jobs_cli.answers import (
    as_job,
    as_object,
    as_page,
    field,
    print_job,
    print_jobs,
    progress_of,
    resolve_id,
)
from service.jobs_cli.connection import job_kind, read_job_config
from service.jobs_cli.errors import CHECKPOINT
from service.terminal import printable


# ------------------------------------------------------------------------------ commands
def _follow(client: ServiceClient, job: dict[str, Any]) -> dict[str, Any]:
    from service.follow import FollowLine

    live = FollowLine(progress_of(job).get("total_steps"))
    try:
        for event in client.events(job["id"]):
            live.on_event(event)
            if event.event == "end":
                break
    finally:
        live.close()
    return as_job(client.job(job["id"]))


def _final(job: dict[str, Any]) -> int:
    error = field(job, "error")
    state = field(job, "state")
    print(f"job {job['id']} {state}" + (f": {error}" if job.get("error") else ""))
    return 0 if job.get("state") == "succeeded" else 1


def cmd_submit(client: ServiceClient, args: argparse.Namespace) -> int:
    path = Path(args.config)
    config = read_job_config(path, args.set)
    kind = args.kind or job_kind(config)
    name = args.name or (config.get("name") if kind == "study" else None) or path.stem
    tags = args.tag or None
    job = as_job(client.submit(str(name), config, timeout_s=args.timeout, kind=kind, tags=tags))
    print(
        f"submitted {kind} job {job['id']} ({field(job, 'name')}): {field(job, 'state')}",
        flush=True,
    )
    if not args.follow:
        return 0
    return _final(_follow(client, job))


def cmd_list(client: ServiceClient, args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"limit": args.limit}
    if args.state:
        params["state"] = args.state
    if args.kind:
        params["kind"] = args.kind
    if args.name:
        params["name"] = args.name
    if args.tag:
        params["tag"] = args.tag
    answer = client.jobs(**params)
    jobs, count = as_page(answer)
    if args.json:
        print(json.dumps(answer, indent=2))  # JSON escapes every control character
        return 0
    print_jobs(jobs)
    if count > len(jobs):
        print(f"({len(jobs)} of {count}; --limit shows more)")
    return 0


def cmd_status(client: ServiceClient, args: argparse.Namespace) -> int:
    answer = client.job(resolve_id(client, args.id))
    job = as_job(answer)
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print_job(job)
    return 0


def _log_text(text: str) -> str:
    """Log text as a terminal may show it: line ends kept, every other control shown."""
    return printable(text.replace("\r\n", "\n").replace("\r", "\n"))


def cmd_logs(client: ServiceClient, args: argparse.Namespace) -> int:
    job_id = resolve_id(client, args.id)
    if not args.follow:
        sys.stdout.write(_log_text(client.logs(job_id, tail=args.tail)))
        sys.stdout.flush()
        return 0
    # the last --tail lines, then every byte after them: read to the end once (keeping only
    # the last lines), then follow from that offset, so no line is lost or shown twice
    last: collections.deque[str] = collections.deque(maxlen=args.tail)
    offset = 0
    while True:
        text, nxt = client.log_chunk(job_id, offset)
        last.extend(text.splitlines(keepends=True))
        if nxt == offset:
            break
        offset = nxt
    sys.stdout.write(_log_text("".join(last)))
    sys.stdout.flush()
    for chunk in client.follow_log(job_id, offset):
        sys.stdout.write(_log_text(chunk))
        sys.stdout.flush()
    return 0


def cmd_cancel(client: ServiceClient, args: argparse.Namespace) -> int:
    job = as_job(client.cancel(resolve_id(client, args.id)))
    print(f"job {job['id']}: {field(job, 'state')}")
    return 0


def _resumes_from(client: ServiceClient, job: dict[str, Any]) -> str:
    """What a resubmitted job's next attempt starts from, as its files show it now."""
    if job.get("kind") == "study":
        return "its finished cells are skipped"
    listed = as_object(client.artifacts(job["id"], prefix="checkpoints/"), "the job's files")
    paths = [a.get("path") for a in listed.get("data") or [] if isinstance(a, dict)]
    steps = [
        int(m.group(1)) for p in paths if isinstance(p, str) and (m := CHECKPOINT.fullmatch(p))
    ]
    if not steps:
        return "it has no checkpoint (stopped before its first): it starts again from step 0"
    return f"it resumes from step {max(steps)}, its newest checkpoint"


def cmd_resubmit(client: ServiceClient, args: argparse.Namespace) -> int:
    job = as_job(client.resubmit(resolve_id(client, args.id)))
    print(
        f"resubmitted job {job['id']} ({field(job, 'name')}): {field(job, 'state')}; "
        f"{_resumes_from(client, job)}",
        flush=True,
    )
    if not args.follow:
        return 0
    return _final(_follow(client, job))


COMMANDS = {
    "submit": cmd_submit,
    "list": cmd_list,
    "status": cmd_status,
    "logs": cmd_logs,
    "cancel": cmd_cancel,
    "resubmit": cmd_resubmit,
}
