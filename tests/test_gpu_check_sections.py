"""bench/gpu_check.py's section runner and sync counter, on the CPU with stand-in sections: a
section that raises does not stop the ones after it, its error and traceback land in ``--json``
and on stdout, and the exit status says so at the end; the sync counter counts every sync
warning (not the first of each line only) and always turns the debug mode off again."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import gpu_check  # noqa: E402


def planted_failure(args: argparse.Namespace) -> dict[str, Any]:
    raise RuntimeError("planted failure")


def run_main(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sections: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """gpu_check.main() on the CPU with ``sections``: its exit status and its JSON."""
    out = tmp_path / "check.json"
    monkeypatch.setattr(gpu_check, "SECTIONS", sections)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--device", "cpu", "--json", str(out)])
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main()
    return exit_.value.code, json.loads(out.read_text())


def test_a_failing_section_is_recorded_and_the_later_ones_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[str] = []

    def fine(name: str) -> Any:
        def section(args: argparse.Namespace) -> dict[str, Any]:
            ran.append(name)
            return {"ok": True}

        return section

    sections = {"agreement": fine("agreement"), "broken": planted_failure, "after": fine("after")}
    code, figures = run_main(monkeypatch, tmp_path, sections)
    assert code == 1
    assert ran == ["agreement", "after"]
    assert list(figures) == ["agreement", "broken", "after"]
    assert figures["after"] == {"ok": True}
    broken = figures["broken"]
    assert broken["error"] == "RuntimeError: planted failure"
    assert "in planted_failure" in broken["traceback"]
    assert broken["traceback"].rstrip().endswith("RuntimeError: planted failure")
    printed = capsys.readouterr().out
    assert "section broken FAILED" in printed and "in planted_failure" in printed
    assert "FAILED sections: broken" in printed


def test_the_exit_status_is_1_when_the_agreement_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    code, _ = run_main(monkeypatch, tmp_path, {"agreement": lambda args: {"ok": False}})
    assert code == 1


def test_the_exit_status_is_0_when_every_section_passes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sections = {"agreement": lambda args: {"ok": True}, "other": lambda args: {"x": 1.5}}
    code, figures = run_main(monkeypatch, tmp_path, sections)
    assert code == 0
    assert figures == {"agreement": {"ok": True}, "other": {"x": 1.5}}


def test_the_json_is_written_after_every_section(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A run cut short (here: interrupted in its second section) keeps the first's figures."""
    out = tmp_path / "check.json"

    def interrupted(args: argparse.Namespace) -> dict[str, Any]:
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu_check, "SECTIONS", {"first": lambda a: {"x": 1}, "cut": interrupted})
    args = argparse.Namespace(device="cpu", json=str(out))
    with pytest.raises(KeyboardInterrupt):
        gpu_check.run_sections(["first", "cut"], args)
    assert json.loads(out.read_text()) == {"first": {"x": 1}}


def test_the_sync_section_is_skipped_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.section_syncs(argparse.Namespace(device="cpu")) == {"skipped": "no CUDA"}
    assert "skipped: no CUDA" in capsys.readouterr().out


def test_count_syncs_counts_every_sync_per_line_and_resets_the_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The debug mode is a stand-in here (no CUDA): it records the modes set, and the step
    warns as torch does on a sync."""
    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step() -> None:
        for _ in range(3):
            warnings.warn(gpu_check.SYNC_WARNING + " (Triggered at x.h:1.)", stacklevel=1)
        warnings.warn("something else", stacklevel=1)

    sites = gpu_check.count_syncs(step)
    assert modes == ["warn", "default"]
    assert list(sites.values()) == [3]
    site = next(iter(sites))
    assert site.startswith("tests/test_gpu_check_sections.py:"), site

    def failing_step() -> None:
        raise RuntimeError("planted")

    with pytest.raises(RuntimeError, match="planted"):
        gpu_check.count_syncs(failing_step)
    assert modes[-1] == "default"
