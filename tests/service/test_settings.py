"""Settings from DLRM_VRGD_* variables; the token and the rule for non-loopback binds."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from service.main import DataDirLock
from service.security import StartupRefused, check_bind, resolve_token
from service.settings import Settings, is_loopback_host


def test_settings_read_the_environment_with_the_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLRM_VRGD_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("DLRM_VRGD_MAX_CONCURRENT_JOBS", "3")
    monkeypatch.setenv("DLRM_VRGD_JOB_TIMEOUT_S", "60")
    s = Settings()
    assert (s.data_dir, s.max_concurrent_jobs, s.job_timeout_s) == (tmp_path, 3, 60.0)
    assert s.db_path == tmp_path / "service.db" and s.is_loopback
    assert Settings(max_concurrent_jobs=1).max_concurrent_jobs == 1  # arguments win


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.3.2.1", True), ("localhost", True), ("::1", True),
     ("0.0.0.0", False), ("192.168.1.4", False), ("example.org", False)],
)  # fmt: skip
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_a_public_bind_needs_a_long_explicit_token(tmp_path: Path) -> None:
    check_bind(Settings(data_dir=tmp_path, host="127.0.0.1"))
    with pytest.raises(StartupRefused, match="DLRM_VRGD_TOKEN"):
        check_bind(Settings(data_dir=tmp_path, host="0.0.0.0"))
    with pytest.raises(StartupRefused):
        check_bind(Settings(data_dir=tmp_path, host="0.0.0.0", token="short"))
    check_bind(Settings(data_dir=tmp_path, host="0.0.0.0", token="x" * 32))


def test_serve_refuses_a_public_bind_without_a_token(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "serve", "--host", "0.0.0.0",
         "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 2
    assert "refusing to listen on 0.0.0.0" in proc.stderr
    assert not (tmp_path / "service.db").exists()


def test_a_generated_token_is_saved_privately_and_reused(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path)
    first = resolve_token(s)
    assert first.source == "generated" and len(first.value) >= 32
    assert stat.S_IMODE(s.token_path.stat().st_mode) == 0o600
    again = resolve_token(s)
    assert again.source == "file" and again.value == first.value
    env = resolve_token(Settings(data_dir=tmp_path, token="from-env-token-123"))
    assert env.source == "environment" and env.matches("from-env-token-123")
    assert not env.matches("from-env-token-124")


def test_one_service_per_data_directory(tmp_path: Path) -> None:
    first = DataDirLock(tmp_path / "service.lock")
    first.acquire()
    with pytest.raises(StartupRefused, match="another service"):
        DataDirLock(tmp_path / "service.lock").acquire()
    first.release()
    second = DataDirLock(tmp_path / "service.lock")
    second.acquire()
    second.release()


def test_a_token_of_spaces_is_no_token(tmp_path: Path) -> None:
    with pytest.raises(StartupRefused, match="other than whitespace"):
        check_bind(Settings(data_dir=tmp_path, host="0.0.0.0", token=" " * 16))
    with pytest.raises(StartupRefused, match="other than whitespace"):
        check_bind(Settings(data_dir=tmp_path, host="0.0.0.0", token=" \t" * 20 + "short"))
    with pytest.raises(StartupRefused, match="empty"):
        resolve_token(Settings(data_dir=tmp_path, token=" " * 16))
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "serve", "--host", "0.0.0.0",
         "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DLRM_VRGD_TOKEN": " " * 16},
    )  # fmt: skip
    assert proc.returncode == 2
    assert "refusing to listen on 0.0.0.0" in proc.stderr and "Traceback" not in proc.stderr
