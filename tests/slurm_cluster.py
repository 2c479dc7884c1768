"""A real two-node Slurm cluster on this machine, for the Slurm backend's tests.

``slurmctld`` plus ``slurmd -N n1`` and ``slurmd -N n2`` on 127.0.0.1 with ports of their own,
a ``munged`` with a socket of its own, ``jobcomp/filetxt`` for finished jobs (no database).
Everything lives in one scratch directory; the daemons are stopped by their pids.
Needs Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them) and root (slurmd).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "srun")
NODES = ("n1", "n2")
#: CPUs each emulated node claims (the machine's cores are shared by both).
NODE_CPUS = 2

CONF = """\
# written by tests/slurm_cluster.py: two emulated nodes on one machine
ClusterName=dlrmtest
SlurmctldHost={host}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
SlurmUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
MpiDefault=none
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmctldPidFile={dir}/ctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmdSpoolDir={dir}/spool/%n
StateSaveLocation={dir}/state
SlurmctldLogFile={dir}/ctld.log
SlurmdLogFile={dir}/slurmd-%n.log
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.txt
SchedulerParameters=bf_interval=2
# SIGKILL 3 s after SIGTERM (cancel, time limit), not 30
KillWait=3
ReturnToService=2
MailProg=/bin/true
NodeName=n[1-2] NodeHostname={host} NodeAddr=127.0.0.1 Port={node_ports} CPUs={cpus} RealMemory=4000
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
"""


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here; the message says why (the tests skip with it)."""


