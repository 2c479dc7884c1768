"""``dlrm-vrgd preprocess`` on rows pyarrow cannot even report (the wrong field count plus
bytes that are not UTF-8) and on non-UTF-8 values: FILE:LINE: reason, no traceback, and
``--skip-bad-rows`` skips exactly those rows (real processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .test_criteo import ROW, line

GOOD = line(ROW).encode()
FIELDS = GOOD.split(b"\t")
BAD_LINES = {
    "too many fields, not UTF-8": (GOOD + b"\t\xff\xfe", "expected 40 fields (label, I1-I13, "
                                   "C1-C26), found 41 fields"),
    "too few fields, not UTF-8": (b"\t".join(FIELDS[:10] + [b"\xff"]), "I10: "),
    "integer not UTF-8": (b"\t".join(FIELDS[:2] + [b"\xff1"] + FIELDS[3:]), "I2: "),
    "id not UTF-8": (b"\t".join(FIELDS[:20] + [b"\xc3\x28"] + FIELDS[21:]), "C7: "),
}  # fmt: skip


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "preprocess", "--no-progress", *args],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=300,
    )


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_row_pyarrow_cannot_report_is_named_and_skippable(tmp_path: Path, case: str) -> None:
    bad, reason = BAD_LINES[case]
    path = tmp_path / "day_0"
    path.write_bytes(b"\n".join([GOOD] * 9 + [bad] + [GOOD] * 2) + b"\n")  # bad: line 10
    out = tmp_path / "out"
    proc = cli("--input", str(path), "--out", str(out))
    assert proc.returncode == 2
    assert f"error: {path}:10: {reason}" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()

    proc = cli("--input", str(path), "--out", str(out), "--skip-bad-rows")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"skipped 1 malformed rows; first {path}:10: {reason}" in proc.stdout
    assert np.load(out / "day_0_labels.npy").shape == (11, 1)
