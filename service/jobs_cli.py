"""``dlrm-vrgd jobs``: submit, list, follow and cancel jobs of a running service (Ray Jobs' shape).

Command-line code over the REST API (:class:`service.client.ServiceClient`); it prints for
people. Where the service is and the token come from, first found wins:

1. ``--url`` / ``--token-file`` on the command line;
2. the environment: ``DLRM_VRGD_URL``, ``DLRM_VRGD_TOKEN``;
3. the client config file ``$XDG_CONFIG_HOME/dlrm-vrgd/client.toml`` (default
   ``~/.config/dlrm-vrgd/client.toml``; ``DLRM_VRGD_CLIENT_CONFIG`` names another), with keys
   ``url`` and ``token`` (or ``token_file``);
4. ``http://127.0.0.1:8000`` and no token.

The token is never printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx

from service.client import TERMINAL, ApiError, ServiceClient

DEFAULT_URL = "http://127.0.0.1:8000"


class CliError(Exception):
    """A mistake on the command line or in a file it names: printed as one line, exit 2."""


# ------------------------------------------------------------------------------ connection
def client_config_path() -> Path:
    named = os.environ.get("DLRM_VRGD_CLIENT_CONFIG")
    if named:
        return Path(named)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dlrm-vrgd" / "client.toml"


def _read_client_config(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as err:
        raise CliError(f"{path}: cannot read the client config ({type(err).__name__})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise CliError(f"{path}: not valid TOML: {err}") from None
    unknown = sorted(set(data) - {"url", "token", "token_file"})
    if unknown:
        raise CliError(f"{path}: unknown key {unknown[0]!r} (expected url, token, token_file)")
    for key in data:
        if not isinstance(data[key], str) or not data[key]:
            raise CliError(f"{path}: {key} must be a non-empty string")
    return data


def _token_from_file(path: Path, what: str) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CliError(f"{what} {path}: cannot read the token ({type(err).__name__})") from None
    if not token:
        raise CliError(f"{what} {path}: empty")
    return token


def connection(args: argparse.Namespace) -> tuple[str, str | None]:
    """The service's base URL and the bearer token (see the module docstring)."""
    config_path = client_config_path()
    config = _read_client_config(config_path)
    url = args.url or os.environ.get("DLRM_VRGD_URL") or config.get("url") or DEFAULT_URL
    if not url.startswith(("http://", "https://")):
        raise CliError(f"--url {url!r}: expected http://HOST:PORT or https://...")
    token: str | None
    if args.token_file:
        token = _token_from_file(Path(args.token_file), "--token-file")
    elif os.environ.get("DLRM_VRGD_TOKEN"):
        token = os.environ["DLRM_VRGD_TOKEN"].strip()
    elif "token" in config:
        token = config["token"]
    elif "token_file" in config:
        token = _token_from_file(Path(config["token_file"]).expanduser(), f"{config_path}:")
    else:
        token = None
    return url, token


