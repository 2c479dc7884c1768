"""Start the service as a child process on a free loopback port, and stop it.

Used by ``dlrm-vrgd demo``, the load bench and the end-to-end tests. The service runs in a
session of its own, so a Ctrl-C in the terminal reaches the caller, which decides what to do
(the demo cancels its job, then stops the service).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from service.client import ServiceClient

LOG_NAME = "service.log"


class LaunchError(RuntimeError):
    """The service did not come up; the message carries the end of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class LocalService:
    """A running ``dlrm-vrgd serve`` child process."""

    proc: subprocess.Popen[bytes]
    base_url: str
    token: str
    data_dir: Path
    log_path: Path

    @classmethod
    def start(
        cls,
        data_dir: Path,
        token: str,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        startup_timeout: float = 60.0,
        attempts: int = 3,
    ) -> LocalService:
        """Start a service on 127.0.0.1 (a free port unless ``port``) and wait until its
        health check answers. ``env`` adds ``DLRM_VRGD_*`` settings."""
        data_dir = Path(data_dir).resolve()
        data_dir.mkdir(parents=True, exist_ok=True)
        log_path = data_dir / LOG_NAME
        full_env = {**os.environ, **(env or {}), "DLRM_VRGD_TOKEN": token}
        last_error: LaunchError | None = None
        for _ in range(attempts if port is None else 1):
            chosen = port or free_port()
            cmd = [
                sys.executable,
                "-m",
                "dlrm_vrgd.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(chosen),
                "--data-dir",
                str(data_dir),
            ]
            with log_path.open("ab") as log:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=full_env,
                    start_new_session=True,
                )
            service = cls(proc, f"http://127.0.0.1:{chosen}", token, data_dir, log_path)
            try:
                service._wait_healthy(startup_timeout)
                return service
            except LaunchError as err:
                service.kill()
                last_error = err
                if "address already in use" not in str(err).lower():
                    raise
        assert last_error is not None
        raise last_error

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LaunchError(
                    f"the service exited with status {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/api/v1/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise LaunchError(f"the service did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def client(self, timeout: float = 30.0) -> ServiceClient:
        return ServiceClient(self.base_url, self.token, timeout=timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (graceful: uvicorn drains, the runner stops), SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def kill(self) -> None:
        """SIGKILL the service process (its jobs, in their own sessions, live on)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> LocalService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
