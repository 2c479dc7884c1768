"""``dlrm-vrgd demo | serve | jobs``: the commands of the control service (``service/``).

The trainer package never imports the service (tests/test_layering.py): each command names its
function in :data:`SERVICE_COMMANDS`, imported only when run, so ``dlrm-vrgd train`` works where
the service is not installed."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

from dlrm_vrgd.cli.common import REPO, add_set, require_extra

#: Commands that live in the control service, as ``"module:function"``.
SERVICE_COMMANDS = {
    "demo": "service.demo:run_demo",
    "serve": "service.cli:serve_main",
    "jobs": "service.jobs_cli:main",
}


def run_service_command(command: str, *args: Any, **kwargs: Any) -> int:
    """Import the function registered for ``command`` (:data:`SERVICE_COMMANDS`) and call it
    (:class:`~dlrm_vrgd.cli.common.MissingExtra` without the ``service`` extra)."""
    require_extra(command, "service")
    module, _, name = SERVICE_COMMANDS[command].partition(":")
    return getattr(importlib.import_module(module), name)(*args, **kwargs)


def add_demo(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser(
        "demo", help="train configs/demo.yaml through the service; AUC beside the oracle"
    )
    add_set(d)
    d.add_argument("--data-dir", help="service data directory (default runs/service)")
    d.add_argument("--port", type=int, help="service port (default: a free one)")
    d.add_argument("--keep-serving", action="store_true", help="keep the service running after")
    d.add_argument("--no-vr", action="store_true", help="keep the config's base optimizers")
    d.set_defaults(fn=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """The demo job through the control service (see service/demo.py)."""
    return run_service_command(
        "demo",
        REPO / "configs" / "demo.yaml",
        args.set,
        Path(args.data_dir or REPO / "runs" / "service"),
        keep_serving=args.keep_serving,
        vr=not args.no_vr,
        port=args.port,
    )


def add_serve(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="run the control service (REST API, see README)")
    s.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default 8000)")
    s.add_argument("--data-dir", help="store and job files (default ~/.local/share/dlrm-vrgd)")
    s.add_argument("--max-jobs", type=int, help="jobs running at once (default 1)")
    s.add_argument("--job-timeout", type=float, help="default per-job timeout in seconds")
    s.set_defaults(fn=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """The control service under uvicorn (see service/cli.py)."""
    return run_service_command(
        "serve", args.host, args.port, args.data_dir, args.max_jobs, args.job_timeout
    )


def add_jobs(sub: argparse._SubParsersAction) -> None:
    """Listed in ``dlrm-vrgd -h``; ``dlrm-vrgd jobs ...`` itself goes to the service's own
    parser straight from ``main`` (every flag after ``jobs`` is its own)."""
    j = sub.add_parser(
        "jobs",
        help="submit, list, follow, cancel jobs of a running service (dlrm-vrgd jobs -h)",
        add_help=False,
    )
    j.add_argument("jobs_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    j.set_defaults(fn=cmd_jobs)


def cmd_jobs(args: argparse.Namespace) -> int:
    """Jobs of a running service (service/jobs_cli/)."""
    return run_service_command("jobs", args.jobs_args)
