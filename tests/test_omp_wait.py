"""Importing dlrm_vrgd sets OpenMP's waiting to passive before torch loads (its threads spin
otherwise: ~1 s a micro-batch of a small model on shared cores), unless the user set it."""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = "import dlrm_vrgd, os, torch; print(os.environ['OMP_WAIT_POLICY'])"


def run(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_value is not None:
        env["OMP_WAIT_POLICY"] = env_value
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_passive_unless_set() -> None:
    assert run(None) == "PASSIVE"
    assert run("ACTIVE") == "ACTIVE"
