"""Load on the control service: many clients polling a job's state and metrics while it trains.

Starts a service on a free loopback port (temporary data directory), submits the demo job
(configs/demo.yaml with VR-* optimizers: it writes metrics and GSNR records every step), waits
until it trains, then runs N asyncio clients for S seconds; each one, every `--interval`
seconds, GETs the job and its downsampled metric series (`?max_points=200`), as a dashboard
would; clients start at random offsets within one interval, not in lockstep. Prints errors and
latency percentiles per endpoint (client-side, from request to parsed body); then cancels the
job and stops the service. Target: no errors, p99 < 100 ms.

    python bench/service_load.py [--clients 50] [--seconds 30] [--interval 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from common import REPO, print_table

from dlrm_vrgd.config import load_config
from service.demo import with_vr
from service.launcher import LocalService


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def client_loop(
    base: str,
    token: str,
    job_id: str,
    until: float,
    interval: float,
    latencies: dict[str, list[float]],
    errors: list[str],
) -> None:
    paths = {
        "GET /jobs/{id}": f"/api/v1/jobs/{job_id}",
        "GET /jobs/{id}/metrics?max_points=200": f"/api/v1/jobs/{job_id}/metrics?max_points=200",
    }
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=10) as http:
        await http.get("/api/v1/health")  # connect before the clock starts
        await asyncio.sleep(random.uniform(0, interval))  # clients are not in lockstep
        while time.monotonic() < until:
            start = time.monotonic()
            for name, path in paths.items():
                t0 = time.perf_counter()
                try:
                    response = await http.get(path)
                    response.json()
                    if response.status_code != 200:
                        errors.append(f"{name}: HTTP {response.status_code}")
                except (httpx.HTTPError, ValueError) as err:
                    errors.append(f"{name}: {type(err).__name__}: {err}")
                latencies[name].append(time.perf_counter() - t0)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - start)))


async def load(base: str, token: str, job_id: str, args: argparse.Namespace) -> tuple:
    latencies: dict[str, list[float]] = {
        "GET /jobs/{id}": [],
        "GET /jobs/{id}/metrics?max_points=200": [],
    }
    errors: list[str] = []
    until = time.monotonic() + args.seconds
    await asyncio.gather(
        *(
            client_loop(base, token, job_id, until, args.interval, latencies, errors)
            for _ in range(args.clients)
        )
    )
    return latencies, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    args = ap.parse_args()

    cfg = with_vr(load_config(REPO / "configs" / "demo.yaml", ["run.epochs=3"]))
    token = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="service-load-") as tmp:
        svc = LocalService.start(Path(tmp) / "data", token, env={"DLRM_VRGD_LOG_LEVEL": "warning"})
        try:
            with svc.client() as client:
                job = client.submit("load-bench", cfg.to_dict())
                deadline = time.monotonic() + 120
                while (client.job(job["id"])["progress"].get("step") or 0) < 1:
                    if time.monotonic() > deadline:
                        raise SystemExit("the job did not start training within 120 s")
                    time.sleep(0.5)
                step0 = client.job(job["id"])["progress"]["step"]
                t0 = time.monotonic()
                latencies, errors = asyncio.run(load(svc.base_url, token, job["id"], args))
                wall = time.monotonic() - t0
                after = client.job(job["id"])
                points = client.metrics(job["id"])["count"]
                client.cancel(job["id"])
        finally:
            svc.stop()

    total = sum(len(v) for v in latencies.values())
    print(
        f"{args.clients} clients x {args.seconds:.0f} s, each polling every {args.interval:g} s "
        f"while the demo job trains ({after['progress']['step'] - step0} steps trained meanwhile, "
        f"{points} metric records stored)"
    )
    print(
        f"requests {total}  ({total / wall:.0f}/s)  errors {len(errors)}  "
        f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    )
    for err in sorted(set(errors))[:10]:
        print(f"  error: {err}")
    rows = []
    for name, values in [*latencies.items(), ("all", [x for v in latencies.values() for x in v])]:
        ms = [v * 1e3 for v in values]
        rows.append(
            [
                name,
                len(ms),
                statistics.median(ms),
                percentile(ms, 0.9),
                percentile(ms, 0.99),
                max(ms),
            ]
        )
    print_table(["endpoint", "requests", "p50 ms", "p90 ms", "p99 ms", "max ms"], rows)
    p99 = percentile([x for v in latencies.values() for x in v], 0.99) * 1e3
    print(f"p99 {p99:.1f} ms (target < 100 ms): {'met' if p99 < 100 and not errors else 'MISSED'}")


if __name__ == "__main__":
    main()
