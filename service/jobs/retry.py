"""Which failures a job is retried after, and from where it resumes.

A job is retried (up to its ``max_retries``) only after an *infrastructure* failure, one that
says nothing about the job itself: a node lost (Slurm NODE_FAIL, BOOT_FAIL), the job preempted,
a process or rank killed by a signal nobody in the service sent, a collective that timed out or
lost its peer. It is never retried after a failure of its own: a config or usage error (exit
status 2), a non-finite loss (``NonFiniteError``), a damaged checkpoint, its time limit, a
cancel. Anything else (a plain exception, exit status 1 without any of the signs above) is not
retried either: retrying a deterministic failure only fails again later.

A retried train job runs the same command with ``--resume`` in the same run directory (the
command always carries it, so any rerun is idempotent): the trainer resumes from its newest
checkpoint that verifies (:func:`dlrm_vrgd.checkpoint.newest_verified`) and keeps the
records up to it; a study skips its finished cells.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterable
from pathlib import Path

from service.jobs.files import JobFiles

#: Slurm verdicts on an ended job that are the infrastructure's doing.
SLURM_INFRASTRUCTURE = {
    "NODE_FAIL": "NODE_FAIL",
    "BOOT_FAIL": "BOOT_FAIL",
    "PREEMPTED": "PREEMPTED",
}
#: Signs of the job's own failure: never retried.
_OWN_FAILURE = re.compile(r"NonFiniteError|CheckpointError|ConfigError|^error: ", re.MULTILINE)
#: torchrun's summary of a rank killed by SIGKILL (``exitcode  : -9``, ``Signal 9 (SIGKILL)
#: received by PID``: the OOM killer, a node agent, a lost host), srun's for a task (``task 1:
#: Killed``). Not SIGTERM: that is how srun and torchrun end the *other* ranks once one failed.
_RANK_SIGNAL = re.compile(
    r"exitcode\s*:\s*-(?P<code>9)\b|Signal (?P<sig>9) \(SIGKILL\) received by PID|"
    r"task \d+: (?P<word>Killed)\s*$"
)
#: A collective that timed out or lost its peer (the other side of a lost rank or node).
_COLLECTIVE = re.compile(
    r"collective operation timeout|Watchdog caught|DistBackendError|DistNetworkError|"
    r"Connection closed by peer|Connection reset by peer|"
    r"(gloo|nccl)\S*.*timed out|timed out.*(gloo|nccl|allreduce|all_reduce|barrier|collective)",
    re.IGNORECASE,
)
#: srun's word on a lost node: ``srun: error: Node failure on n2``.
_NODE_FAILURE = re.compile(r"Node failure on (\S+)")


def signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def failed_node(log_lines: Iterable[str]) -> str | None:
    """The node srun said failed, if it said so."""
    for line in log_lines:
        m = _NODE_FAILURE.search(line)
        if m:
            return m.group(1)
    return None


def infrastructure_cause(
    exit_code: int | None,
    log_lines: list[str],
    files: JobFiles,
    scheduler_state: str | None = None,
) -> str | None:
    """Why a failed attempt failed, when that is the infrastructure's doing (the job may be
    retried), else None. ``log_lines``: the end of the job's log."""
    own = _own_failure(files, log_lines)
    if own or exit_code == 2:
        return None
    name = (scheduler_state or "").split()[0].rstrip("+") if scheduler_state else ""
    if name in SLURM_INFRASTRUCTURE:
        node = failed_node(log_lines)
        return f"{SLURM_INFRASTRUCTURE[name]} on {node}" if node else SLURM_INFRASTRUCTURE[name]
    if name in ("TIMEOUT", "OUT_OF_MEMORY", "DEADLINE", "CANCELLED"):
        return None
    if exit_code is not None and exit_code < 0:
        return f"killed by {signal_name(-exit_code)}"
    for line in reversed(log_lines):
        m = _RANK_SIGNAL.search(line)
        if m:
            if m.group("word"):
                return f"a task was {m.group('word').lower()}"
            code = int(m.group("code") or m.group("sig"))
            return f"a rank was killed by {signal_name(code)}"
    for line in reversed(log_lines):
        if _COLLECTIVE.search(line):
            return "a collective timed out or lost its peer"
    return None


def _own_failure(files: JobFiles, log_lines: list[str]) -> bool:
    """The run said it failed for a reason of its own (NaN loss, bad checkpoint, bad input)."""
    try:
        status = json.loads((files.run_dir / "status.json").read_text())
    except (OSError, ValueError):
        status = None
    if isinstance(status, dict) and _OWN_FAILURE.search(str(status.get("error", ""))):
        return True
    return any(_OWN_FAILURE.search(line) for line in log_lines)


def resume_step(run_dir: Path) -> int:
    """The step the next attempt resumes from: that of the newest checkpoint that verifies
    (what the trainer's ``--resume`` picks), 0 when there is none."""
    from dlrm_vrgd import checkpoint as ckpt  # imports torch: only when retrying

    try:
        latest, _ = ckpt.newest_verified(run_dir)
    except (ckpt.CheckpointError, OSError, ValueError):
        return 0
    if latest is None:
        return 0
    m = re.search(r"(\d+)$", latest.name)
    return int(m.group(1)) if m else 0
