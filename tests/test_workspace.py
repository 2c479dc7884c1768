"""What the guides write into the checkout (runs/, models/, data/) is ignored by git, and
``make clean`` removes the outputs (runs/, models/; data/ holds inputs a user may have
downloaded and stays)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", ["runs/demo/metrics.jsonl", "models/criteo_small/weights.pt",
                                  "data/criteo_10k.txt"])  # fmt: skip
def test_guide_outputs_are_ignored(path: str) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(
        ["git", "check-ignore", "-q", path], cwd=ROOT, capture_output=True, timeout=30
    )
    assert done.returncode == 0, f"{path} is not ignored"


def test_make_clean_removes_runs_and_models() -> None:
    recipe = re.search(r"^clean:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe is not None
    removed = recipe.group(1).split()
    assert "runs" in removed and "models" in removed and "data" not in removed
