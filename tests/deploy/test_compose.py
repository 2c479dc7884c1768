"""The Compose files: valid against the Compose specification's JSON schema (the copy that
check-jsonschema vendors; its CLI and the jsonschema library both check), and wired as the
deployment needs: GPUs reserved through the NVIDIA driver, the data volume where the service
keeps its store and job directories, the health check, the token from the environment only,
and a worker command that is the head's own job command on the shared job directory.

No Docker engine is needed. Where ``docker compose`` exists, it also resolves the files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from service.jobs.files import JobFiles
from service.jobs.kinds import train_command
from service.settings import SECRETS_DIR, Settings

from .conftest import (
    COMPOSE,
    COMPOSE_FILES,
    CPU_COMPOSE,
    DOCKER,
    MULTINODE,
    ROOT,
    WORKER,
    MissingVariable,
    Tagged,
    interpolate,
    load_compose,
    untag,
)

TOKEN = "t" * 48
ENV = {"DLRM_VRGD_TOKEN": TOKEN}


def compose_schema() -> dict[str, Any]:
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads((vendor / "compose-spec.json").read_text())


def test_the_vendored_schema_is_the_compose_specification() -> None:
    schema = compose_schema()
    assert schema["title"] == "Compose Specification"
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert "deployment" in schema["$defs"] and "devices" in schema["$defs"]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_files_validate_against_the_compose_schema(path: Path) -> None:
    """As written, and once the variables are filled in."""
    validator = jsonschema.Draft202012Validator(compose_schema())
    env = {**ENV, "DLRM_VRGD_SHARED_DIR": "/mnt/dlrm", "DLRM_VRGD_JOIN_JOB": "0123abcd"}
    env["DLRM_VRGD_TOKEN_FILE"] = "/home/u/.dlrm-vrgd/token"
    for document in (load_compose(path), interpolate(load_compose(path), env)):
        errors = sorted(validator.iter_errors(untag(document)), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_check_jsonschema_cli_accepts_them() -> None:
    """The check-jsonschema command itself (as a pre-commit hook or CI would run it). The
    head-host override uses Compose's ``!reset`` tag, which that YAML reader does not know;
    it is checked above with the tag read as Compose reads it."""
    plain = [str(COMPOSE), str(WORKER), str(CPU_COMPOSE)]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            *plain,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "validation done" in proc.stdout


# ---------------------------------------------------------------------------- the service
def control(env: dict[str, str] | None = None) -> dict[str, Any]:
    return interpolate(load_compose(COMPOSE), {**ENV, **(env or {})})["services"]["control"]


def test_gpus_are_reserved_through_the_nvidia_driver() -> None:
    for path, service in ((COMPOSE, "control"), (WORKER, "worker")):
        spec = load_compose(path)["services"][service]
        (device,) = spec["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia"
        assert device["capabilities"] == ["gpu"]
        assert device["count"] == "all"  # the service splits them among jobs
        assert spec["init"] is True  # reaps orphaned torchrun workers
        assert int(str(spec["ulimits"]["memlock"])) == -1


def test_the_store_and_job_directories_live_on_a_named_volume() -> None:
    doc = interpolate(load_compose(COMPOSE), ENV)
    spec = doc["services"]["control"]
    data_dir = spec["environment"]["DLRM_VRGD_DATA_DIR"]
    mounts = dict(v.split(":")[:2][::-1] for v in spec["volumes"])  # target -> source
    assert mounts[data_dir] == "dlrm-data" and "dlrm-data" in doc["volumes"]
    # Datasets: a named volume by default, a host directory when asked.
    assert mounts["/datasets"] == "dlrm-datasets" and "dlrm-datasets" in doc["volumes"]
    with_host_dir = control({"DLRM_VRGD_DATASETS": "/srv/criteo"})
    assert "/srv/criteo:/datasets" in with_host_dir["volumes"]


def test_the_health_check_asks_the_service() -> None:
    check = control()["healthcheck"]
    assert check["test"] == ["CMD", "python", "/opt/dlrm-vrgd/healthcheck.py"]
    assert {"interval", "timeout", "start_period", "retries"} <= set(check)
    # The script the images install (see test_dockerfiles) is the one tested in test_health.
    assert (DOCKER / "healthcheck.py").is_file()


def test_the_token_comes_from_the_environment_and_is_required() -> None:
    raw = load_compose(COMPOSE)["services"]["control"]["environment"]["DLRM_VRGD_TOKEN"]
    assert raw.startswith("${DLRM_VRGD_TOKEN:?"), "the token must be required, never a literal"
    assert control()["environment"]["DLRM_VRGD_TOKEN"] == TOKEN
    with pytest.raises(MissingVariable, match="DLRM_VRGD_TOKEN"):
        interpolate(load_compose(COMPOSE), {})
    with pytest.raises(MissingVariable, match="DLRM_VRGD_TOKEN"):
        interpolate(load_compose(COMPOSE), {"DLRM_VRGD_TOKEN": ""})


def test_no_secret_is_written_in_any_deployment_file() -> None:
    for path in [*COMPOSE_FILES, DOCKER / "Dockerfile.gpu", DOCKER / "Dockerfile.cpu"]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            text = line.split("#", 1)[0]
            if "TOKEN" in text and ("=" in text or ":" in text):
                required = ("${DLRM_VRGD_TOKEN:?", "${DLRM_VRGD_TOKEN_FILE:?")
                assert any(r in text for r in required), f"{path.name}:{number}: {line.strip()}"
    assert (DOCKER / ".gitignore").read_text().splitlines()[-1] == ".env"


def test_the_api_is_published_on_loopback_unless_asked() -> None:
    assert control()["ports"] == ["127.0.0.1:8000:8000"]
    public = control({"DLRM_VRGD_BIND": "0.0.0.0", "DLRM_VRGD_PUBLISH_PORT": "9000"})
    assert public["ports"] == ["0.0.0.0:9000:8000"]
    env = control()["environment"]
    assert (env["DLRM_VRGD_HOST"], env["DLRM_VRGD_PORT"]) == ("0.0.0.0", "8000")


def test_gpu_scheduling_settings_reach_the_service() -> None:
    env = control()["environment"]
    assert env["DLRM_VRGD_GPUS"] == "auto"
    assert env["DLRM_VRGD_GPU_BACKFILL"] == "false"
    assert control({"DLRM_VRGD_GPUS": "0,1"})["environment"]["DLRM_VRGD_GPUS"] == "0,1"
    # Every DLRM_VRGD_* variable the file sets is a real setting (typos would be ignored).
    fields = {f"DLRM_VRGD_{name.upper()}" for name in Settings.model_fields}
    assert set(env) - fields == set(), set(env) - fields


def test_the_image_is_built_from_the_gpu_dockerfile() -> None:
    build = control()["build"]
    assert (COMPOSE.parent / build["context"]).resolve() == ROOT
    assert (ROOT / build["dockerfile"]) == DOCKER / "Dockerfile.gpu"
    assert build["args"]["CUDA_VARIANT"] == "cu130"


# ----------------------------------------------------------------------------- multi-node
def test_the_head_host_override_uses_the_host_network_and_shared_job_directories() -> None:
    raw = load_compose(MULTINODE)["services"]["control"]
    assert isinstance(raw["ports"], Tagged) and raw["ports"].tag == "!reset"
    spec = interpolate(load_compose(MULTINODE), {"DLRM_VRGD_SHARED_DIR": "/mnt/dlrm"})
    head = spec["services"]["control"]
    assert head["network_mode"] == "host"
    assert head["environment"]["DLRM_VRGD_JOBS_ROOT"] == "/mnt/dlrm/jobs"
    assert head["volumes"] == ["/mnt/dlrm:/mnt/dlrm"]  # the same path inside and out
    assert head["environment"]["NCCL_SOCKET_IFNAME"] is None  # passed through when set
    with pytest.raises(MissingVariable, match="DLRM_VRGD_SHARED_DIR"):
        interpolate(load_compose(MULTINODE), {})


def test_the_worker_runs_the_heads_own_job_command_on_the_shared_job_directory() -> None:
    shared, job_id = "/mnt/dlrm", "0123456789abcdef"
    doc = interpolate(
        load_compose(WORKER), {"DLRM_VRGD_SHARED_DIR": shared, "DLRM_VRGD_JOIN_JOB": job_id}
    )
    worker = doc["services"]["worker"]
    # What the head's runner starts for this job (service/jobs/kinds.py), with the job
    # directory where DLRM_VRGD_JOBS_ROOT=SHARED/jobs puts it; the image's entry point is
    # `dlrm-vrgd`, i.e. `python -m dlrm_vrgd.cli`.
    head = train_command(sys.executable, JobFiles(Path(shared) / "jobs" / job_id))
    assert head[1:3] == ["-m", "dlrm_vrgd.cli"]
    assert worker["command"] == head[3:]
    assert worker["network_mode"] == "host"
    assert f"{shared}:{shared}" in worker["volumes"]
    assert worker["restart"] == "no"
    assert worker["healthcheck"] == {"disable": True}
    assert "DLRM_VRGD_TOKEN" not in json.dumps(worker)
    with pytest.raises(MissingVariable, match="DLRM_VRGD_JOIN_JOB"):
        interpolate(load_compose(WORKER), {"DLRM_VRGD_SHARED_DIR": shared})


# ------------------------------------------------------------------------ one CPU host
CPU_ENV = {"DLRM_VRGD_TOKEN_FILE": "/home/u/.dlrm-vrgd/token"}


def cpu_doc(env: dict[str, str] | None = None) -> dict[str, Any]:
    return interpolate(load_compose(CPU_COMPOSE), {**CPU_ENV, **(env or {})})


def test_the_cpu_file_is_the_gpu_service_without_gpus() -> None:
    """Everything docker-compose.yml gives the service except the GPUs, the bridge network
    and the token in the environment; built from the CPU Dockerfile."""
    gpu, cpu = control(), cpu_doc()["services"]["control"]
    assert "deploy" not in cpu
    assert cpu["environment"]["DLRM_VRGD_GPUS"] == "none"
    assert (ROOT / cpu["build"]["dockerfile"]) == DOCKER / "Dockerfile.cpu"
    assert (CPU_COMPOSE.parent / cpu["build"]["context"]).resolve() == ROOT
    assert cpu["image"] == "dlrm-vrgd:cpu"
    for key in ("init", "restart", "volumes", "stop_grace_period", "ulimits"):
        if key in cpu:
            assert cpu[key] == gpu[key], key
    assert cpu["healthcheck"]["test"] == gpu["healthcheck"]["test"]
    for name in ("DLRM_VRGD_DATA_DIR", "DLRM_VRGD_CANCEL_ON_SHUTDOWN"):
        assert cpu["environment"][name] == gpu["environment"][name], name
    fields = {f"DLRM_VRGD_{name.upper()}" for name in Settings.model_fields}
    assert set(cpu["environment"]) <= fields, set(cpu["environment"]) - fields
    assert cpu_doc()["volumes"] == {"dlrm-data": None, "dlrm-datasets": None}
    # Compose 1.29 refuses a top-level `name:` (the project name is given with -p).
    assert set(load_compose(CPU_COMPOSE)) == {"services", "secrets", "volumes"}


def test_the_cpu_service_is_on_the_host_network_and_listens_on_loopback() -> None:
    cpu = cpu_doc()["services"]["control"]
    assert cpu["network_mode"] == "host"
    assert "ports" not in cpu and "networks" not in cpu
    env = cpu["environment"]
    assert (env["DLRM_VRGD_HOST"], env["DLRM_VRGD_PORT"]) == ("127.0.0.1", "8000")
    moved = cpu_doc({"DLRM_VRGD_BIND": "0.0.0.0", "DLRM_VRGD_PUBLISH_PORT": "9000"})
    env = moved["services"]["control"]["environment"]
    assert (env["DLRM_VRGD_HOST"], env["DLRM_VRGD_PORT"]) == ("0.0.0.0", "9000")


def test_the_cpu_service_gets_its_token_as_a_secret_file_the_service_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token is in no environment variable (``docker inspect`` shows those): Compose
    mounts the file DLRM_VRGD_TOKEN_FILE names at /run/secrets/<secret>, and the service's
    settings read that file when DLRM_VRGD_TOKEN is unset."""
    raw = load_compose(CPU_COMPOSE)
    assert raw["secrets"]["dlrm_vrgd_token"]["file"].startswith("${DLRM_VRGD_TOKEN_FILE:?")
    with pytest.raises(MissingVariable, match="DLRM_VRGD_TOKEN_FILE"):
        interpolate(raw, {})
    cpu = cpu_doc()
    assert cpu["services"]["control"]["secrets"] == ["dlrm_vrgd_token"]
    assert cpu["secrets"]["dlrm_vrgd_token"]["file"] == CPU_ENV["DLRM_VRGD_TOKEN_FILE"]
    assert "DLRM_VRGD_TOKEN" not in cpu["services"]["control"]["environment"]
    # The settings: the file named like the variable, stripped; the variable wins.
    monkeypatch.delenv("DLRM_VRGD_TOKEN", raising=False)
    (tmp_path / "dlrm_vrgd_token").write_text("s" * 40 + "\n")
    settings = Settings(_secrets_dir=tmp_path)  # type: ignore[call-arg]
    assert settings.token is not None and settings.token.get_secret_value() == "s" * 40
    monkeypatch.setenv("DLRM_VRGD_TOKEN", "e" * 20)
    settings = Settings(_secrets_dir=tmp_path)  # type: ignore[call-arg]
    assert settings.token is not None and settings.token.get_secret_value() == "e" * 20
    assert Settings().model_config["secrets_dir"] in (None, SECRETS_DIR)
    assert SECRETS_DIR == Path("/run/secrets")  # where Compose and Docker mount secrets


