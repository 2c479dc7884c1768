"""The CPU image built for real and run with Compose: ``docker/build-local.sh`` builds it, the
CPU Compose file starts the service from it on the host network, and a tiny job trains inside
the container, driven over HTTP from this process. Then the container is replaced and the job,
its metrics and its result are still there (the named volume). The token shows in no
``docker inspect`` and no image history; the image runs as uid 10001.

Marked ``docker`` (``make test-docker``; ``.ci/run`` runs it after installing docker.io,
docker-compose and debootstrap). It uses a running Docker daemon, or starts one
(``dockerd --bridge=none --iptables=false``, stopped by pid at the end); it skips, saying why,
only where no daemon can be started. Build log, Compose logs and timings go to
``test-artifacts/docker/``."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.client import ServiceClient
from service.launcher import free_port

from ..conftest import tiny_config_dict
from .conftest import CPU_COMPOSE, ROOT

pytestmark = pytest.mark.docker

ARTIFACTS = ROOT / "test-artifacts" / "docker"
IMAGE = os.environ.get("DLRM_VRGD_TEST_IMAGE", "dlrm-vrgd:cpu")
BUILD_TIMEOUT_S = 1800
TIMINGS: dict[str, float] = {}


def docker_cli() -> str | None:
    return shutil.which("docker")


def run(args: list[str], timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)


def daemon_answers(docker: str) -> bool:
    try:
        return run([docker, "info", "--format", "{{.ServerVersion}}"], timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture(scope="module")
def docker() -> Iterator[str]:
    """The docker client, with a daemon answering it: the running one, else one started
    here on the host network only, and stopped (by its pid) after the module."""
    cli = docker_cli()
    if cli is None:
        pytest.skip("DOCKER TESTS SKIPPED: no docker client (apt-get install docker.io)")
    if daemon_answers(cli):
        yield cli
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        pytest.skip("DOCKER TESTS SKIPPED: no dockerd (apt-get install docker.io)")
    if os.geteuid() != 0:
        pytest.skip("DOCKER TESTS SKIPPED: no daemon runs, and only root can start dockerd")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log_path = ARTIFACTS / "dockerd.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [dockerd, "--bridge=none", "--iptables=false"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while not daemon_answers(cli):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_daemon(proc)
            tail = log_path.read_text()[-1500:]
            pytest.skip(f"DOCKER TESTS SKIPPED: dockerd could not start here:\n{tail}")
        time.sleep(0.5)
    try:
        yield cli
    finally:
        stop_daemon(proc)


def stop_daemon(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def image(docker: str) -> str:
    """The CPU image, built by docker/build-local.sh (layers cached between runs)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with (ARTIFACTS / "build.log").open("w") as log:
        proc = subprocess.run(
            ["bash", str(ROOT / "docker" / "build-local.sh")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "DLRM_VRGD_IMAGE": IMAGE},
            timeout=BUILD_TIMEOUT_S,
        )
    TIMINGS["build_s"] = round(time.monotonic() - started, 1)
    tail = (ARTIFACTS / "build.log").read_text()[-3000:]
    assert proc.returncode == 0, f"docker/build-local.sh failed:\n{tail}"
    return IMAGE


