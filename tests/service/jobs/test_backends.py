"""The backends without a cluster: Slurm's states and exit codes as the service reads them, the
batch script it writes, how it finds a failed node's error, the store columns it adds."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from service.jobs.backends import make_backend
from service.jobs.backends.base import ENDED, PENDING, RUNNING, LaunchRequest
from service.jobs.backends.local import LocalBackend
from service.jobs.backends.slurm import (
    SLURM_STATES,
    SlurmBackend,
    SlurmHandle,
    parse_exit_code,
    slurm_state,
    time_limit_minutes,
)
from service.jobs.files import JobFiles
from service.jobs.store import Job, Store
from service.settings import Settings

from ...conftest import tiny_config_dict

#: Every state of Slurm 22.05's job_state_string() and what the service makes of it.
EXPECTED = {
    "PENDING": (PENDING, None),
    "CONFIGURING": (PENDING, None),
    "REQUEUED": (PENDING, None),
    "REQUEUE_HOLD": (PENDING, None),
    "REQUEUE_FED": (PENDING, None),
    "RESV_DEL_HOLD": (PENDING, None),
    "SPECIAL_EXIT": (PENDING, None),
    "RUNNING": (RUNNING, None),
    "COMPLETING": (RUNNING, None),
    "SUSPENDED": (RUNNING, None),
    "STOPPED": (RUNNING, None),
    "SIGNALING": (RUNNING, None),
    "STAGE_OUT": (RUNNING, None),
    "RESIZING": (RUNNING, None),
    "COMPLETED": (ENDED, None),
    "FAILED": (ENDED, "failed"),
    "CANCELLED": (ENDED, "cancelled"),
    "TIMEOUT": (ENDED, "failed"),
    "NODE_FAIL": (ENDED, "failed"),
    "PREEMPTED": (ENDED, "failed"),
    "OUT_OF_MEMORY": (ENDED, "failed"),
    "BOOT_FAIL": (ENDED, "failed"),
    "DEADLINE": (ENDED, "failed"),
    "REVOKED": (ENDED, "failed"),
}


def test_every_slurm_state_maps_to_a_phase_and_a_reason() -> None:
    assert set(SLURM_STATES) == set(EXPECTED)
    for raw, (phase, outcome) in EXPECTED.items():
        name, got_phase, got_outcome, meaning = slurm_state(raw)
        assert (name, got_phase, got_outcome) == (raw, phase, outcome)
        if phase == ENDED and raw != "COMPLETED":
            assert meaning.startswith(raw)  # the reason starts with Slurm's own word


def test_cancelled_by_a_user_keeps_who_and_unknown_states_count_as_running() -> None:
    assert slurm_state("CANCELLED by 1000") == (
        "CANCELLED",
        ENDED,
        "cancelled",
        "CANCELLED by 1000",
    )
    assert slurm_state("COMPLETED+")[:2] == ("COMPLETED", ENDED)
    name, phase, outcome, meaning = slurm_state("NEW_IN_23_11")
    assert phase == RUNNING and outcome is None and "NEW_IN_23_11" in meaning


@pytest.mark.parametrize(
    "text,code",
    [("0:0", 0), ("4:0", 4), ("0:9", -9), ("ExitCode=1:0 DerivedExitCode=0:0", 1), ("?", None)],
)
def test_exit_codes(text: str, code: int | None) -> None:
    assert parse_exit_code(text) == code


def test_time_limits_round_up_to_whole_minutes() -> None:
    assert [time_limit_minutes(s) for s in (1, 59.5, 60, 61, 3600)] == [1, 1, 1, 2, 60]


def _job(config: dict, kind: str = "train") -> Job:
    now = datetime.now(UTC)
    return Job(
        "abc123", "n", kind, "queued", config, now, None, None, None, None, None, None, None, None
    )


def test_batch_script_of_a_multi_node_gpu_job(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        backend="slurm",
        slurm_partition="gpu",
        slurm_account="recsys",
        slurm_qos="high",
        slurm_rdzv_port=29555,
        slurm_extra_args="--constraint=a100 --reservation='my res'",
    )
    config = tiny_config_dict(run={"nnodes": 4, "nproc_per_node": 8, "device": "cuda"})
    files = JobFiles(tmp_path / "jobs" / "abc123")
    cmd = ["/venv/bin/python", "-m", "dlrm_vrgd.cli", "train", "--config", "c y.yaml"]
    request = LaunchRequest(_job(config), files, cmd, {}, (), 7200)
    script = SlurmBackend(settings).batch_script(request)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for option in (
        "--job-name=dlrm-vrgd-abc123",
        "--nodes=4",
        "--ntasks-per-node=1",
        f"--output={files.log}",
        "--exclusive",
        "--time=120",
        "--partition=gpu",
        "--account=recsys",
        "--qos=high",
        "--gpus-per-node=8",
    ):
        assert f"#SBATCH {option}" in lines
    assert (
        f"#   sbatch --parsable --constraint=a100 '--reservation=my res' {files.root}/slurm.sbatch"
        in lines
    )
    srun = lines[-1]
    assert srun.startswith(
        "exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 --label /venv/bin/python"
    )
    assert '--nnodes="$SLURM_NNODES" --nproc_per_node=8 --max_restarts=0' in srun
    assert (
        '--rdzv_backend=c10d --rdzv_endpoint="$head_addr:29555" --rdzv_id="$SLURM_JOB_ID"' in srun
    )
    assert srun.endswith("-m dlrm_vrgd.cli train --config 'c y.yaml'")
    assert "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cpus / 8 > 0 ? cpus / 8 : 1 ))}" in lines


def test_batch_script_of_a_single_node_cpu_job_runs_the_command_under_one_srun(
    tmp_path: Path,
) -> None:
    settings = Settings(data_dir=tmp_path, backend="slurm", slurm_time_limit="4:00:00")
    files = JobFiles(tmp_path / "j")
    request = LaunchRequest(_job(tiny_config_dict()), files, ["py", "-m", "x"], {}, (), None)
    script = SlurmBackend(settings).batch_script(request)
    assert "#SBATCH --time=4:00:00" in script and "--gpus-per-node" not in script
    assert "#SBATCH --nodes=1" in script and "--partition" not in script
    assert script.splitlines()[-1] == "exec srun --ntasks=1 --kill-on-bad-exit=1 py -m x"


def test_a_jobs_own_slurm_options_win_over_the_services_and_each_is_one_sbatch_line(
    tmp_path: Path,
) -> None:
    """Every per-job option (issue 27 item 3) lands in the batch script as its own #SBATCH
    line, replacing the service's default for it, and the header records them all."""
    settings = Settings(
        data_dir=tmp_path,
        backend="slurm",
        slurm_partition="gpu",
        slurm_account="recsys",
        slurm_qos="high",
        slurm_exclusive=False,
        slurm_time_limit="4:00:00",
    )
    own = {
        "partition": "a100",
        "account": "ml",
        "qos": "low",
        "time": "1-00:00:00",
        "constraint": "a100&ib",
        "mem": "64G",
        "cpus_per_task": 8,
        "gpus_per_node": "a100:4",
        "exclusive": True,
        "comment": "nightly run",
        "extra_flags": ["--reservation=maint", "--nice=10"],
    }
    job = _job(tiny_config_dict(run={"nnodes": 2, "nproc_per_node": 4, "device": "cuda"}))
    files = JobFiles(tmp_path / "j")
    request = LaunchRequest(replace(job, scheduler=own), files, ["py", "-m", "x"], {}, (), None)
    lines = SlurmBackend(settings).batch_script(request).splitlines()
    sbatch = [ln.removeprefix("#SBATCH ") for ln in lines if ln.startswith("#SBATCH ")]
    for option in (
        "--partition=a100",
        "--account=ml",
        "--qos=low",
        "--time=1-00:00:00",
        "--constraint=a100&ib",
        "--mem=64G",
        "--cpus-per-task=8",
        "--gpus-per-node=a100:4",
        "--exclusive",
        '--comment="nightly run"',
        "--reservation=maint",
        "--nice=10",
    ):
        assert sbatch.count(option) == 1, (option, sbatch)
    for flag in ("--partition", "--account", "--qos", "--time", "--gpus-per-node"):
        assert len([o for o in sbatch if o.startswith(flag + "=")]) == 1, (flag, sbatch)
    assert "# the job's own Slurm options: " + json.dumps(own, sort_keys=True) in lines
    # without own options the service's defaults apply (and its exclusive=False)
    request = LaunchRequest(job, files, ["py", "-m", "x"], {}, (), None)
    plain = SlurmBackend(settings).batch_script(request).splitlines()
    for option in ("--partition=gpu", "--account=recsys", "--qos=high", "--time=4:00:00",
                   "--gpus-per-node=4"):  # fmt: skip
        assert f"#SBATCH {option}" in plain
    assert "#SBATCH --exclusive" not in plain