# ------------------------------------------------------------------------------ configs
def read_job_config(path: Path, overrides: list[str]) -> dict[str, Any]:
    """The YAML file as a mapping with ``--set`` overrides applied (the service validates)."""
    from dlrm_vrgd.config import ConfigError, apply_overrides, read_yaml_mapping

    try:
        return apply_overrides(read_yaml_mapping(path), overrides)
    except ConfigError as err:
        raise CliError(str(err)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise CliError(f"{path}: cannot read ({type(err).__name__})") from None


def job_kind(config: dict[str, Any]) -> str:
    """``study`` for a study config (it has a ``base`` TrainConfig), else ``train``."""
    return "study" if "base" in config else "train"


# ------------------------------------------------------------------------------ printing
def _fmt(value: Any, spec: str = ".4f") -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    return format(value, spec)


def _when(value: Any) -> str:
    return str(value)[:19].replace("T", " ") if value else "-"


def print_jobs(jobs: list[dict[str, Any]]) -> None:
    print(
        f"{'ID':14s} {'NAME':24s} {'KIND':6s} {'STATE':10s} {'STEP':>11s} {'BEST VAL AUC':>12s}"
        "  CREATED"
    )
    for job in jobs:
        progress = job.get("progress") or {}
        step, total = progress.get("step"), progress.get("total_steps")
        steps = f"{step if step is not None else '-'}/{total if total is not None else '-'}"
        best = progress.get("best_val_auc")
        print(
            f"{job['id'][:14]:14s} {job['name'][:24]:24s} {job['kind']:6s} {job['state']:10s} "
            f"{steps:>11s} {_fmt(best):>12s}  {_when(job.get('created_at'))}"
        )


def print_job(job: dict[str, Any]) -> None:
    progress = job.get("progress") or {}
    lines = [
        ("id", job["id"]),
        ("name", job["name"]),
        ("kind", job["kind"]),
        ("state", job["state"]),
        ("backend", job.get("backend") or "-"),
        ("created", _when(job.get("created_at"))),
        ("started", _when(job.get("started_at"))),
        ("finished", _when(job.get("finished_at"))),
        ("step", f"{progress.get('step', '-')}/{progress.get('total_steps', '-')}"),
        ("loss", _fmt(progress.get("loss"))),
        ("val AUC", _fmt(progress.get("val_auc"))),
        ("best val AUC", _fmt(progress.get("best_val_auc"))),
        ("test AUC", _fmt(progress.get("test_auc"))),
    ]
    if job.get("tags"):
        lines.insert(4, ("tags", ", ".join(job["tags"])))
    if job.get("slurm_job_id"):
        lines.insert(5, ("slurm job", job["slurm_job_id"]))
    if job.get("exit_code") is not None:
        lines.append(("exit code", str(job["exit_code"])))
    if job.get("error"):
        lines.append(("error", job["error"]))
    for key, value in lines:
        print(f"{key + ':':14s}{value}")


# ------------------------------------------------------------------------------ commands
def _follow(client: ServiceClient, job: dict[str, Any]) -> dict[str, Any]:
    from service.demo import LiveLine

    live = LiveLine((job.get("progress") or {}).get("total_steps"))
    try:
        for event in client.events(job["id"]):
            live.on_event(event)
            if event.event == "end":
                break
    finally:
        live.close()
    return client.job(job["id"])


def _final(job: dict[str, Any]) -> int:
    print(f"job {job['id']} {job['state']}" + (f": {job['error']}" if job.get("error") else ""))
    return 0 if job["state"] == "succeeded" else 1


def cmd_submit(client: ServiceClient, args: argparse.Namespace) -> int:
    path = Path(args.config)
    config = read_job_config(path, args.set)
    kind = args.kind or job_kind(config)
    name = args.name or (config.get("name") if kind == "study" else None) or path.stem
    tags = args.tag or None
    job = client.submit(str(name), config, timeout_s=args.timeout, kind=kind, tags=tags)
    print(f"submitted {kind} job {job['id']} ({job['name']}): {job['state']}", flush=True)
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
    page = client.jobs(**params)
    if args.json:
        print(json.dumps(page, indent=2))
        return 0
    print_jobs(page["data"])
    if page["count"] > len(page["data"]):
        print(f"({len(page['data'])} of {page['count']}; --limit shows more)")
    return 0


def cmd_status(client: ServiceClient, args: argparse.Namespace) -> int:
    job = client.job(args.id)
    if args.json:
        print(json.dumps(job, indent=2))
    else:
        print_job(job)
    return 0


def cmd_logs(client: ServiceClient, args: argparse.Namespace) -> int:
    text = client.logs(args.id, tail=args.tail)
    sys.stdout.write(text)
    sys.stdout.flush()
    if not args.follow:
        return 0
    seen = text
    while True:
        job = client.job(args.id)
        text = client.logs(args.id, tail=args.tail)
        sys.stdout.write(_new_part(seen, text))
        sys.stdout.flush()
        seen = text
        if job["state"] in TERMINAL:
            return 0
        time.sleep(args.poll)


def _new_part(seen: str, text: str) -> str:
    """What ``text`` (a later tail of the same log) adds after ``seen``."""
    if not seen:
        return text
    for start in range(len(seen)):
        overlap = seen[start:]
        if text.startswith(overlap):
            return text[len(overlap) :]
    return text


def cmd_cancel(client: ServiceClient, args: argparse.Namespace) -> int:
    job = client.cancel(args.id)
    print(f"job {job['id']}: {job['state']}")
    return 0


def cmd_resubmit(client: ServiceClient, args: argparse.Namespace) -> int:
    job = client.resubmit(args.id)
    print(f"resubmitted job {job['id']} ({job['name']}): {job['state']}", flush=True)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``jobs`` subcommands on ``parser`` (``dlrm-vrgd jobs``)."""
    parser.add_argument("--url", help=f"the service (DLRM_VRGD_URL; default {DEFAULT_URL})")
    parser.add_argument(
        "--token-file", help="file holding the bearer token (default DLRM_VRGD_TOKEN)"
    )
    sub = parser.add_subparsers(dest="jobs_command", required=True, metavar="COMMAND")
    s = sub.add_parser("submit", help="submit a train or study config (YAML)")
    s.add_argument("config", help="a train or study YAML (a study has a `base:` section)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    s.add_argument("--name", help="job name (default: the study's name or the file's stem)")
    s.add_argument("--kind", choices=["train", "study"], help="default: from the config")
    s.add_argument("--timeout", type=float, help="wall-clock limit in seconds")
    s.add_argument("--follow", action="store_true", help="follow it live until it ends")
    s.add_argument("--tag", action="append", default=[], help="label the job (repeatable)")
    ls = sub.add_parser("list", help="jobs, newest first")
    ls.add_argument("--state", action="append", help="keep these states (repeatable)")
    ls.add_argument("--kind", choices=["train", "study", "score"])
    ls.add_argument("--name", help="keep names that contain this")
    ls.add_argument("--tag", action="append", help="keep jobs with this tag (repeatable: all)")
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--json", action="store_true", help="the API's answer as JSON")
    st = sub.add_parser("status", help="one job")
    st.add_argument("id")
    st.add_argument("--json", action="store_true", help="the API's answer as JSON")
    lg = sub.add_parser("logs", help="a job's log (its last lines)")
    lg.add_argument("id")
    lg.add_argument("--tail", type=int, default=200)
    lg.add_argument("--follow", action="store_true", help="keep printing until the job ends")
    lg.add_argument("--poll", type=float, default=1.0, help=argparse.SUPPRESS)
    c = sub.add_parser("cancel", help="cancel a queued or running job")
    c.add_argument("id")
    r = sub.add_parser(
        "resubmit", help="queue a failed or cancelled job again: it resumes from its checkpoint"
    )
    r.add_argument("id")
    r.add_argument("--follow", action="store_true", help="follow it live until it ends")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dlrm-vrgd jobs", description="Jobs of a running dlrm-vrgd service, over its API."
    )
    add_arguments(parser)
    return parser


def main(argv: list[str]) -> int:
    """``dlrm-vrgd jobs ARGV...``: the exit status (0 ok, 1 job failed / API error, 2 usage)."""
    args = build_parser().parse_args(argv)
    try:
        url, token = connection(args)
        with ServiceClient(url, token) as client:
            return COMMANDS[args.jobs_command](client, args)
    except CliError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ApiError as err:
        print(f"error: the service answered {_api_message(err)}", file=sys.stderr)
        return 1
    except httpx.TransportError as err:
        print(f"error: cannot reach the service at {url}: {err}", file=sys.stderr)
        return 1


def _api_message(err: ApiError) -> str:
    detail = err.detail
    if isinstance(detail, list):  # FastAPI validation errors: loc + msg
        parts = []
        for item in detail:
            if isinstance(item, dict):
                loc = ".".join(str(p) for p in item.get("loc", []) if p != "body")
                parts.append(f"{loc}: {item.get('msg')}" if loc else str(item.get("msg")))
        detail = "; ".join(parts) or detail
    return f"{err.status_code}: {detail}"