def inspect(docker: str, *what: str) -> Any:
    proc = run([docker, "inspect", *what])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_image_runs_unprivileged_and_keeps_no_build_input(docker: str, image: str) -> None:
    (meta,) = inspect(docker, "--type", "image", image)
    assert meta["Config"]["User"] == "10001:10001"
    assert meta["Config"]["Entrypoint"] == ["dlrm-vrgd"] and meta["Config"]["Cmd"] == ["serve"]
    env = dict(e.split("=", 1) for e in meta["Config"]["Env"])
    assert env["DLRM_VRGD_GPUS"] == "none" and "DLRM_VRGD_TOKEN" not in env
    assert not {"PIP_CERT", "PIP_FIND_LINKS"} & set(env)
    # Inside: uid 10001, the stack imports, and neither the CA bundle (a build secret) nor
    # the local wheels (a build mount) are there.
    script = (
        "id -u; test ! -e /run/secrets/pip-ca && test ! -e /wheels && echo clean; "
        "python -c 'import torch, fbgemm_gpu, torchrec, dlrm_vrgd, service.main; "
        "print(torch.__version__)'"
    )
    proc = run(
        [docker, "run", "--rm", "--network", "host", "--entrypoint", "sh", image, "-c", script]
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["10001", "clean", "2.13.0+cpu"]
    history = run([docker, "history", "--no-trunc", image]).stdout
    assert "groupadd --system --gid 10001 dlrm" in history  # the runtime stage's own steps
    assert "BEGIN CERTIFICATE" not in history and "PIP_CERT" not in history


# ------------------------------------------------------------------------------ compose
def compose_cli(docker: str) -> list[str]:
    v1 = shutil.which("docker-compose")
    if v1 is not None:
        return [v1]
    if run([docker, "compose", "version"]).returncode == 0:
        return [docker, "compose"]
    pytest.fail("neither docker-compose nor docker compose is installed")


def wait_healthy(docker: str, container: str, timeout: float = 180) -> float:
    started = time.monotonic()
    while True:
        (state,) = inspect(docker, "--type", "container", container)
        health = state["State"].get("Health", {}).get("Status")
        if health == "healthy":
            return time.monotonic() - started
        assert state["State"]["Running"], f"container stopped: {state['State']}"
        assert time.monotonic() - started < timeout, f"not healthy after {timeout} s: {health}"
        time.sleep(1)


def test_compose_up_trains_a_job_that_outlives_its_container(
    docker: str, image: str, tmp_path: Path
) -> None:
    token = secrets.token_hex(24)
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir(mode=0o700)
    token_file = secret_dir / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o644)  # read by uid 10001 in the container; the directory keeps others out
    port = free_port()
    project = f"dlrm-vrgd-test-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLRM_VRGD_", "COMPOSE_"))}
    env.update(
        DLRM_VRGD_TOKEN_FILE=str(token_file),
        DLRM_VRGD_PUBLISH_PORT=str(port),
        DLRM_VRGD_IMAGE=image,
    )
    compose = [*compose_cli(docker), "-p", project, "-f", str(CPU_COMPOSE)]

    def compose_run(*args: str, timeout: float = 180) -> str:
        proc = run([*compose, *args], timeout=timeout, env=env)
        assert proc.returncode == 0, f"{' '.join(args)}: {proc.stdout}{proc.stderr}"
        return proc.stdout

    def container() -> str:
        (cid,) = compose_run("ps", "-q", "control").split()
        return cid

    try:
        started = time.monotonic()
        compose_run("up", "-d", "--no-build")
        first = container()
        TIMINGS["healthy_after_up_s"] = round(wait_healthy(docker, first), 1)
        (state,) = inspect(docker, "--type", "container", first)
        # The host network only: no network made for the project, no port published.
        assert state["HostConfig"]["NetworkMode"] == "host"
        networks = run([docker, "network", "ls", "--format", "{{.Name}}"]).stdout.split()
        assert not [n for n in networks if n.startswith(project)], networks
        assert state["Config"]["User"] == "10001:10001"
        # Every process of the container (init, the service) runs as uid 10001.
        top = run([docker, "top", first, "-o", "pid,uid,args"]).stdout.splitlines()[1:]
        assert any("dlrm-vrgd serve" in line for line in top), top
        assert {line.split()[1] for line in top} == {"10001"}, top
        # The token reached the service (it answers only to it) but no inspect or history.
        for shown in (
            run([docker, "inspect", first]).stdout,
            run([docker, "image", "inspect", image]).stdout,
            run([docker, "history", "--no-trunc", image]).stdout,
        ):
            assert shown and token not in shown

        base = f"http://127.0.0.1:{port}"
        wrong = {"Authorization": "Bearer " + "x" * 48}
        assert httpx.get(f"{base}/api/v1/jobs", timeout=10).status_code == 401
        assert httpx.get(f"{base}/api/v1/jobs", headers=wrong, timeout=10).status_code == 401
        with ServiceClient(base, token, timeout=30) as client:
            submitted = time.monotonic()
            job = client.submit("tiny-in-docker", tiny_config_dict(run={"eval_every": 2}))
            done = client.wait(job["id"], timeout=300, poll=1.0)
            TIMINGS["job_s"] = round(time.monotonic() - submitted, 1)
            assert done["state"] == "succeeded", client.logs(job["id"], tail=40)
            assert done["exit_code"] == 0 and done["has_result"]
            metrics = client.metrics(job["id"])["data"]
            assert [r["step"] for r in metrics if r["kind"] == "train"] == [1, 2, 3, 4]
            evals = [(r["split"], r["step"]) for r in metrics if r["kind"] == "eval"]
            assert evals == [("val", 2), ("val", 4), ("test", 4)]
            result = client.result(job["id"])
            assert result["steps"] == 4 and result["samples"] == 1024
            assert 0 < result["test"]["auc"] <= 1

        # A new container on the same named volume: the store and the job directory remain.
        compose_run("up", "-d", "--no-build", "--force-recreate")
        second = container()
        assert second != first
        TIMINGS["healthy_after_recreate_s"] = round(wait_healthy(docker, second), 1)
        with ServiceClient(base, token, timeout=30) as client:
            again = client.job(job["id"])
            assert again["state"] == "succeeded" and again["exit_code"] == 0
            assert client.metrics(job["id"])["data"] == metrics
            assert client.result(job["id"]) == result
            names = {a["path"] for a in client.artifacts(job["id"])["data"]}
            assert {"result.json", "metrics.jsonl", "config.json"} <= names
    finally:
        logs = run([*compose, "logs", "--no-color"], env=env)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "compose.log").write_text(logs.stdout + logs.stderr)
        down = run([*compose, "down", "--volumes", "--remove-orphans"], timeout=180, env=env)
        TIMINGS["total_compose_s"] = round(time.monotonic() - started, 1)
        (ARTIFACTS / "timings.json").write_text(json.dumps(TIMINGS, indent=2) + "\n")
    assert down.returncode == 0, down.stderr
    volumes = run([docker, "volume", "ls", "-q"]).stdout.split()
    assert not [v for v in volumes if v.startswith(project)], volumes