def test_the_failed_nodes_error_is_found_in_a_labelled_log(tmp_path: Path) -> None:
    files = JobFiles(tmp_path)
    files.log.write_text(
        "0: [rank 0] step 1\n"
        "1: Traceback (most recent call last):\n"
        "1: RuntimeError: CUDA error: an illegal memory access was encountered\n"
        "1: torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "srun: error: gpu-17: task 1: Exited with exit code 1\n"
        "0: torch.distributed.elastic.multiprocessing.api.SignalException: got signal: 15\n"
        "0: RuntimeError: Connection closed by peer\n"
        "srun: error: gpu-03: task 0: Exited with exit code 1\n"
    )
    backend = SlurmBackend(Settings(data_dir=tmp_path, backend="slurm"))
    assert backend.explain(SlurmHandle("j", "12"), files) == [
        "srun: error: gpu-17: task 1: Exited with exit code 1",
        "gpu-17: RuntimeError: CUDA error: an illegal memory access was encountered",
    ]


def test_the_backend_setting_picks_the_backend(tmp_path: Path) -> None:
    assert isinstance(make_backend(Settings(data_dir=tmp_path)), LocalBackend)
    assert isinstance(make_backend(Settings(data_dir=tmp_path, backend="slurm")), SlurmBackend)
    with pytest.raises(ValueError, match="backend"):
        Settings(data_dir=tmp_path, backend="kubernetes")  # type: ignore[arg-type]


