"""``dlrm-vrgd demo | serve | jobs`` (dlrm_vrgd/cli/cmd_service.py): registered by name."""

from __future__ import annotations

import subprocess
import sys


def test_service_commands_resolve_and_run_in_a_real_process() -> None:
    """``serve``, ``demo`` and ``jobs`` are registered by name (the trainer package imports no
    service module): every name resolves to a function of the service, and ``dlrm-vrgd jobs``
    reaches the service's own parser through the dispatcher."""
    import importlib
    import inspect

    from dlrm_vrgd.cli.cmd_service import SERVICE_COMMANDS

    assert set(SERVICE_COMMANDS) == {"serve", "demo", "jobs"}
    for command, target in SERVICE_COMMANDS.items():
        module, _, name = target.partition(":")
        assert module.startswith("service."), command
        assert inspect.isfunction(getattr(importlib.import_module(module), name)), target
    out = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "jobs", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "usage: dlrm-vrgd jobs" in out.stdout and "submit" in out.stdout