# -------------------------------------------------------------------- with docker compose
def _docker_compose() -> list[str] | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
    return [docker, "compose"] if probe.returncode == 0 else None


@pytest.mark.skipif(_docker_compose() is None, reason="docker compose (v2) is not installed")
def test_docker_compose_resolves_the_files(tmp_path: Path) -> None:
    compose = _docker_compose()
    assert compose is not None
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **ENV}
    env["DLRM_VRGD_SHARED_DIR"], env["DLRM_VRGD_JOIN_JOB"] = "/mnt/dlrm", "0123abcd"
    for files in ([COMPOSE], [COMPOSE, MULTINODE], [WORKER]):
        args = [a for f in files for a in ("-f", str(f))]
        proc = subprocess.run(
            [*compose, *args, "config", "--quiet"], capture_output=True, text=True, env=env
        )
        assert proc.returncode == 0, proc.stderr


def _any_compose() -> list[str] | None:
    """``docker compose`` (v2), else Debian's ``docker-compose`` (1.29)."""
    return _docker_compose() or ([v1] if (v1 := shutil.which("docker-compose")) else None)


@pytest.mark.skipif(_any_compose() is None, reason="neither docker compose nor docker-compose")
def test_docker_compose_resolves_the_cpu_file(tmp_path: Path) -> None:
    """The CPU file as Compose itself reads it (1.29 here: no top-level name, no !reset)."""
    compose = _any_compose()
    assert compose is not None
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **CPU_ENV}
    args = [*compose, "-p", "dlrm-vrgd", "-f", str(CPU_COMPOSE), "config"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    control = resolved["services"]["control"]
    assert control["network_mode"] == "host" and "deploy" not in control
    assert resolved["secrets"]["dlrm_vrgd_token"]["file"] == CPU_ENV["DLRM_VRGD_TOKEN_FILE"]
    missing = subprocess.run(
        args, capture_output=True, text=True, env={**env, "DLRM_VRGD_TOKEN_FILE": ""}, timeout=60
    )
    assert missing.returncode != 0 and "DLRM_VRGD_TOKEN_FILE" in missing.stderr
