"""bench/gpu_check.py's CPU form runs every section end to end (the GPU host runs the same code
at full size), so the first GPU allocation does not meet code that never ran."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_section_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--quick", "--tmp",
         str(tmp_path), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert list(figures) == ["agreement", "syncs", "throughput", "breakdown", "nvidia"]
    assert not any("error" in section for section in figures.values()), figures
    assert figures["agreement"]["ok"] and not figures["agreement"]["problems"]
    assert figures["syncs"] == {"skipped": "no CUDA"}
    assert {"plain", "VR", "vr_over_plain"} <= set(figures["breakdown"])
    assert {"fp32", "tf32", "bf16"} <= set(figures["nvidia"])
    for mode in ("plain/model-bound", "VR/npy", "VR/live"):
        assert figures["throughput"]["rows"][mode]["rows_per_s"] > 0
