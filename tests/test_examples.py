"""examples/: each runs as a user would start it (a subprocess, its defaults) — the CI run."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchrec_dlrm.py"


def run_example(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300
    )
    return proc, time.perf_counter() - t0


@pytest.mark.parametrize("args", [(), ("--tables", "gsnr")], ids=["default", "gsnr-tables"])
def test_torchrec_dlrm_example_runs_and_learns(args: tuple[str, ...]) -> None:
    proc, seconds = run_example(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = re.search(r"^final loss: (\S+)$", proc.stdout, re.M)
    assert final, proc.stdout[-2000:]
    loss = float(final.group(1))
    assert math.isfinite(loss)
    first = float(re.search(r"^step +1 +loss (\S+)$", proc.stdout, re.M).group(1))
    assert loss < first - 0.1  # it trained: from ~0.69 (chance) down
    assert seconds < 60, f"took {seconds:.1f} s"
