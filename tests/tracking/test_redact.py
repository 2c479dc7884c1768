"""Credentials never ride in a tracking URI: the real CLI refuses one naming the field (without
echoing it), and the one redaction function masks what it would leak, case by case."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dlrm_vrgd.config import ConfigError
from dlrm_vrgd.redact import redact, redact_obj

from ..conftest import tiny_config, tiny_config_dict

SECRET = "s3cret-Pw-4242"


@pytest.mark.parametrize(
    ("field", "uri"),
    [
        ("tracking_uri", f"http://me:{SECRET}@127.0.0.1:5000"),
        ("tracking_uri", f"https://127.0.0.1/?token={SECRET}"),
        ("artifact_location", f"s3://key:{SECRET}@bucket/x"),
    ],
)
def test_the_cli_refuses_credentials_in_a_uri_naming_the_field(
    tmp_path: Path, field: str, uri: str
) -> None:
    mlflow = f"{{tracking_uri: 'http://127.0.0.1:5000', {field}: '{uri}'}}"
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict()))
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "train", "--config", str(config),
         "--out", str(tmp_path / "run"),
         "--set", f"run.mlflow={mlflow}", "--set", "run.steps=1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert f"run.mlflow.{field}" in proc.stderr and "MLFLOW_TRACKING_PASSWORD" in proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("http://u:pw@h:1/x", "http://***@h:1/x"),
        ("postgresql://u:p@ss@db/x", "postgresql://***@db/x"),  # the authority's last @
        ("see 'http://u:pw@h' and http://h/a@b", "see 'http://***@h' and http://h/a@b"),
        ("/jobs?limit=3&token=abc&after=2", "/jobs?limit=3&token=***&after=2"),
        ("GET /x?access_token=abc HTTP/1.1", "GET /x?access_token=*** HTTP/1.1"),
        ("https://b/o?X-Amz-Signature=ff&v=1", "https://b/o?X-Amz-Signature=***&v=1"),
        ('{"u": "http://h/?password=p"}', '{"u": "http://h/?password=***"}'),
        ("sqlite:////srv/mlflow/runs.db", "sqlite:////srv/mlflow/runs.db"),
        ("http://127.0.0.1:5000/?limit=3", "http://127.0.0.1:5000/?limit=3"),
        ("user@example.com wrote", "user@example.com wrote"),
    ],
)
def test_redact_masks_credentials_and_secret_parameters_only(text: str, want: str) -> None:
    assert redact(text) == want


def test_redact_obj_walks_json() -> None:
    got = redact_obj({"a": [f"http://u:{SECRET}@h", 3, None], "b": {"c": f"?token={SECRET}"}})
    assert got == {"a": ["http://***@h", 3, None], "b": {"c": "?token=***"}}


def test_a_valid_config_round_trips_through_to_dict() -> None:
    """Redaction of a validated config changes nothing: what is stored is what runs."""
    cfg = tiny_config("run.mlflow={tracking_uri: 'sqlite:////tmp/x.db', experiment: e}")
    assert cfg.to_dict()["run"]["mlflow"]["tracking_uri"] == "sqlite:////tmp/x.db"
    with pytest.raises(ConfigError, match="run.mlflow.tracking_uri"):
        tiny_config("run.mlflow={tracking_uri: 'http://h:5000/?x=1'}")  # no query string


def test_redact_masks_the_environments_secret_values_in_every_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 39 item 6: a server that echoes the password, the Basic header or the token."""
    import base64
    import json
    from urllib.parse import quote

    password, token = "p@ss w0rd/é", "tok-9f8e7d6c5b4a"
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", token)
    monkeypatch.setenv("DLRM_VRGD_MLFLOW_CREDENTIAL_SERVERS", "http://127.0.0.1:5000")
    monkeypatch.setenv("SHORT_TOKEN", "abc")
    basic = base64.b64encode(f"alice:{password}".encode()).decode()
    for form in (password, quote(password, safe=""), json.dumps(password)[1:-1], basic, token):
        assert redact(f"denied ({form}) at http://127.0.0.1:5000") == (
            "denied (***) at http://127.0.0.1:5000"  # a setting that names no secret stays
        )
    assert redact("alice abc") == "alice abc"  # the user name alone and short values stay
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    assert redact(f"denied ({password})") == f"denied ({password})"  # follows the environment
