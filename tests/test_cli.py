"""``dlrm-vrgd`` as a user runs it (dlrm_vrgd/cli/__init__.py: the commands registered, their
options and examples): real processes, real files. ``cli`` and ``write_config`` serve the
tests of every command (tests/test_cli_*.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from .conftest import tiny_config_dict


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def write_config(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(**sections)))
    return path


def test_every_option_says_what_it_does_and_the_main_commands_show_examples() -> None:
    import argparse

    from dlrm_vrgd.cli import build_parser
    from service.jobs_cli import build_parser as jobs_parser

    def parsers(p: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
        found = [(p.prog, p)]
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    found += parsers(child)
        return found

    missing = [
        f"{prog} {'/'.join(a.option_strings) or a.dest}"
        for prog, p in parsers(build_parser()) + parsers(jobs_parser())
        for a in p._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction) and a.help is None
    ]
    assert not missing, missing
    commands = dict(parsers(build_parser()))
    for name in ("train", "export", "score", "preprocess"):
        assert commands[f"dlrm-vrgd {name}"].epilog.startswith("examples:\n  dlrm-vrgd ")
        shown = cli(name, "-h")
        assert shown.returncode == 0 and "examples:" in shown.stdout
        assert f"dlrm-vrgd {name} " in shown.stdout.split("examples:")[1]
    labels = cli("score", "-h").stdout
    assert "do raw rows start with a label" in " ".join(labels.split())
    states = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "jobs", "list", "-h"],
        capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert "queued, running, succeeded, failed, cancelled" in " ".join(states.split())
