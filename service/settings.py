"""The service's one settings class, read from ``DLRM_VRGD_*`` environment variables.

Every knob has a default that suits one user on one machine: loopback only, one job at a time,
a data directory under ``$XDG_DATA_HOME`` (``~/.local/share/dlrm-vrgd``). ``dlrm-vrgd serve``
flags override the environment.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, StringConstraints, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.jobs.gpus import GpuError, parse_gpu_spec

ENV_PREFIX = "DLRM_VRGD_"
#: Docker's secrets directory (Compose mounts file secrets there): a file named after a
#: variable, e.g. ``dlrm_vrgd_token``, sets that field when the variable itself is unset, so
#: a token given as a secret shows in no ``docker inspect``. Read only where it exists.
SECRETS_DIR = Path("/run/secrets")
#: Shortest bearer token accepted when the service listens beyond the loopback interface.
MIN_PUBLIC_TOKEN_CHARS = 16
#: A Slurm partition, account or QoS name.
SlurmName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.,-]+$")]
#: A Slurm time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or UNLIMITED.
SlurmTime = Annotated[
    str,
    StringConstraints(
        pattern=r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+(:\d{2}){0,2}|UNLIMITED|INFINITE)$"
    ),
]


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/dlrm-vrgd``, else ``~/.local/share/dlrm-vrgd``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "dlrm-vrgd"


class Settings(BaseSettings):
    """Service configuration; each field ``x`` is read from ``DLRM_VRGD_X``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="ignore",
        frozen=True,
        secrets_dir=SECRETS_DIR if SECRETS_DIR.is_dir() else None,
    )

    #: Where the SQLite store (``service.db``), the token and every job's directory live.
    data_dir: Path = Field(default_factory=default_data_dir)
    #: Files a ``score`` job may read (its ``inputs`` are relative to it); default DATA_DIR/data.
    data_root: Path | None = None
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    #: Bearer token (``DLRM_VRGD_TOKEN``, else the secret file ``dlrm_vrgd_token``); when
    #: unset, one is generated, saved to ``DATA_DIR/token`` and printed.
    token: SecretStr | None = None
    #: Jobs running at once; the rest wait in FIFO order. 0 holds every job in the queue.
    #: With the Slurm backend Slurm queues: any other value hands every job over at once.
    max_concurrent_jobs: Annotated[int, Field(ge=0)] = 1
    #: Default wall-clock limit of a job (a job's own ``timeout_s`` wins); None = no limit.
    job_timeout_s: Annotated[float, Field(gt=0)] | None = None
    #: Retries of a train or study job after an infrastructure failure (a node lost, a rank
    #: killed by a signal, a collective timeout); a job's own ``max_retries`` wins. Score
    #: jobs default to 0.
    max_retries: Annotated[int, Field(ge=0, le=100)] = 1
    #: Seconds between SIGTERM and SIGKILL when a job is cancelled or times out.
    cancel_grace_s: Annotated[float, Field(ge=0)] = 10.0
    #: How often the runner tails run directories and checks processes.
    poll_interval_s: Annotated[float, Field(gt=0, le=10)] = 0.5
    #: Seconds between keep-alive comments on an idle event stream.
    sse_keepalive_s: Annotated[float, Field(gt=0)] = 15.0
    #: Largest request body accepted (bytes); larger ones answer 422 naming ``body``.
    max_body_bytes: Annotated[int, Field(gt=0)] = 1 << 20
    #: Seconds a request body may take to arrive whole (a client that sends less than its
    #: Content-Length gets 408 and the connection is closed, instead of holding it).
    body_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    #: Where a job's ``run.mlflow`` may keep a local store (``sqlite:////DIR/...``,
    #: ``file:///DIR/...``); default ``DATA_DIR/mlflow``. http(s) servers are always allowed.
    mlflow_dir: Path | None = None
    #: Tracking servers that get the service's MLflow credentials (``MLFLOW_TRACKING_USERNAME``
    #: / ``_PASSWORD`` / ``_TOKEN`` of its environment), comma-separated origins:
    #: "https://mlflow.example.com,http://10.0.0.5:5000". A job that exports anywhere else runs
    #: without them (a note on the job says so). Default: none.
    mlflow_credential_servers: str = ""
    #: Where a job's ``run.mlflow.artifact_location`` may point besides the MLflow directory:
    #: comma-separated URI roots ("s3://bucket/mlflow,mlflow-artifacts:/"); a location must be
    #: one of them or below it (same scheme and host, path segments under the root's, no
    #: ``..``). Default: none (local locations under the MLflow directory only).
    mlflow_artifact_roots: str = ""
    #: Seconds a read of a job's file (its log, result, records) may take before the request
    #: answers 503; the read itself runs on a thread of its own.
    file_read_timeout_s: Annotated[float, Field(gt=0, le=600)] = 10.0
    #: Cancel running jobs when the service stops; by default they keep running and are
    #: re-attached at the next start.
    cancel_on_shutdown: bool = False
    #: Niceness added to job processes (0-19) so that the API stays responsive while jobs
    #: keep every core busy; 0 runs jobs at the service's own priority.
    job_nice: Annotated[int, Field(ge=0, le=19)] = 10
    #: Python interpreter that runs the trainer (``python -m dlrm_vrgd.cli train ...``).
    trainer_python: str = sys.executable
    log_level: str = "info"
    #: GPUs the runner hands out to jobs, one job per GPU (``CUDA_VISIBLE_DEVICES`` values):
    #: "0,1,2,3", "none", or "auto" (``nvidia-smi -L``'s GPUs; none without nvidia-smi).
    gpus: str = "auto"
    #: Let a later queued job start while an earlier one waits for GPUs (backfill); off keeps
    #: strict FIFO order: a job waiting for GPUs holds back the jobs behind it.
    gpu_backfill: bool = False
    #: Memory a job may use on one node, in bytes; jobs whose estimate (dlrm_vrgd.resources)
    #: exceeds it are refused with 422. Default: this host's memory (or its cgroup limit).
    job_memory_bytes: Annotated[int, Field(gt=0)] | None = None
    #: Where job directories live (default ``DATA_DIR/jobs``). A multi-node job needs them on
    #: storage that every node mounts at the same path; the SQLite store stays in DATA_DIR.
    jobs_root: Path | None = None

    #: What runs jobs: "local" (processes on this host) or "slurm" (one ``sbatch`` per job;
    #: the job directories must sit on a file system every node mounts at the same path).
    backend: Literal["local", "slurm"] = "local"
    #: Slurm: ``--partition``, ``--account``, ``--qos`` of every job (unset: Slurm's default).
    slurm_partition: SlurmName | None = None
    slurm_account: SlurmName | None = None
    slurm_qos: SlurmName | None = None
    #: Slurm: ``--time`` of a job without a timeout of its own, in Slurm's format
    #: ("30", "4:00:00", "2-00:00:00"); a job's ``timeout_s`` wins (rounded up to minutes).
    slurm_time_limit: SlurmTime | None = None
    #: Slurm: ``--gpus-per-node`` of a CUDA job (default: its ``run.nproc_per_node``).
    slurm_gpus_per_node: Annotated[int, Field(ge=1)] | None = None
    #: Slurm: more ``sbatch`` arguments, as a shell would split them ("--constraint=a100").
    slurm_extra_args: str = ""
    #: Slurm: the c10d rendezvous port on the first node of a multi-node job.
    slurm_rdzv_port: Annotated[int, Field(ge=1, le=65535)] = 29500
    #: Slurm: whole nodes per job (``--exclusive``), as multi-node training wants.
    slurm_exclusive: bool = True
    #: Slurm: seconds between two looks at the queue (one ``squeue`` for every job).
    slurm_poll_interval_s: Annotated[float, Field(gt=0, le=60)] = 2.0
    #: Slurm: seconds a job may wait with a reason that says it can never run as asked
    #: (PartitionNodeLimit, ReqNodeNotAvail...) before it fails with that reason.
    slurm_infeasible_after_s: Annotated[float, Field(ge=0)] = 60.0
    #: Slurm: a Slurm command that takes longer counts as "Slurm unreachable".
    slurm_command_timeout_s: Annotated[float, Field(gt=0, le=300)] = 15.0

    @field_validator("slurm_extra_args")
    @classmethod
    def _check_extra_args(cls, value: str) -> str:
        try:
            shlex.split(value)
        except ValueError as err:
            raise ValueError(f"not a shell word list: {err}") from None
        return value

    @field_validator("mlflow_credential_servers")
    @classmethod
    def _check_servers(cls, value: str) -> str:
        from service.jobs.tracking import parse_origins

        parse_origins(value)
        return value

    @field_validator("mlflow_artifact_roots")
    @classmethod
    def _check_roots(cls, value: str) -> str:
        from service.jobs.tracking import parse_roots

        parse_roots(value)
        return value

    @field_validator("gpus")
    @classmethod
    def _check_gpus(cls, value: str) -> str:
        try:
            parse_gpu_spec(value)
        except GpuError as err:
            raise ValueError(str(err)) from None
        return value

    @property
    def db_path(self) -> Path:
        return self.data_dir / "service.db"

    @property
    def inputs_root(self) -> Path:
        return self.data_root or self.data_dir / "data"

    @property
    def jobs_dir(self) -> Path:
        return self.jobs_root or self.data_dir / "jobs"

    @property
    def mlflow_root(self) -> Path:
        return self.mlflow_dir or self.data_dir / "mlflow"

    @property
    def token_path(self) -> Path:
        return self.data_dir / "token"

    @property
    def lock_path(self) -> Path:
        return self.data_dir / "service.lock"

    @property
    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
