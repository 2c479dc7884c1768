"""The Slurm backend: one ``sbatch --parsable`` per job, from a batch script kept in the job's
directory (``slurm.sbatch``), so a user can read exactly what ran.

A train job on ``run.nnodes > 1`` nodes runs one torchrun per node::

    srun --ntasks-per-node=1 --kill-on-bad-exit=1 python -m torch.distributed.run \\
        --nnodes=$SLURM_NNODES --nproc_per_node=P --rdzv_backend=c10d \\
        --rdzv_endpoint=<NodeAddr of the first node>:<port> --rdzv_id=$SLURM_JOB_ID \\
        -m dlrm_vrgd.cli train ...

and each rank runs the CLI directly (it sees torchrun's environment). A single-node job (a
train job with ``run.nnodes`` 1, a study) runs the kind's command under ``srun``, as the local
backend would (the CLI starts torchrun itself for ``nproc_per_node > 1``). Stdout and stderr
of every task go to the job's ``train.log``.

State comes from Slurm's plain-text output, never its JSON (whose schema changes between
releases): ``squeue -h -t all -j IDS -o %i|%T|%r|%N`` while the controller remembers the job,
then ``sacct -X -n -P -o JobID,State,ExitCode``, then the ``jobcomp/filetxt`` file when
accounting is off. :data:`SLURM_STATES` maps every Slurm state to a phase and a reason.
Cancel is ``scancel``; the job counts as ended only once Slurm says so. GPUs come from Slurm
(``--gpus-per-node``); Slurm queues, so the service's concurrency limit does not apply.
Every Slurm command runs with a timeout: a controller that does not answer is an error, never
a hang. The runner's loop, which also ingests the metrics of running jobs, never waits for one:
it reads the controller's health as last seen (:meth:`SlurmBackend.health`, refreshed by
``scontrol ping`` in a thread of its own), and the jobs' states come from a watcher loop of
their own (``service/jobs/runner.py``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.jobs.backends.base import (
    ENDED,
    PENDING,
    RUNNING,
    UNKNOWN,
    AppStatus,
    Backend,
    BackendUnavailable,
    Handle,
    LaunchRequest,
    Outcome,
    Phase,
    ScheduleError,
)
from service.jobs.files import JobFiles
from service.jobs.gpus import gpus_needed
from service.jobs.options import SlurmOptions, memory_mb
from service.jobs.store import Job
from service.settings import Settings

logger = logging.getLogger(__name__)

#: The batch script in the job's directory.
SCRIPT = "slurm.sbatch"
#: Slurm job names: this prefix and the service's job id.
NAME_PREFIX = "dlrm-vrgd-"
COMMANDS = ("sbatch", "squeue", "scancel", "scontrol")
#: The controller's health is asked again once its last answer is this old (seconds).
HEALTH_MAX_AGE_S = 2.0

#: Slurm state -> (phase, outcome of an ended job, what it means). An outcome of None for an
#: ended job means: decide from the run directory (result.json).
SLURM_STATES: dict[str, tuple[Phase, Outcome | None, str]] = {
    "PENDING": (PENDING, None, "queued in Slurm"),
    "CONFIGURING": (PENDING, None, "Slurm is configuring the allocated nodes"),
    "REQUEUED": (PENDING, None, "requeued in Slurm"),
    "REQUEUE_HOLD": (PENDING, None, "requeued and held in Slurm"),
    "REQUEUE_FED": (PENDING, None, "requeued by the Slurm federation"),
    "RESV_DEL_HOLD": (PENDING, None, "held in Slurm: its reservation was deleted"),
    "SPECIAL_EXIT": (PENDING, None, "held in Slurm after a special exit"),
    "RUNNING": (RUNNING, None, "running in Slurm"),
    "COMPLETING": (RUNNING, None, "completing in Slurm (its processes are ending)"),
    "SUSPENDED": (RUNNING, None, "suspended by Slurm"),
    "STOPPED": (RUNNING, None, "stopped by Slurm (SIGSTOP)"),
    "SIGNALING": (RUNNING, None, "being signalled by Slurm"),
    "STAGE_OUT": (RUNNING, None, "staging out in Slurm"),
    "RESIZING": (RUNNING, None, "being resized by Slurm"),
    "COMPLETED": (ENDED, None, "COMPLETED"),
    "FAILED": (ENDED, "failed", "FAILED: a task exited with a non-zero status"),
    "CANCELLED": (ENDED, "cancelled", "CANCELLED"),
    "TIMEOUT": (ENDED, "failed", "TIMEOUT: the job reached its Slurm time limit"),
    "NODE_FAIL": (ENDED, "failed", "NODE_FAIL: a node of the job failed"),
    "PREEMPTED": (ENDED, "failed", "PREEMPTED: Slurm preempted the job"),
    "OUT_OF_MEMORY": (ENDED, "failed", "OUT_OF_MEMORY: a task ran out of memory"),
    "BOOT_FAIL": (ENDED, "failed", "BOOT_FAIL: a node of the job failed to boot"),
    "DEADLINE": (ENDED, "failed", "DEADLINE: the job reached its deadline"),
    "REVOKED": (ENDED, "failed", "REVOKED: a sibling cluster of the federation runs it"),
}
#: sbatch/squeue errors that mean "try again later" rather than "this job is refused".
_UNREACHABLE = re.compile(
    r"unable to contact slurm controller|socket timed out|connection refused|"
    r"communication connection failure|slurm_load_jobs error: (unable|zero bytes|socket)|"
    r"could not establish a configuration source|fetch_config|slurmctld.*down|"
    r"resource temporarily unavailable|munge",
    re.IGNORECASE,
)
_EXIT = re.compile(r"\bExitCode=(\d+):(\d+)")
_NODE_ADDR = r"s/^ *NodeAddr=\([^ ]*\).*/\1/p"
#: ``srun: error: n2: task 1: Exited with exit code 1``
_SRUN_ERROR = re.compile(r"^srun: error: (\S+): tasks? (\d+)[-\d,]*: (.*)$")
#: A line of task N under ``srun --label``: ``1: RuntimeError: ...``.
_LABELLED = re.compile(r"^\s*(\d+): (.*)$")
#: A line that states an error (``RuntimeError: ...``, ``torch.x.YError: ...``).
_ERROR_LINE = re.compile(r"^\s*([\w.]+(Error|Exception)|error):\s")


@dataclass
class SlurmHandle(Handle):
    pass


def slurm_state(raw: str) -> tuple[str, Phase, Outcome | None, str]:
    """(state name, phase, outcome, meaning) of a Slurm state as squeue or sacct print it
    (``CANCELLED by 0``, ``RUNNING``, ``PENDING``); an unknown state counts as running."""
    raw = raw.strip()
    name = raw.split()[0].rstrip("+") if raw else ""
    phase, outcome, meaning = SLURM_STATES.get(
        name, (RUNNING, None, f"in Slurm state {raw or '?'} (not known to this service)")
    )
    if name == "CANCELLED" and raw != name:
        meaning = raw  # "CANCELLED by 1000": who cancelled it
    return name, phase, outcome, meaning


def parse_exit_code(text: str) -> int | None:
    """``ExitCode=4:0`` / ``4:0`` -> 4; ``0:9`` (killed by signal 9) -> -9."""
    m = _EXIT.search(text) or re.fullmatch(r"\s*(\d+):(\d+)\s*", text)
    if m is None:
        return None
    code, sig = int(m.group(1)), int(m.group(2))
    return -sig if sig else code


def _int(text: str) -> int:
    m = re.match(r"\d+", text)
    return int(m.group(0)) if m else 0


def time_limit_minutes(seconds: float) -> int:
    """Slurm counts time limits in whole minutes: round up, at least one."""
    return max(1, math.ceil(seconds / 60))


class SlurmBackend(Backend):
    name = "slurm"
    queues_jobs = True
    enforces_time_limit = True

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._tracked: set[str] = set()
        #: app id -> (state, pending reason, nodes) from the last squeue.
        self._snapshot: dict[str, tuple[str, str, str]] = {}
        self._snapshot_at = -math.inf
        self._snapshot_error: str | None = None
        self._available_at = -math.inf
        self._available: str | None = None
        #: When the background ping in flight started (None: none is).
        self._ping_started: float | None = None
        self._jobcomp: Path | None | bool = False  # False: not looked up yet
        self._named: dict[str, str] = {}
        self._named_at = -math.inf
        #: The runner's watcher describes jobs while its loop submits others: the sets and
        #: the snapshot are shared between threads (never held during a Slurm command).
        self._lock = threading.Lock()
        self._partitions_at = -math.inf
        self._partitions: dict[str, dict[str, Any]] | None = None

    # ----------------------------------------------------------------------- commands
    def _run(
        self, args: Sequence[str], env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command with the configured timeout; BackendUnavailable when it is
        missing or does not answer."""
        timeout = self.settings.slurm_command_timeout_s
        try:
            return subprocess.run(
                list(args),
                capture_output=True,
                text=True,
                timeout=timeout,
                env=dict(env) if env is not None else None,
                stdin=subprocess.DEVNULL,
            )
        except FileNotFoundError:
            raise BackendUnavailable(
                f"Slurm's `{args[0]}` is not installed on the service host "
                f"(PATH={os.environ.get('PATH', '')})"
            ) from None
        except subprocess.TimeoutExpired:
            raise BackendUnavailable(
                f"Slurm did not answer: `{shlex.join(args)}` took more than {timeout:g} s"
            ) from None

    def check(self) -> None:
        missing = [c for c in COMMANDS if shutil.which(c) is None]
        if missing:
            raise BackendUnavailable(
                f"DLRM_VRGD_BACKEND=slurm, but Slurm's {', '.join(missing)} "
                "is not installed on the service host (install Slurm's client commands, "
                "e.g. Debian's slurm-client, or choose DLRM_VRGD_BACKEND=local)"
            )
        problem = self._ping()
        with self._lock:
            self._available, self._available_at = problem, time.monotonic()
        if problem is not None:
            raise BackendUnavailable(problem)

    def _ping(self) -> str | None:
        """None when the controller answers, else why not."""
        try:
            out = self._run(["scontrol", "ping"])
        except BackendUnavailable as err:
            return str(err)
        text = (out.stdout + out.stderr).strip()
        if out.returncode == 0 and " UP" in text:
            return None
        first = text.splitlines()[0] if text else f"exit status {out.returncode}"
        return f"the Slurm controller is unreachable (`scontrol ping`: {first})"

    def available(self) -> str | None:
        """The controller's answer at most :data:`HEALTH_MAX_AGE_S` old: waits for one ``scontrol
        ping`` (up to the command timeout) when the last is older. For the submit path (a
        request thread), so that a submit while the controller is down answers 503."""
        if time.monotonic() - self._available_at > HEALTH_MAX_AGE_S:
            problem = self._ping()
            with self._lock:
                self._available, self._available_at = problem, time.monotonic()
        return self._available

    def health(self) -> str | None:
        """The controller's answer as last seen, never waiting: an answer older than
        :data:`HEALTH_MAX_AGE_S` is refreshed by a ``scontrol ping`` in a thread of its own
        (one at a time). A ping in flight longer than that counts as "not answering", so no
        job is handed to a controller that hangs."""
        now = time.monotonic()
        with self._lock:
            start = now - self._available_at > HEALTH_MAX_AGE_S and self._ping_started is None
            if start:
                self._ping_started = now
            waiting = now - self._ping_started if self._ping_started is not None else 0.0
            known = self._available
        if start:
            threading.Thread(
                target=self._ping_in_background, name="slurm-ping", daemon=True
            ).start()
        if waiting > HEALTH_MAX_AGE_S:
            return f"the Slurm controller has not answered `scontrol ping` for {waiting:.0f} s"
        return known

    def _ping_in_background(self) -> None:
        problem: str | None = "the Slurm controller could not be asked"
        try:
            problem = self._ping()
        finally:
            with self._lock:
                self._available, self._available_at = problem, time.monotonic()
                self._ping_started = None

    # ----------------------------------------------------------------- submit checks
    def partitions(self, max_age_s: float = 30.0) -> dict[str, dict[str, Any]] | None:
        """partition -> {nodes, cpus (most per node), mem_mb (most per node), default}, from
        ``sinfo`` (None when it cannot be asked)."""
        if time.monotonic() - self._partitions_at < max_age_s:
            return self._partitions
        if shutil.which("sinfo") is None:
            return None
        try:
            out = self._run(["sinfo", "-h", "-o", "%P|%D|%c|%m"])
        except BackendUnavailable:
            return None
        if out.returncode != 0:
            return None
        found: dict[str, dict[str, Any]] = {}
        for line in out.stdout.splitlines():
            parts = [p.strip() for p in line.split("|")]
            if len(parts) < 4 or not parts[0]:
                continue
            name, default = parts[0].rstrip("*"), parts[0].endswith("*")
            entry = found.setdefault(name, {"nodes": 0, "cpus": 0, "mem_mb": 0, "default": False})
            entry["default"] = entry["default"] or default
            entry["nodes"] += _int(parts[1])
            entry["cpus"] = max(entry["cpus"], _int(parts[2]))
            entry["mem_mb"] = max(entry["mem_mb"], _int(parts[3]))
        self._partitions, self._partitions_at = found, time.monotonic()
        return found

    def check_request(
        self, kind: str, config: Mapping[str, Any], options: Mapping[str, Any]
    ) -> tuple[str, str] | None:
        """A partition that does not exist, more nodes, CPUs or memory than its nodes have:
        refused at submit (422), from ``sinfo``; what sinfo cannot tell (a QoS limit, an
        account) Slurm says while the job waits, and the job fails within
        ``slurm_infeasible_after_s`` with Slurm's reason."""
        parts = self.partitions()
        if not parts:
            return None
        name = options.get("partition") or self.settings.slurm_partition
        field = "slurm.partition"
        if name is not None:
            names = [n for n in str(name).split(",") if n]
            unknown = [n for n in names if n not in parts]
            if unknown:
                return field, (
                    f"no Slurm partition {unknown[0]!r} in this cluster (sinfo has: "
                    f"{', '.join(sorted(parts))})"
                )
            part = names[0]
        else:
            defaults = [n for n, p in parts.items() if p["default"]]
            if not defaults:
                return None
            part = defaults[0]
        info = parts[part]
        run = config.get("run", {}) if kind == "train" else {}
        nnodes = int(run.get("nnodes", 1) or 1)
        if nnodes > info["nodes"]:
            return "config.run.nnodes", (
                f"asks for {nnodes} nodes; Slurm partition {part} has {info['nodes']} "
                "(PartitionNodeLimit: it could never run)"
            )
        cpus = options.get("cpus_per_task")
        if cpus is not None and info["cpus"] and cpus > info["cpus"]:
            return "slurm.cpus_per_task", (
                f"{cpus} CPUs per task; the nodes of partition {part} have at most {info['cpus']}"
            )
        mem = options.get("mem")
        if mem is not None and info["mem_mb"] and memory_mb(mem) > info["mem_mb"]:
            return "slurm.mem", (
                f"{mem} per node; the nodes of partition {part} have at most {info['mem_mb']} MB"
            )
        return None

    # ----------------------------------------------------------------------- schedule
    def batch_script(self, request: LaunchRequest) -> str:
        """The batch script of a job (its ``#SBATCH`` options and its one ``srun``)."""
        job, files, s = request.job, request.files, self.settings
        run = job.config.get("run", {}) if job.kind == "train" else {}
        nnodes = int(run.get("nnodes", 1))
        nproc = int(run.get("nproc_per_node", 1))
        gpus = gpus_needed(job.config)
        own = SlurmOptions.model_validate(job.scheduler or {})
        opts = [
            f"--job-name={NAME_PREFIX}{job.id}",
            f"--nodes={nnodes}",
            "--ntasks-per-node=1",
            f"--chdir={files.root}",
            f"--output={files.log}",
            "--open-mode=append",
            # the service retries (max_retries) by submitting again, at once: Slurm's own
            # requeue would hold the job for minutes (BeginTime) first
            "--no-requeue",
        ]
        if own.exclusive if own.exclusive is not None else s.slurm_exclusive:
            opts.append("--exclusive")
        if request.time_limit_s:
            opts.append(f"--time={time_limit_minutes(request.time_limit_s)}")
        elif own.time or s.slurm_time_limit:
            opts.append(f"--time={own.time or s.slurm_time_limit}")
        for flag, value, mine in (
            ("--partition", s.slurm_partition, own.partition),
            ("--account", s.slurm_account, own.account),
            ("--qos", s.slurm_qos, own.qos),
        ):
            if value and not mine:
                opts.append(f"{flag}={value}")
        if gpus and own.gpus_per_node is None:
            opts.append(f"--gpus-per-node={s.slurm_gpus_per_node or gpus}")
        opts += own.sbatch_options()
        attempt = job.attempt + 1  # the job as it stood before this submission
        lines = [
            "#!/bin/bash",
            f"# dlrm-vrgd job {job.id} ({job.kind}), written by the service and submitted with",
            f"#   {shlex.join(self._sbatch_args(files))}",
            "# the job's own Slurm options: "
            + (json.dumps(job.scheduler, sort_keys=True) if job.scheduler else "none"),
            f"# max_retries {job.max_retries}; this script is for attempt {attempt} (a rerun "
            "resumes: the command passes --resume)",
            *(f"#SBATCH {o}" for o in opts),
            "set -eu",
        ]
        if nnodes > 1:
            port = s.slurm_rdzv_port
            threads = run.get("threads")
            default_threads = f"$(( cpus / {nproc} > 0 ? cpus / {nproc} : 1 ))"
            torchrun = [
                shlex.quote(request.cmd[0]),
                "-m torch.distributed.run",
                '--nnodes="$SLURM_NNODES"',
                f"--nproc_per_node={nproc}",
                "--max_restarts=0",
                "--rdzv_backend=c10d",
                f'--rdzv_endpoint="$head_addr:{port}"',
                '--rdzv_id="$SLURM_JOB_ID"',
            ]
            lines += [
                "# the rendezvous host: the first node of the allocation, by its NodeAddr",
                'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                f'head_addr=$(scontrol show node "$head_node" | sed -n {shlex.quote(_NODE_ADDR)})',
                "head_addr=${head_addr:-$head_node}",
                "# the cores of a node are shared by its ranks",
                f"cpus=${{SLURM_CPUS_ON_NODE:-{nproc}}}",
                f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{threads or default_threads}}}",
                f'echo "dlrm-vrgd: Slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, '
                f'rendezvous at $head_addr:{port}"',
                # --label: each line says which task (node) wrote it, see explain()
                "exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 --label "
                + " ".join(torchrun)
                + " "
                + shlex.join(request.cmd[1:]),
            ]
        else:
            lines += [
                'echo "dlrm-vrgd: Slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"',
                "exec srun --ntasks=1 --kill-on-bad-exit=1 " + shlex.join(request.cmd),
            ]
        return "\n".join(lines) + "\n"

    def _sbatch_args(self, files: JobFiles) -> list[str]:
        return [
            "sbatch",
            "--parsable",
            *shlex.split(self.settings.slurm_extra_args or ""),
            str(files.root / SCRIPT),
        ]

    def schedule(self, request: LaunchRequest) -> SlurmHandle:
        files = request.files
        files.root.mkdir(parents=True, exist_ok=True)
        script = files.root / SCRIPT
        tmp = script.with_name(f".{SCRIPT}.tmp")
        tmp.write_text(self.batch_script(request))
        os.replace(tmp, script)
        env = {k: v for k, v in request.env.items() if not k.startswith(("SLURM_", "SBATCH_"))}
        if "SLURM_CONF" in os.environ:
            env["SLURM_CONF"] = os.environ["SLURM_CONF"]
        out = self._run(self._sbatch_args(files), env)
        text = (out.stderr or out.stdout).strip()
        if out.returncode != 0:
            if _UNREACHABLE.search(text):
                raise BackendUnavailable(f"sbatch: {text}")
            raise ScheduleError(f"sbatch refused the job: {text}")
        first = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
        app_id = first.split(";")[0]
        if not app_id.isdigit():
            raise ScheduleError(f"sbatch --parsable printed no job id: {out.stdout!r} {text}")
        with self._lock:
            self._tracked.add(app_id)
        self._snapshot_at = -math.inf
        return SlurmHandle(job_id=request.job.id, app_id=app_id)

    # ----------------------------------------------------------------------- describe
    def _refresh(self) -> None:
        with self._lock:
            ids = sorted(self._tracked, key=int)
        self._snapshot_at = time.monotonic()
        if not ids:
            self._snapshot, self._snapshot_error = {}, None
            return
        snapshot: dict[str, tuple[str, str, str]] = {}
        try:
            self._snapshot_error = self._squeue(ids, snapshot)
        finally:
            self._snapshot = snapshot

    def _squeue(self, ids: list[str], snapshot: dict[str, tuple[str, str, str]]) -> str | None:
        """One squeue of ``ids`` into ``snapshot``; why it failed, or None."""
        try:
            out = self._run(["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T|%r|%N"])
        except BackendUnavailable as err:
            return str(err)
        if out.returncode != 0:
            err_text = out.stderr.strip()
            if "invalid job id" not in err_text.lower():
                return f"squeue: {err_text or f'exit status {out.returncode}'}"
            return None
        for line in out.stdout.splitlines():
            parts = line.split("|")
            if len(parts) >= 4 and parts[0].strip() in ids:
                snapshot[parts[0].strip()] = (parts[1].strip(), parts[2].strip(), parts[3].strip())
        return None

    def describe(self, handle: Handle) -> AppStatus:
        app_id = handle.app_id
        with self._lock:
            self._tracked.add(app_id)
        if time.monotonic() - self._snapshot_at >= self.settings.slurm_poll_interval_s:
            self._refresh()
        if self._snapshot_error is not None:
            return AppStatus(UNKNOWN, reason=self._snapshot_error)
        seen = self._snapshot.get(app_id)
        if seen is None:  # the controller forgot it: accounting, then the jobcomp file
            return self._final(app_id, None)
        raw, why, nodes = seen
        name, phase, outcome, meaning = slurm_state(raw)
        if phase == PENDING:
            why = why if why and why != "None" else None
            reason = f"{meaning}: {why}" if why else meaning
            return AppStatus(PENDING, scheduler_state=raw, reason=reason, detail=why)
        if phase == RUNNING:
            return AppStatus(RUNNING, scheduler_state=raw, reason=meaning, nodes=nodes or None)
        return self._final(app_id, raw)

    def _final(self, app_id: str, state: str | None) -> AppStatus:
        """An ended job: its state and exit code, from the best source that still has it."""
        exit_code = None
        if state is not None:
            try:
                out = self._run(["scontrol", "show", "job", "-o", app_id])
                exit_code = parse_exit_code(out.stdout) if out.returncode == 0 else None
            except BackendUnavailable:
                pass
        record = None
        if state is None or exit_code is None:
            record = self._accounting(app_id) or self._jobcomp_record(app_id)
        if record is not None:
            acct_state, acct_exit = record
            # sacct knows who cancelled ("CANCELLED by 0"); squeue does not
            if state is None or acct_state.startswith(state):
                state = acct_state
            exit_code = acct_exit if exit_code is None else exit_code
        if state is None:
            return AppStatus(
                ENDED,
                reason=f"Slurm has no record of job {app_id} any more (no accounting, no "
                "jobcomp file)",
            )
        name, phase, outcome, meaning = slurm_state(state)
        if phase != ENDED:  # accounting lags behind the controller
            return AppStatus(phase, scheduler_state=state, reason=meaning)
        return AppStatus(ENDED, exit_code, scheduler_state=state, outcome=outcome, reason=meaning)

    def _accounting(self, app_id: str) -> tuple[str, int | None] | None:
        if shutil.which("sacct") is None:
            return None
        try:
            out = self._run(["sacct", "-X", "-n", "-P", "-o", "JobID,State,ExitCode", "-j", app_id])
        except BackendUnavailable:
            return None
        if out.returncode != 0:
            return None
        for line in out.stdout.splitlines():
            parts = line.split("|")
            if len(parts) >= 3 and parts[0].strip() == app_id:
                return parts[1].strip(), parse_exit_code(parts[2])
        return None

    def _jobcomp_path(self) -> Path | None:
        if self._jobcomp is False:
            self._jobcomp = None
            try:
                out = self._run(["scontrol", "show", "config"])
            except BackendUnavailable:
                self._jobcomp = False  # ask again next time
                return None
            conf = dict(
                (k.strip(), v.strip())
                for k, _, v in (line.partition("=") for line in out.stdout.splitlines())
            )
            if conf.get("JobCompType") == "jobcomp/filetxt" and conf.get("JobCompLoc"):
                self._jobcomp = Path(conf["JobCompLoc"])
        return self._jobcomp if isinstance(self._jobcomp, Path) else None

    def _jobcomp_record(self, app_id: str) -> tuple[str, int | None] | None:
        path = self._jobcomp_path()
        if path is None:
            return None
        try:
            text = path.read_text(errors="replace")
        except OSError:
            return None
        found = None
        for line in text.splitlines():
            if line.startswith(f"JobId={app_id} "):
                state = re.search(r"\bJobState=(\S+)", line)
                if state:
                    found = (state.group(1), parse_exit_code(line))
        return found

    def explain(self, handle: Handle, files: JobFiles) -> list[str]:
        """srun's line on the first task that failed (``srun: error: n2: task 1: Exited with
        exit code 1``) and the last error that task printed (its lines carry ``1:``)."""
        lines = list(self.log_iter(handle, files, 2000))
        failures = [ln for ln in lines if _SRUN_ERROR.match(ln)]
        if not failures:
            return []
        m = _SRUN_ERROR.match(failures[0])
        assert m is not None
        node, task = m.group(1), m.group(2)
        said = [
            t.group(2)
            for ln in lines
            if (t := _LABELLED.match(ln)) is not None and t.group(1) == task
        ]
        # torchrun's own wrappers (ChildFailedError, SignalException) name no cause
        errors = [
            ln
            for ln in said or lines
            if _ERROR_LINE.match(ln) and "torch.distributed.elastic" not in ln
        ]
        out = [failures[0]]
        if errors:
            out.append(f"{node}: {errors[-1].strip()}" if said else errors[-1].strip())
        return out

    # ------------------------------------------------------------------- cancel, list
    def cancel(self, handle: Handle) -> None:
        logger.info("job %s: scancel %s", handle.job_id, handle.app_id)
        out = self._run(["scancel", handle.app_id])
        if out.returncode != 0:
            logger.warning(
                "job %s: scancel %s: %s", handle.job_id, handle.app_id, out.stderr.strip()
            )
        self._snapshot_at = -math.inf

    def kill(self, handle: Handle) -> None:
        """Slurm ends the job's processes itself (SIGKILL after its KillWait); ask again."""
        self.cancel(handle)

    def settle(self, handle: Handle) -> None:
        with self._lock:
            self._tracked.discard(handle.app_id)

    def recover(self, job: Job) -> SlurmHandle | None:
        app_id = job.slurm_job_id
        if app_id is None:
            app_id = self.list_named().get(job.id)
            if app_id is not None:
                logger.warning("job %s: found Slurm job %s by its name", job.id, app_id)
        if app_id is None:
            return None
        with self._lock:
            self._tracked.add(app_id)
        self._snapshot_at = -math.inf
        return SlurmHandle(job_id=job.id, app_id=app_id)

    def list_named(self, max_age_s: float = 5.0) -> dict[str, str]:
        """service job id -> Slurm job id of the jobs Slurm still holds under our names (one
        ``squeue`` at most every ``max_age_s``)."""
        if time.monotonic() - self._named_at < max_age_s:
            return dict(self._named)
        try:
            out = self._run(["squeue", "-h", "-t", "all", "-o", "%i|%j"])
        except BackendUnavailable:
            return {}
        found = {}
        for line in out.stdout.splitlines():
            app_id, _, name = line.partition("|")
            if name.startswith(NAME_PREFIX):
                found[name[len(NAME_PREFIX) :]] = app_id.strip()
        self._named, self._named_at = found, time.monotonic()
        return dict(found)

    def list(self) -> Sequence[str]:
        return sorted(self.list_named().values(), key=int)
