"""The ``dlrm-vrgd`` command line: :func:`main` registers the commands, one module each
(``cmd_train``; ``cmd_data``: generate, preprocess; ``cmd_export``; ``cmd_score``;
``cmd_study``: study, advise; ``cmd_service``: demo, serve, jobs; ``cmd_tensorboard``;
``cmd_config``), and turns the errors a user can fix into a message and an exit code.
What the commands share is in :mod:`dlrm_vrgd.cli.common`."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from dlrm_vrgd.cli import (
    cmd_config,
    cmd_data,
    cmd_export,
    cmd_score,
    cmd_service,
    cmd_study,
    cmd_tensorboard,
    cmd_train,
)
from dlrm_vrgd.cli.common import MissingExtra, extra_of

#: ``dlrm-vrgd -h``'s description.
DESCRIPTION = "``dlrm-vrgd``: train, generate synthetic data, run the demo."

#: Each adds its subparser (``fn`` its handler), in the order ``dlrm-vrgd -h`` lists them.
COMMANDS = (
    cmd_train.add_train,
    cmd_service.add_demo,
    cmd_service.add_serve,
    cmd_service.add_jobs,
    cmd_data.add_generate,
    cmd_data.add_preprocess,
    cmd_export.add_export,
    cmd_score.add_score,
    cmd_study.add_study,
    cmd_tensorboard.add_tensorboard,
    cmd_study.add_advise,
    cmd_config.add_show_config,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlrm-vrgd", description=DESCRIPTION)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["jobs"]:  # its own parser (service/jobs_cli/): every flag is its own
        return _missing_extra("jobs", cmd_service.cmd_jobs, argparse.Namespace(jobs_args=argv[1:]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # torchrec's import trips torch.fx's "is_fx_tracing" notice: noise for our users; so does
    # the ONNX exporter's "torchvision is not installed" for ops this model never uses.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    try:
        return _missing_extra(args.command, args.fn, args)
    except (FileExistsError, FileNotFoundError, ValueError) as err:  # ConfigError too
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, a permission, a name too long: the OS said why
        print(f"error: {err}", file=sys.stderr)
        return 1
    except RuntimeError as err:
        from dlrm_vrgd.checkpoint import CheckpointError
        from dlrm_vrgd.train.loop import NonFiniteError

        if not isinstance(err, NonFiniteError | CheckpointError):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        print(f"\n{err}" if str(err) else "\ninterrupted", file=sys.stderr)
        return 130


def _missing_extra(command: str, fn: Any, args: argparse.Namespace) -> int:
    """``fn(args)``; where it needs an extra that is not installed (:class:`MissingExtra`, or an
    ImportError of one of its modules), ``error: dlrm-vrgd COMMAND needs the X extra: pip
    install 'dlrm-vrgd[X]'`` and exit 2."""
    try:
        return fn(args)
    except ImportError as err:
        extra = extra_of(err)
        if extra is None:
            raise
        if not isinstance(err, MissingExtra):
            err = MissingExtra(command, extra)
        print(f"error: {err}", file=sys.stderr)
        return 2