def test_a_store_from_before_backends_gets_the_new_columns(tmp_path: Path) -> None:
    db = tmp_path / "service.db"
    Store(db).close()
    with sqlite3.connect(db) as conn:  # as an older service left it: no backend columns
        conn.execute("ALTER TABLE jobs DROP COLUMN backend")
        conn.execute("ALTER TABLE jobs DROP COLUMN slurm_job_id")
        conn.execute(
            "INSERT INTO jobs (id, name, kind, state, config, created_at, progress, "
            "metrics_offset, gsnr_offset, next_seq) VALUES ('old', 'n', 'train', 'succeeded', "
            "'{}', '2026-01-01 00:00:00', '{}', 0, 0, 1)"
        )
    store = Store(db)
    try:
        old = store.get_job("old")
        assert old is not None and old.backend is None and old.slurm_job_id is None
        assert store.set_if_state("old", ["queued"], slurm_job_id="5") is None  # not queued
        assert store.set_if_state("old", ["succeeded"], slurm_job_id="5").slurm_job_id == "5"
    finally:
        store.close()


def test_a_job_slurmctld_forgot_is_read_from_the_jobcomp_file(tmp_path: Path) -> None:
    """Lines as Slurm 22.05's jobcomp/filetxt wrote them here (the last one of a job wins)."""
    jobcomp = tmp_path / "jobcomp.txt"
    jobcomp.write_text(
        "JobId=1 UserId=root(0) GroupId=root(0) Name=j.sh JobState=FAILED Partition=debug "
        "TimeLimit=525600 NodeList=n[1-2] NodeCnt=2 DerivedExitCode=4:0 ExitCode=4:0 \n"
        "JobId=12 UserId=root(0) Name=dlrm-vrgd-x JobState=REQUEUED ExitCode=0:0 \n"
        "JobId=12 UserId=root(0) Name=dlrm-vrgd-x JobState=TIMEOUT ExitCode=0:15 \n"
    )
    backend = SlurmBackend(Settings(data_dir=tmp_path, backend="slurm"))
    backend._jobcomp = jobcomp  # as `scontrol show config` names it (JobCompLoc)
    assert backend._jobcomp_record("1") == ("FAILED", 4)
    assert backend._jobcomp_record("12") == ("TIMEOUT", -15)
    assert backend._jobcomp_record("2") is None


@pytest.mark.parametrize("plant", ["fifo", "link"])
def test_a_log_the_service_will_not_read_is_one_line_in_a_jobs_reason(
    tmp_path: Path, plant: str
) -> None:
    """A job's error quotes its last log lines: a FIFO (which a read would wait on forever) or a
    link planted as train.log is named instead of read."""
    import os

    backend = LocalBackend(Settings(data_dir=tmp_path))
    files = JobFiles(tmp_path / "jobs" / "0123456789abcdef")
    files.root.mkdir(parents=True)
    (tmp_path / "host.txt").write_text("HOST-SECRET\n")
    if plant == "fifo":
        os.mkfifo(files.log)
    else:
        files.log.symlink_to(tmp_path / "host.txt")
    lines = list(backend.log_iter(None, files, 20))  # type: ignore[arg-type]
    why = "a FIFO" if plant == "fifo" else "a symbolic link"
    assert lines == [f"(train.log: {why}; refused)"]
