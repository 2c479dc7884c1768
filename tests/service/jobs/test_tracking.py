"""``service.jobs.tracking``: which tracking servers get the service's MLflow credentials (an
exact origin match of a URI written plainly), and what a job's environment keeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.jobs.tracking import job_environment, parse_origins, sends_credentials
from service.settings import Settings

ALLOWED = "https://mlflow.example.com, http://10.0.0.5:5000"


def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path, mlflow_credential_servers=ALLOWED)


@pytest.mark.parametrize(
    ("uri", "sent"),
    [
        ("https://mlflow.example.com", True),
        ("https://MLflow.Example.com:443/", True),
        ("https://mlflow.example.com/some/path", True),
        ("http://10.0.0.5:5000", True),
        ("http://mlflow.example.com", False),  # another scheme: another origin
        ("https://mlflow.example.com:8443", False),
        ("https://mlflow.example.com.attacker.net", False),
        ("https://attacker.net/mlflow.example.com", False),
        ("https://mlflow.example.com\\@attacker.net", False),  # clients disagree: never
        ("https://mlflow%2eexample.com", False),
        ("http://10.0.0.5:5000@attacker.net", False),
        ("http://10.0.0.5", False),
        ("sqlite:////srv/mlflow/x.db", False),
        (None, False),
    ],
)
def test_credentials_go_to_exact_origins_only(tmp_path: Path, uri: str | None, sent: bool) -> None:
    assert sends_credentials(uri, settings(tmp_path)) is sent


@pytest.mark.parametrize(
    "bad", ["https://h/path", "https://u:p@h", "ftp://h", "h:5000", "https://h?x"]
)
def test_the_operators_list_is_origins(bad: str) -> None:
    with pytest.raises(ValueError, match="not an origin"):
        parse_origins(bad)


def test_a_jobs_environment_keeps_credentials_for_an_allowed_server_only(tmp_path: Path) -> None:
    names = ("USERNAME", "PASSWORD", "TOKEN", "AWS_SIGV4", "CLIENT_CERT_PATH")
    env = {f"MLFLOW_TRACKING_{n}": "x" for n in names} | {"PATH": "/bin"}
    train = {"run": {"mlflow": {"tracking_uri": "https://mlflow.example.com"}}}
    study = {"base": train}
    elsewhere = {"run": {"mlflow": {"tracking_uri": "https://attacker.net"}}}
    s = settings(tmp_path)
    assert job_environment(env, "train", train, s) == env
    assert job_environment(env, "study", study, s) == env
    for kind, config in (("train", elsewhere), ("score", {}), ("train", {"run": {}})):
        assert job_environment(env, kind, config, s) == {"PATH": "/bin"}
