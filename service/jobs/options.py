"""Per-job scheduler options (as TorchX's Slurm scheduler has them) and their checks.

Each option becomes one ``#SBATCH`` line of the job's kept ``slurm.sbatch``; a job's option
wins over the service's default (``DLRM_VRGD_SLURM_PARTITION``...). Values are checked by
pattern (nothing reaches a ``#SBATCH`` line that could end it or start another), and the extra
flags by an allow-list: the service owns ``--job-name``, ``--output``, ``--chdir``,
``--nodes``, ``--ntasks*``, ``--requeue`` and ``--time`` (use ``time``) of its jobs.

No option may raise a job above other users' jobs: the service submits for every token holder,
often as root, and Slurm honours an administrator's ``--priority`` and negative ``--nice``
(a two-node Slurm 22.05 took ``--priority=4000000`` and ``--nice=-1000`` from root). So
``--priority`` is refused and ``--nice`` only lowers (``--nice`` or ``--nice=N``, N >= 0).
``--reservation`` stays: Slurm checks a reservation's users even for root.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

#: A partition, account, QoS name (comma lists allowed where Slurm takes them).
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.,-]{1,128}$")]
#: Minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
SlurmTime = Annotated[
    str, StringConstraints(pattern=r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+(:\d{2}){0,2})$")
]
#: A feature expression: ``a100``, ``a100&ib``, ``[rack1|rack2]``, ``a100*2``.
Constraint = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.,&|*\[\]()-]{1,256}$")]
#: Memory per node: a number with an optional K/M/G/T unit (``64G``, ``500000``).
Memory = Annotated[str, StringConstraints(pattern=r"^\d+[KMGT]?$")]
#: A typed GPU request per node: ``4`` or ``a100:4``.
Gpus = Annotated[str, StringConstraints(pattern=r"^([A-Za-z0-9_.-]{1,64}:)?[1-9]\d{0,2}$")]
#: One line of free text (no control characters).
Comment = Annotated[str, StringConstraints(pattern=r'^[^\x00-\x1f\x7f"\\]{1,256}$')]

#: sbatch flags a job may add with ``extra_flags`` (``--flag`` or ``--flag=value``).
EXTRA_FLAGS = frozenset(
    {
        "--begin", "--cores-per-socket", "--cpus-per-gpu", "--distribution", "--exclude",
        "--gres", "--gres-flags", "--hint", "--licenses", "--mail-type", "--mail-user",
        "--mem-bind", "--mem-per-cpu", "--mem-per-gpu", "--network", "--nice", "--nodelist",
        "--overcommit", "--oversubscribe", "--reservation", "--signal",
        "--sockets-per-node", "--spread-job", "--switches", "--threads-per-core", "--tmp",
        "--wckey", "--contiguous", "--use-min-nodes", "--gpu-bind", "--gpu-freq",
        "--cpu-freq", "--core-spec", "--thread-spec", "--prefer", "--cluster-constraint",
    }
)  # fmt: skip
_FLAG = re.compile(r"(--[a-z][a-z-]*)(=[A-Za-z0-9_.,:@+/%&|*\[\]()-]{1,256})?")
#: sbatch flags that would put a job ahead of others' (honoured for an administrator, which the
#: service may submit as): never a job's own to set.
RAISING = {
    "--priority": "sets the job's priority, an administrator's option",
}
#: Slurm's largest nice adjustment.
MAX_NICE = 2147483645


class SlurmOptions(BaseModel):
    """Slurm options of one job; each unset one takes the service's default. Strict types, as
    for the rest of a job's body: ``exclusive: "yes"`` or ``cpus_per_task: "8"`` is a 422."""

    model_config = ConfigDict(extra="forbid", strict=True)

    partition: Name | None = None
    account: Name | None = None
    qos: Name | None = None
    #: ``--time`` (the job's ``timeout_s`` wins when both are given).
    time: SlurmTime | None = None
    constraint: Constraint | None = None
    #: ``--mem``: memory per node.
    mem: Memory | None = None
    cpus_per_task: Annotated[int, Field(ge=1, le=4096)] | None = None
    #: ``--gpus-per-node``: ``4`` or typed, ``a100:4`` (default: the run's nproc_per_node).
    gpus_per_node: Gpus | None = None
    #: ``--exclusive`` (whole nodes); default: the service's DLRM_VRGD_SLURM_EXCLUSIVE.
    exclusive: bool | None = None
    comment: Comment | None = None
    #: More sbatch flags, from an allow-list (``--reservation=maint``, ``--nice=10``).
    extra_flags: list[str] = Field(default_factory=list, max_length=32)

    @field_validator("extra_flags")
    @classmethod
    def _check_flags(cls, flags: list[str]) -> list[str]:
        for i, flag in enumerate(flags):
            m = _FLAG.fullmatch(flag)  # fullmatch: "$" would let a final newline through
            if m is None:
                raise ValueError(
                    f"item {i}: {flag[:80]!r} is not --flag or --flag=value (letters, digits "
                    "and _.,:@+/%&|*[]()- only)"
                )
            name, value = m.group(1), (m.group(2) or "=")[1:]
            if name in RAISING:
                raise ValueError(
                    f"item {i}: {name} would raise the job above other users' jobs "
                    f"({RAISING[name]}): not allowed per job"
                )
            if name not in EXTRA_FLAGS:
                raise ValueError(
                    f"item {i}: {name} is not an allowed sbatch flag (allowed: "
                    f"{', '.join(sorted(EXTRA_FLAGS))})"
                )
            if name == "--nice" and value and not _lowers(value):
                raise ValueError(
                    f"item {i}: {flag[:80]!r}: a job may only lower itself, --nice or "
                    f"--nice=0..{MAX_NICE} (a negative nice would raise it above other users' "
                    "jobs)"
                )
        return flags

    def sbatch_options(self) -> list[str]:
        """The ``#SBATCH`` options these set (``--exclusive`` and ``--time`` excepted: the
        backend weighs them against the service's defaults)."""
        opts = []
        for flag, value in (
            ("--partition", self.partition),
            ("--account", self.account),
            ("--qos", self.qos),
            ("--constraint", self.constraint),
            ("--mem", self.mem),
            ("--cpus-per-task", self.cpus_per_task),
            ("--gpus-per-node", self.gpus_per_node),
        ):
            if value is not None:
                opts.append(f"{flag}={value}")
        if self.comment is not None:  # sbatch splits #SBATCH lines as a shell would
            opts.append(f'--comment="{self.comment}"')
        return opts + list(self.extra_flags)


def _lowers(nice: str) -> bool:
    """A ``--nice`` value that lowers the job (or leaves it): a whole number 0..MAX_NICE."""
    return re.fullmatch(r"\+?\d{1,10}", nice) is not None and int(nice) <= MAX_NICE


def memory_mb(value: str) -> int:
    """``64G`` -> 65536 (Slurm's unit is MB; a bare number is MB)."""
    units = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    if value[-1] in units:
        return int(int(value[:-1]) * units[value[-1]])
    return int(value)
