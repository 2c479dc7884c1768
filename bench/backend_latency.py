"""Latency of the two backends, side by side: seconds from ``POST /jobs`` to the job's first
training step, and from ``POST /jobs/ID/cancel`` to the job reading ``cancelled``.

Starts one service per backend (temporary data directories): ``local``, and ``slurm`` against
the Slurm that ``SLURM_CONF`` names, else against a two-node Slurm emulated on this machine
(``tests/slurm_cluster.py``; needs root and Debian's slurm-wlm + munge). Each round submits the
same tiny long-running job (one node, one rank) to each backend in turn, waits for its first
step, then cancels it. Prints the medians and the Slurm - local difference per measure.
Target: Slurm <= local + 5 s.

    python bench/backend_latency.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from common import REPO, print_table

from service.client import ServiceClient
from service.launcher import LocalService

#: Slurm >= local + this many seconds misses the target.
TARGET_EXTRA_S = 5.0


def long_job() -> dict[str, object]:
    from tests.conftest import tiny_config_dict

    return tiny_config_dict(run={"steps": 100_000, "log_every": 1, "threads": 1})


@contextlib.contextmanager
def slurm_conf() -> Iterator[str | None]:
    """SLURM_CONF of a Slurm that answers: the environment's, else an emulated cluster's."""
    try:
        ping = subprocess.run(
            ["scontrol", "ping"], capture_output=True, text=True, check=False, timeout=15
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        ping = ""
    if "SLURM_CONF" in os.environ and " UP" in ping:
        yield os.environ["SLURM_CONF"]
        return
    from tests.slurm_cluster import SlurmCluster, missing_reason

    reason = missing_reason()
    if reason:
        print(f"no Slurm: {reason}")
        yield None
        return
    cluster = SlurmCluster.start()
    try:
        yield str(cluster.conf)
    finally:
        cluster.stop()


def measure(client: ServiceClient) -> tuple[float, float]:
    """(POST -> first step, cancel -> cancelled) of one job, in seconds."""
    t0 = time.perf_counter()
    job = client.submit("latency", long_job())
    while not (client.job(job["id"])["progress"].get("step") or 0) >= 1:
        if client.job(job["id"])["state"] in ("failed", "cancelled"):
            raise RuntimeError(f"job failed: {client.job(job['id'])['error']}")
        time.sleep(0.05)
    first_step = time.perf_counter() - t0
    t1 = time.perf_counter()
    cancelled = client.cancel(job["id"])
    while cancelled["state"] != "cancelled":
        time.sleep(0.05)
        cancelled = client.job(job["id"])
    return first_step, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    env = {"DLRM_VRGD_POLL_INTERVAL_S": "0.1", "DLRM_VRGD_LOG_LEVEL": "warning"}
    os.environ.setdefault("PYTHONPATH", str(REPO))
    with slurm_conf() as conf, tempfile.TemporaryDirectory() as tmp:
        services = {"local": LocalService.start(Path(tmp) / "local", secrets.token_hex(16), env)}
        if conf is not None:
            slurm_env = {
                **env,
                "SLURM_CONF": conf,
                "DLRM_VRGD_BACKEND": "slurm",
                "DLRM_VRGD_SLURM_POLL_INTERVAL_S": "0.5",
            }
            services["slurm"] = LocalService.start(
                Path(tmp) / "slurm", secrets.token_hex(16), slurm_env
            )
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in services}
        try:
            for _ in range(args.rounds):
                for name, svc in services.items():
                    with svc.client(timeout=120) as client:
                        times[name].append(measure(client))
        finally:
            for svc in services.values():
                svc.stop()
    med = {
        name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts))
        for name, ts in times.items()
    }
    rows = [[name, f"{a:.2f}", f"{b:.2f}"] for name, (a, b) in med.items()]
    if "slurm" in med:
        (la, lb), (sa, sb) = med["local"], med["slurm"]
        rows.append(["slurm - local", f"{sa - la:+.2f}", f"{sb - lb:+.2f}"])
    print(f"medians of {args.rounds} round(s), one-node tiny job, seconds")
    print_table(["backend", "POST -> first step", "cancel -> cancelled"], rows)
    if "slurm" in med:
        worst = max(sa - la, sb - lb)
        verdict = "meets" if worst <= TARGET_EXTRA_S else "MISSES"
        print(f"target slurm <= local + {TARGET_EXTRA_S:g} s: {verdict} (worst {worst:+.2f} s)")


if __name__ == "__main__":
    main()
