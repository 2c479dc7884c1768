"""docker/healthcheck.py, the images' and compose file's health check, against a real
service: healthy while it answers, unhealthy when nothing listens (exit status 0 / 1)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from service.launcher import LocalService, free_port

from .conftest import DOCKER

SCRIPT = DOCKER / "healthcheck.py"


def check(host: str, port: int | str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DLRM_VRGD_HOST": host, "DLRM_VRGD_PORT": str(port)}
    return subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=30
    )


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    svc = LocalService.start(
        tmp_path_factory.mktemp("health") / "data",
        secrets.token_urlsafe(24),
        env={"DLRM_VRGD_MAX_CONCURRENT_JOBS": "0", "DLRM_VRGD_LOG_LEVEL": "warning"},
    )
    yield svc
    svc.stop()


def test_healthy_while_the_service_answers(service: LocalService) -> None:
    port = urlsplit(service.base_url).port
    assert port is not None
    # The image listens on 0.0.0.0: the check asks loopback then.
    for host in ("127.0.0.1", "0.0.0.0"):
        proc = check(host, port)
        assert proc.returncode == 0, proc.stderr


def test_unhealthy_when_nothing_answers() -> None:
    proc = check("127.0.0.1", free_port())
    assert proc.returncode == 1
    assert proc.stderr.startswith("unhealthy: http://127.0.0.1:")


def test_the_script_needs_only_the_standard_library() -> None:
    """It runs in the image with the service's interpreter, and must not import the project
    (a broken project install should not also break the probe's own import)."""
    text = Path(SCRIPT).read_text()
    imports = {
        line.split()[1].split(".")[0]
        for line in text.splitlines()
        if line.startswith(("import ", "from "))
    }
    assert imports <= {"__future__", "json", "os", "sys", "urllib"}, imports
