"""Which failures a job is retried after, and from where it resumes.

A job is retried (up to its ``max_retries``) only after an *infrastructure* failure, one that
says nothing about the job itself: a node lost (Slurm NODE_FAIL, BOOT_FAIL), the job preempted,
a process or rank killed by a signal nobody in the service sent, a collective that timed out or
lost its peer. It is never retried after a failure of its own: a config or usage error (exit
status 2), a non-finite loss (``NonFiniteError``), a damaged checkpoint, its time limit, a
cancel. Anything else (a plain exception, exit status 1 without any of the signs above) is not
retried either: retrying a deterministic failure only fails again later.

A failure is classified from the failing task's own exit before any peer's symptom. When one
rank raises a Python error mid-training, the ranks it trained with see their collective lose
its peer ("Connection closed by peer"): that is a consequence, not a cause. So, in order:
Slurm's verdict on the job (NODE_FAIL, BOOT_FAIL, PREEMPTED; its own limits), the exit of the
task srun names first (``srun: error: n2: task 1: ...``: killed by SIGKILL is the
infrastructure's, its own Python error is the job's), then any rank's own Python error, then
a rank killed by a signal, and only then a collective that lost its peer. Only this attempt's
lines count (the log of a retried job holds every attempt's).

A retried train job runs the same command with ``--resume`` in the same run directory (the
command always carries it, so any rerun is idempotent): the trainer resumes from its newest
checkpoint that verifies (:func:`dlrm_vrgd.checkpoint.newest_verified`) and keeps the
records up to it; a study skips its finished cells.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable
from pathlib import Path

from service.jobs import reading
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
    r"DistStoreError|Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"(gloo|nccl)\S*.*timed out|timed out.*(gloo|nccl|allreduce|all_reduce|barrier|collective)",
    re.IGNORECASE,
)
#: srun's word on a lost node: ``srun: error: Node failure on n2``.
_NODE_FAILURE = re.compile(r"Node failure on (\S+)")
#: srun's line on a task that ended badly: ``srun: error: n2: task 1: Exited with exit code 1``
#: (``tasks 0-1: Killed`` for several), in the order the tasks ended.
_TASK_END = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<task>\d+)[-\d,]*: (?P<how>.*)$")
#: The first line of an attempt under the Slurm backend (its batch script echoes it).
_ATTEMPT_START = re.compile(r"^dlrm-vrgd: Slurm job \d+ on ")
#: srun's ``--label`` (``1: ``) and torch's prefix on a rank's uncaught error (``[rank1]: ``).
_TASK_LABEL = re.compile(r"^\s*(?P<task>\d+): ")
_RANK_PREFIX = re.compile(r"^\s*\[rank\d+\]:\s?")
#: The last line of a Python traceback: ``RuntimeError: ...``, ``torch.x.YError: ...``.
_EXCEPTION = re.compile(
    r"^\s*(?P<name>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Interrupted))(:\s|$)"
)
#: Exceptions that say a process was *ended* (by srun, torchrun or a signal), not why the job
#: failed; and torchrun's own wrappers, which repeat a child's failure.
_ENDED_BY_OTHERS = re.compile(
    r"KeyboardInterrupt|RunInterrupted|SignalException|ChildFailedError|SystemExit|"
    r"^torch\.distributed\.elastic\."
)


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
    lines = this_attempt(log_lines)
    own = _own_failure(files, lines)
    if own or exit_code == 2:
        return None
    name = (scheduler_state or "").split()[0].rstrip("+") if scheduler_state else ""
    if name in SLURM_INFRASTRUCTURE:
        node = failed_node(lines)
        return f"{SLURM_INFRASTRUCTURE[name]} on {node}" if node else SLURM_INFRASTRUCTURE[name]
    if name in ("TIMEOUT", "OUT_OF_MEMORY", "DEADLINE", "CANCELLED"):
        return None
    if exit_code is not None and exit_code < 0:
        return f"killed by {signal_name(-exit_code)}"
    first = first_failed_task(lines)
    if first is not None:  # the task that failed first: its own exit before anyone's symptom
        node, task, how = first
        if how.strip() == "Killed":
            return f"a task was killed (task {task} on {node})"
        own_lines = task_lines(lines, task)
        killed = _rank_signal(own_lines)
        if killed is not None:
            return killed
        if own_error(own_lines) is not None:
            return None
    if own_error(lines) is not None:  # any rank's own error: its peers' symptoms follow
        return None
    killed = _rank_signal(lines)
    if killed is not None:
        return killed
    for line in reversed(lines):
        if _COLLECTIVE.search(line):
            return "a collective timed out or lost its peer"
    return None


def this_attempt(log_lines: list[str]) -> list[str]:
    """The lines of the newest attempt: after the last line a Slurm batch script starts with
    (a retried job's log holds every attempt's); all of them where there is none."""
    for i in range(len(log_lines) - 1, -1, -1):
        if _ATTEMPT_START.match(log_lines[i]):
            return log_lines[i:]
    return log_lines


def first_failed_task(lines: list[str]) -> tuple[str, str, str] | None:
    """(node, task, how it ended) of the first task srun said ended badly, if it said so.
    A task srun ended itself (``Terminated``, once another failed) is not a first failure."""
    for line in lines:
        m = _TASK_END.match(line)
        if m and m.group("how").strip() != "Terminated":
            return m.group("node"), m.group("task"), m.group("how")
    return None


def task_lines(lines: list[str], task: str) -> list[str]:
    """The lines srun's ``--label`` gave to ``task``, the label removed."""
    out = []
    for line in lines:
        m = _TASK_LABEL.match(line)
        if m and m.group("task") == task:
            out.append(line[m.end() :])
    return out


def own_error(lines: list[str]) -> str | None:
    """The first Python error a rank raised of its own (a traceback's last line), not one
    that says its peer was lost (a collective) or that it was ended by someone else."""
    for raw in lines:
        m = _TASK_LABEL.match(raw)
        line = raw[m.end() :] if m else raw
        line = _RANK_PREFIX.sub("", line, count=1)
        e = _EXCEPTION.match(line)
        if e is None or _ENDED_BY_OTHERS.search(e.group("name")):
            continue
        if _COLLECTIVE.search(line):
            continue
        return line.strip()
    return None


def _rank_signal(lines: list[str]) -> str | None:
    for line in reversed(lines):
        m = _RANK_SIGNAL.search(line)
        if m:
            if m.group("word"):
                return f"a task was {m.group('word').lower()}"
            code = int(m.group("code") or m.group("sig"))
            return f"a rank was killed by {signal_name(code)}"
    return None


def _own_failure(files: JobFiles, log_lines: list[str]) -> bool:
    """The run said it failed for a reason of its own (NaN loss, bad checkpoint, bad input)."""
    try:  # a planted FIFO, link or deep nesting is refused, never waited on or recursed into
        status = reading.read_json(files.run_dir / "status.json", files.root)
    except (OSError, reading.JobFileError):
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