def missing_reason() -> str | None:
    """Why the cluster cannot start here, or None."""
    missing = [
        d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()
    ]
    if missing:
        return (
            f"SLURM IS NOT INSTALLED ({', '.join(missing)} missing): the Slurm backend is NOT "
            "tested. Install it: apt-get install slurm-wlm munge (.ci/run does)"
        )
    if os.geteuid() != 0:
        return "the emulated Slurm cluster needs root (slurmd): the Slurm backend is NOT tested"
    return None


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive free TCP ports on 127.0.0.1."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise SlurmUnavailable(f"no {n} consecutive free ports")


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    env: dict[str, str]
    pids: dict[str, int] = field(default_factory=dict)

    @classmethod
    def start(cls, timeout: float = 60.0) -> SlurmCluster:
        reason = missing_reason()
        if reason:
            raise SlurmUnavailable(reason)
        root = Path(tempfile.mkdtemp(prefix="dlrm-vrgd-slurm-"))
        root.chmod(0o755)  # munged (user munge) reaches its socket directory through it
        for sub in ("spool/n1", "spool/n2", "state"):
            (root / sub).mkdir(parents=True)
        munge_dir = root / "munge"
        munge_dir.mkdir(mode=0o700)
        shutil.chown(munge_dir, "munge", "munge")
        ctld = _free_ports(1)
        slurmd = _free_ports(1)
        nodes = _free_ports(len(NODES))
        conf = root / "slurm.conf"
        conf.write_text(
            CONF.format(
                host=socket.gethostname(),
                munge_socket=munge_dir / "munge.socket",
                ctld_port=ctld,
                slurmd_port=slurmd,
                dir=root,
                node_ports=f"{nodes}-{nodes + len(NODES) - 1}",
                cpus=NODE_CPUS,
            )
        )
        env = {**os.environ, "SLURM_CONF": str(conf)}
        cluster = cls(root, conf, env)
        try:
            cluster._start_daemons(munge_dir, timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)
        if check and out.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)}: {out.stderr.strip()}\n{self.logs()}")
        return out

    def _start_daemons(self, munge_dir: Path, timeout: float) -> None:
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            self._run("mungekey", "--create", "--keyfile", str(key), check=False)
            shutil.chown(key, "munge", "munge")
        pid_file = munge_dir / "munged.pid"
        self._run(
            "runuser", "-u", "munge", "--", _which("munged"), "--force",
            f"--socket={munge_dir / 'munge.socket'}", f"--pid-file={pid_file}",
            f"--log-file={munge_dir / 'munged.log'}", f"--seed-file={munge_dir / 'seed'}",
        )  # fmt: skip
        self.pids["munged"] = self._wait_pid(pid_file)
        self._run(_which("slurmctld"), "-f", str(self.conf))
        self.pids["slurmctld"] = self._wait_pid(self.root / "ctld.pid")
        for node in NODES:
            self._run(_which("slurmd"), "-f", str(self.conf), "-N", node)
            self.pids[f"slurmd-{node}"] = self._wait_pid(self.root / f"slurmd-{node}.pid")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self._run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in NODES):
                return
            time.sleep(0.3)
        raise SlurmUnavailable(f"the nodes did not come up within {timeout:g} s\n{self.logs()}")

    @staticmethod
    def _wait_pid(path: Path, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
                return int(path.read_text().split()[0])
            time.sleep(0.05)
        raise SlurmUnavailable(f"{path} did not appear")

    def logs(self, lines: int = 15) -> str:
        out = []
        for name in ("ctld.log", "slurmd-n1.log", "slurmd-n2.log"):
            with contextlib.suppress(OSError):
                text = (self.root / name).read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {name}\n" + "\n".join(text))
        return "\n".join(out)

    # ---------------------------------------------------------------------- queries
    def squeue_state(self, slurm_id: str) -> str:
        """The job's state as squeue prints it (``-t all`` keeps ended jobs a while)."""
        out = self._run("squeue", "-h", "-t", "all", "-j", slurm_id, "-o", "%T", check=False)
        return out.stdout.strip()

    def squeue_field(self, slurm_id: str, field: str) -> str:
        """One squeue format field (``%y``: nice, ``%Q``: priority) of the job."""
        out = self._run("squeue", "-h", "-t", "all", "-j", slurm_id, "-o", field, check=False)
        return out.stdout.strip()

    def list_jobs(self) -> list[str]:
        """Ids of every job the controller holds (``-t all``: ended ones a while too)."""
        out = self._run("squeue", "-h", "-t", "all", "-o", "%i", check=False)
        return out.stdout.split()

    def jobcomp(self, slurm_id: str) -> str | None:
        """The jobcomp/filetxt line of a finished job."""
        with contextlib.suppress(FileNotFoundError):
            for line in (self.root / "jobcomp.txt").read_text().splitlines():
                if line.startswith(f"JobId={slurm_id} "):
                    return line
        return None

    def cancel_all(self, timeout: float = 30.0) -> None:
        out = self._run("squeue", "-h", "-o", "%i", check=False)
        ids = out.stdout.split()
        if ids:
            self._run("scancel", *ids, check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._run("squeue", "-h", "-o", "%i", check=False).stdout.split():
                return
            time.sleep(0.2)

    def scontrol(self, *args: str) -> str:
        """``scontrol ARGS`` (its output; errors are the caller's to judge)."""
        out = self._run("scontrol", *args, check=False)
        return (out.stdout + out.stderr).strip()

    def node_state(self, node: str) -> str:
        out = self._run("sinfo", "-h", "-n", node, "-N", "-o", "%t", check=False)
        return out.stdout.strip()

    def heal(self, timeout: float = 60.0) -> None:
        """Every node back in service and the partition as configured (after a test that
        took a node down or changed a limit)."""
        self.scontrol("update", "partitionname=debug", "MaxNodes=UNLIMITED")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [self.node_state(n) for n in NODES]
            if all(s in ("idle", "mix", "alloc") for s in states):
                return
            for node, state in zip(NODES, states, strict=True):
                if state not in ("idle", "mix", "alloc"):
                    self.scontrol("update", f"nodename={node}", "state=resume")
            time.sleep(1)

    def pause_controller(self) -> None:
        os.kill(self.pids["slurmctld"], signal.SIGSTOP)

    def resume_controller(self) -> None:
        os.kill(self.pids["slurmctld"], signal.SIGCONT)

    # ------------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Cancel what runs, then stop the daemons by their pids (slurmd, slurmctld, munged)."""
        if "slurmctld" in self.pids:
            with contextlib.suppress(Exception):
                self.resume_controller()
                self.cancel_all()
        for name in ("slurmd-n1", "slurmd-n2", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"
