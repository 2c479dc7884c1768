"""``dlrm-vrgd jobs``: submit, list, follow and cancel jobs of a running service (Ray Jobs' shape).

Command-line code over the REST API (:class:`service.client.ServiceClient`); it prints for
people. Where the service is and the token come from, first found wins:

1. ``--url`` / ``--token-file`` on the command line (before or after the subcommand);
2. the environment: ``DLRM_VRGD_URL``, ``DLRM_VRGD_TOKEN``;
3. the client config file ``$XDG_CONFIG_HOME/dlrm-vrgd/client.toml`` (default
   ``~/.config/dlrm-vrgd/client.toml``; ``DLRM_VRGD_CLIENT_CONFIG`` names another), with keys
   ``url`` and ``token`` (or ``token_file``);
4. ``http://127.0.0.1:8000`` and no token.

The token is never printed.

Whatever answers at that URL is not trusted to be a working service: an answer of the wrong
shape is one line of error (exit 1), never a traceback, and every string it holds is made
printable before it reaches the terminal (:mod:`service.terminal`: no escape sequence from a
server is ever printed raw). Job ids may be given by a unique prefix (``jobs status 3f2a``).
Ctrl-C ends a follow with exit status 130; a closed pipe (``jobs list --json | head``) ends
the command quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import httpx

from service.client import ApiError, BadAnswer, ServiceClient
from service.jobs_cli.commands import COMMANDS
from service.jobs_cli.connection import connection
from service.jobs_cli.errors import DEFAULT_URL, STATES, CliError
from service.terminal import printable

__all__ = ["CliError", "build_parser", "main"]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= 10_000:
        raise argparse.ArgumentTypeError(f"{value} is not between 1 and 10000")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < 1e9:  # not NaN, not infinite, not negative
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def _connection_options(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument(
        "--url",
        default=default,
        help=f"the service, e.g. http://gpu-host:8000 (default: DLRM_VRGD_URL, the client "
        f"config, then {DEFAULT_URL})",
    )
    parser.add_argument(
        "--token-file",
        default=default,
        metavar="FILE",
        help="a file holding the service's bearer token (default: DLRM_VRGD_TOKEN, then the "
        "client config)",
    )


EXAMPLES = """examples:
  dlrm-vrgd jobs submit configs/demo.yaml --set run.steps=100 --follow
  dlrm-vrgd jobs list --state running --state queued
  dlrm-vrgd jobs status 3f2a            (any unique start of an id)
  dlrm-vrgd jobs logs 3f2a --tail 50 --follow
  dlrm-vrgd jobs --url http://gpu-host:8000 --token-file ~/.dlrm-token list
  dlrm-vrgd jobs list --url http://gpu-host:8000 --token-file ~/.dlrm-token
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``jobs`` subcommands on ``parser`` (``dlrm-vrgd jobs``). ``--url`` and
    ``--token-file`` are taken before or after the subcommand."""
    _connection_options(parser, None)
    common = argparse.ArgumentParser(add_help=False)
    _connection_options(common, argparse.SUPPRESS)  # after the subcommand: only when given
    sub = parser.add_subparsers(dest="jobs_command", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help, description=description, parents=[common],
            formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        )  # fmt: skip

    s = command(
        "submit",
        "submit a train or study config (YAML)",
        "Submit a train or study config to the service; prints the new job's id.",
    )
    s.add_argument("config", help="a train or study YAML (a study has a `base:` section)")
    s.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. --set run.steps=100 or --set optim.dense.lr=0.01 "
        "(repeatable; run.steps replaces run.epochs and the other way round)",
    )  # fmt: skip
    s.add_argument("--name", help="job name (default: the study's name or the file's stem)")
    s.add_argument("--kind", choices=["train", "study"], help="default: from the config")
    s.add_argument("--timeout", type=_seconds, help="wall-clock limit in seconds")
    s.add_argument("--follow", action="store_true", help="follow it live until it ends")
    s.add_argument("--tag", action="append", default=[], help="label the job (repeatable)")
    ls = command("list", "jobs, newest first", "The service's jobs, newest first.")
    ls.add_argument(
        "--state", action="append", choices=STATES, metavar="STATE",
        help=f"keep jobs in this state: {', '.join(STATES)} (repeatable: any of them)",
    )  # fmt: skip
    ls.add_argument("--kind", choices=["train", "study", "score"], help="keep jobs of this kind")
    ls.add_argument("--name", help="keep names that contain this")
    ls.add_argument("--tag", action="append", help="keep jobs with this tag (repeatable: all)")
    ls.add_argument("--limit", type=_positive, default=50, help="at most N jobs (default 50)")
    ls.add_argument("--json", action="store_true", help="the API's answer as JSON")
    st = command("status", "one job", "One job: its state, progress and error.")
    st.add_argument("id", help="a job id, or any unique start of one")
    st.add_argument("--json", action="store_true", help="the API's answer as JSON")
    lg = command(
        "logs",
        "a job's log (its last lines)",
        "A job's log: the stdout and stderr of every attempt.",
    )
    lg.add_argument("id", help="a job id, or any unique start of one")
    lg.add_argument(
        "--tail", type=_positive, default=200, metavar="N",
        help="print the last N lines (default 200; with --follow, the N before the new ones)",
    )  # fmt: skip
    lg.add_argument("--follow", action="store_true", help="keep printing until the job ends")
    c = command("cancel", "cancel a queued or running job", "Cancel a queued or running job.")
    c.add_argument("id", help="a job id, or any unique start of one")
    r = command(
        "resubmit",
        "queue a failed or cancelled job again: it resumes from its checkpoint",
        "Queue a failed or cancelled job again: a train job resumes from its newest "
        "checkpoint (from step 0 when it has none, which is said), a study skips its "
        "finished cells.",
    )
    r.add_argument("id", help="a job id, or any unique start of one")
    r.add_argument("--follow", action="store_true", help="follow it live until it ends")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dlrm-vrgd jobs",
        description="Jobs of a running dlrm-vrgd service, over its API.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    add_arguments(parser)
    return parser


def main(argv: list[str]) -> int:
    """``dlrm-vrgd jobs ARGV...``: the exit status (0 ok, 1 job failed / API error, 2 usage,
    130 Ctrl-C)."""
    args = build_parser().parse_args(argv)
    url = "the service"
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
    except BadAnswer as err:
        print(f"error: {printable(url, False)} is not answering as a dlrm-vrgd service: "
              f"{printable(str(err), False)}", file=sys.stderr)  # fmt: skip
        return 1
    except RecursionError:
        print(f"error: {printable(url, False)} answered JSON nested too deep", file=sys.stderr)
        return 1
    except httpx.TimeoutException:
        print(f"error: {printable(url, False)} did not answer in time", file=sys.stderr)
        return 1
    except (httpx.TransportError, httpx.InvalidURL, httpx.UnsupportedProtocol) as err:
        print(f"error: cannot reach the service at {printable(url, False)}: "
              f"{printable(str(err), False)}", file=sys.stderr)  # fmt: skip
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # ``| head`` closed its end: nothing more to say to anyone
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit would fail again
        return 141


def _api_message(err: ApiError) -> str:
    detail = err.detail
    if isinstance(detail, list):  # FastAPI validation errors: loc + msg
        parts = []
        for item in detail:
            if isinstance(item, dict):
                where = item.get("loc") if isinstance(item.get("loc"), list) else []
                loc = ".".join(str(p) for p in where if p != "body")
                parts.append(f"{loc}: {item.get('msg')}" if loc else str(item.get("msg")))
        detail = "; ".join(parts) or detail
    text = printable(str(detail), keep_newlines=False)[:2000]
    message = f"{err.status_code}: {text}"
    if err.status_code == 401:
        message += (
            " (the service wants its bearer token: pass --token-file FILE, a file holding it, "
            "or set DLRM_VRGD_TOKEN; `dlrm-vrgd serve` prints it at start)"
        )
    return message
