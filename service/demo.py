"""``dlrm-vrgd demo``: the demo job, run through the control service as a user would.

Starts the service on a free loopback port (data in ``runs/service`` unless told otherwise),
submits ``configs/demo.yaml`` (with the VRGD variants of its optimizers, so there is a GSNR to
watch), follows the job's event stream with a live line (step, loss, AUC beside the oracle,
mean GSNR ratio, rows/s), prints the final AUC beside the oracle AUC and the URLs to look at,
and stops the service — unless ``--keep-serving``. Ctrl-C cancels the job first.

This is command-line code: it prints for people.
"""

from __future__ import annotations

import math
import secrets
import sys
from pathlib import Path
from typing import Any

import httpx

from dlrm_vrgd.config import TrainConfig, load_config
from service.client import ApiError, ServiceClient
from service.launcher import LaunchError, LocalService

#: The VRGD counterpart of each optimizer (DESIGN.md 4.2, 4.3).
VR_DENSE = {
    "sgd": "vrsgd",
    "adam": "vradam",
    "adamw": "vradam",
    "lars": "vrlars",
    "lamb": "vrlamb",
    "adagrad": "vradagrad",
}
VR_SPARSE = {"rowwise_adagrad": "gsnr_rowwise_adagrad", "sgd": "gsnr_sgd"}


def with_vr(cfg: TrainConfig) -> TrainConfig:
    """The same config with VR-* optimizers where the config names their base ones."""
    raw = cfg.to_dict()
    dense, sparse = raw["optim"]["dense"], raw["optim"]["sparse"]
    dense["name"] = VR_DENSE.get(dense["name"], dense["name"])
    sparse["name"] = VR_SPARSE.get(sparse["name"], sparse["name"])
    return TrainConfig.model_validate(raw)


def _fmt(value: Any, spec: str = ".4f") -> str:
    if isinstance(value, int | float) and math.isfinite(value):
        return format(value, spec)
    return "-"


def print_result(result: dict[str, Any]) -> None:
    """The final figures, as ``dlrm-vrgd train`` prints them."""
    rows_per_s = (result.get("timings") or {}).get("rows_per_s")
    print(
        f"trained {result['steps']} steps, {result['samples']:,} rows at "
        f"{_fmt(rows_per_s, ',.0f')} rows/s"
    )
    for name in ("val", "test"):
        m = result.get(name) or {}
        line = (
            f"  {name:4s} AUC {_fmt(m.get('auc'))}  logloss {_fmt(m.get('logloss'))}  "
            f"NE {_fmt(m.get('ne'))}"
        )
        if m.get("oracle_auc") is not None and m.get("auc") is not None:
            gap = m["oracle_auc"] - m["auc"]
            line += f"   oracle AUC {m['oracle_auc']:.4f} (gap {gap:+.4f})"
        print(line)


def dashboard_url(base_url: str, job_id: str) -> str:
    """The dashboard page of one job (sign in there with the service token)."""
    return f"{base_url}/ui/jobs/{job_id}"


def _follow(client: ServiceClient, job: dict[str, Any]) -> dict[str, Any]:
    from service.follow import FollowLine  # plain lines off a terminal: no tqdm redraws

    live = FollowLine(job["progress"].get("total_steps"))
    try:
        for event in client.events(job["id"]):
            live.on_event(event)
            if event.event == "end":
                return event.data
    finally:
        live.close()
    return client.job(job["id"])


def run_demo(
    config_path: Path,
    overrides: list[str],
    data_dir: Path,
    keep_serving: bool = False,
    vr: bool = True,
    port: int | None = None,
) -> int:
    """The demo; returns the process exit status."""
    cfg = load_config(config_path, overrides)
    if vr:
        cfg = with_vr(cfg)
    token = secrets.token_urlsafe(24)
    print(f"demo: starting the control service (data directory {data_dir})", flush=True)
    try:
        svc = LocalService.start(data_dir, token, port=port)
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    api = f"{svc.base_url}/api/v1"
    job_id: str | None = None
    client = svc.client()
    try:
        job = client.submit("demo", cfg.to_dict())
        job_id = job["id"]
        run = cfg.run
        print(
            f"demo: job {job_id}: {run.global_batch}-row global batches "
            f"({run.accumulation_steps} x {run.micro_batch}) on synthetic Criteo; "
            f"dense {cfg.optim.dense.name}, tables {cfg.optim.sparse.name}",
            flush=True,
        )
        print(
            f"demo: watch it live in the browser: {dashboard_url(svc.base_url, job_id)}\n"
            f"      (sign in with the token {token})",
            flush=True,
        )
        final = _follow(client, job)
        if final.get("state") != "succeeded":
            print(f"demo: job {final.get('state')}: {final.get('error') or ''}", file=sys.stderr)
            return 1
        print_result(client.result(job_id))
        progress = final.get("progress") or {}
        if progress.get("gsnr_ratio") is not None or progress.get("table_gsnr_ratio") is not None:
            print(
                f"  last step's mean GSNR ratio: dense {_fmt(progress.get('gsnr_ratio'), '.3f')}, "
                f"tables {_fmt(progress.get('table_gsnr_ratio'), '.3f')}"
            )
        print(f"run directory: {svc.data_dir / 'jobs' / job_id / 'run'}")
        print("look at (with header 'Authorization: Bearer <token>'):")
        for label, path in (
            ("job", ""),
            ("metrics", "/metrics?max_points=200"),
            ("GSNR", "/gsnr?max_points=200"),
            ("events", "/events"),
            ("result", "/result"),
            ("artifacts", "/artifacts"),
        ):
            print(f"  {label:9s} {api}/jobs/{job_id}{path}")
        print(f"  {'API docs':9s} {svc.base_url}/docs")
        print(f"  {'dashboard':9s} {dashboard_url(svc.base_url, job_id)}")
        if not keep_serving:
            print(
                f"the service stops now; see it all again with: dlrm-vrgd serve --data-dir "
                f"{svc.data_dir}  (or pass --keep-serving), then open "
                f"{dashboard_url('http://127.0.0.1:8000', job_id)} and sign in with the "
                "token it prints"
            )
            return 0
        print(
            f"\nservice still running (pid {svc.pid}); token: {token}\n"
            f"  curl -H 'Authorization: Bearer {token}' {api}/jobs/{job_id}\n"
            "press Ctrl-C to stop it",
            flush=True,
        )
        try:
            svc.proc.wait()
        except KeyboardInterrupt:
            print("\nstopping the service", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        if job_id is not None:
            print("\ninterrupted: cancelling the demo job", file=sys.stderr)
            try:
                client.cancel(job_id)
            except (ApiError, OSError) as err:
                print(f"could not cancel job {job_id}: {err}", file=sys.stderr)
        raise
    except ApiError as err:
        print(f"error: the service answered {err}", file=sys.stderr)
        return 1
    except httpx.TransportError as err:
        print(f"error: lost the service: {err}\n{svc.log_tail()}", file=sys.stderr)
        return 1
    finally:
        client.close()
        svc.stop()
