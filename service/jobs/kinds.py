"""Job kinds: how a job of each kind is prepared and which command runs it.

``train`` runs ``dlrm-vrgd train`` and exports the trained model into ``run/model/`` (the job's
``model`` artifact); ``study`` runs ``dlrm-vrgd study`` (a batch-size sweep: one training per
cell, resumable — a restarted study skips its finished cells); ``score`` runs ``dlrm-vrgd
score`` with a train job's model on files under the data root, writing
``run/predictions.{csv,parquet}`` (and ``.metrics.json`` with labels). Each kind is an
entry of :data:`KINDS` with its command and its initial progress; the runner, store and API
treat every kind alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from dlrm_vrgd.config import SyntheticData, TrainConfig
from dlrm_vrgd.study.config import StudyConfig
from service.jobs.files import JobFiles


@dataclass(frozen=True)
class KindSpec:
    #: Command that runs a job: (python executable, job files, resume?) -> argv.
    command: Callable[[str, JobFiles, bool], list[str]]
    #: Progress known before the job runs (e.g. total_steps) from its resolved config.
    initial_progress: Callable[[dict[str, Any]], dict[str, Any]]


def train_command(python: str, files: JobFiles, resume: bool = False) -> list[str]:
    """``python -m dlrm_vrgd.cli train --config JOB/config.yaml --out JOB/run [--resume]``.

    The CLI itself starts torchrun when ``run.nproc_per_node > 1``.
    """
    cmd = [
        python,
        "-m",
        "dlrm_vrgd.cli",
        "train",
        "--config",
        str(files.config),
        "--out",
        str(files.run_dir),
        "--export-model",
        str(files.model_dir),
    ]
    if resume:
        cmd.append("--resume")
    return cmd


def train_initial_progress(config: dict[str, Any]) -> dict[str, Any]:
    """``total_steps`` when it follows from the config alone (steps set, or synthetic data)."""
    cfg = TrainConfig.model_validate(config)
    if cfg.run.steps is not None:
        return {"total_steps": cfg.run.steps}
    if isinstance(cfg.data, SyntheticData):
        return {"total_steps": cfg.total_steps(cfg.data.train_rows)}
    return {}


def study_command(python: str, files: JobFiles, resume: bool = False) -> list[str]:
    """``python -m dlrm_vrgd.cli study --config JOB/config.yaml --out JOB/run`` (a study always
    resumes: finished cells are skipped)."""
    return [
        python,
        "-m",
        "dlrm_vrgd.cli",
        "study",
        "--config",
        str(files.config),
        "--out",
        str(files.run_dir),
    ]


def study_initial_progress(config: dict[str, Any]) -> dict[str, Any]:
    """A study's steps are its cells."""
    return {"total_steps": len(StudyConfig.model_validate(config).cells())}


def score_command(python: str, files: JobFiles, resume: bool = False) -> list[str]:
    """``python -m dlrm_vrgd.cli score --model MODEL --input ... --out JOB/run/predictions.*``
    from the job's resolved config (absolute paths; a restarted score job starts over)."""
    config = yaml.safe_load(files.config.read_text())
    out = files.run_dir / f"predictions.{config['output_format']}"
    cmd = [python, "-m", "dlrm_vrgd.cli", "score", "--model", config["model_dir"], "--input",
           *config["input_paths"], "--out", str(out), "--overwrite", "--record",
           str(files.run_dir), "--labels", config["labels"]]  # fmt: skip
    if "input_root" in config:  # every input is checked when opened (no links, inside it)
        cmd += ["--input-root", config["input_root"]]
    return cmd + (["--skip-bad-rows"] if config["skip_bad_rows"] else [])


def score_initial_progress(config: dict[str, Any]) -> dict[str, Any]:
    return {}


KINDS: dict[str, KindSpec] = {
    "train": KindSpec(command=train_command, initial_progress=train_initial_progress),
    "study": KindSpec(command=study_command, initial_progress=study_initial_progress),
    "score": KindSpec(command=score_command, initial_progress=score_initial_progress),
}
