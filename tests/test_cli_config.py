"""``dlrm-vrgd config`` (dlrm_vrgd/cli/cmd_config.py) and ``--set`` as the commands read it."""

from __future__ import annotations

from pathlib import Path

import yaml

from .test_cli import cli, write_config


def test_config_command_prints_resolved_config(tmp_path: Path) -> None:
    proc = cli("config", "--config", str(write_config(tmp_path)), "--set", "optim.dense.lr=0.5")
    assert proc.returncode == 0
    assert yaml.safe_load(proc.stdout)["optim"]["dense"]["lr"] == 0.5


def test_set_steps_over_a_files_epochs_and_a_misspelt_set_through_the_cli(
    tmp_path: Path,
) -> None:
    cfg = write_config(tmp_path, run={"epochs": 3, "steps": None})
    done = cli("config", "--config", str(cfg), "--set", "run.steps=30")
    assert done.returncode == 0, done.stderr
    run = yaml.safe_load(done.stdout)["run"]
    assert run["steps"] == 30 and run["epochs"] is None
    bad = cli("train", "--config", str(cfg), "--set", "run.stepz=30", "--out", str(tmp_path / "r"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "--set run.stepz=30: run.stepz:" in bad.stderr and "did you mean run.steps?" in (
        bad.stderr
    )
    assert not (tmp_path / "r").exists()
