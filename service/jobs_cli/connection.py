"""Where the service is and its token (see :mod:`service.jobs_cli`), and the job configs a
user submits."""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from service.jobs_cli.errors import DEFAULT_URL, CliError


# ------------------------------------------------------------------------------ connection
def client_config_path() -> Path:
    named = os.environ.get("DLRM_VRGD_CLIENT_CONFIG")
    if named:
        return Path(named)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dlrm-vrgd" / "client.toml"


def _read_client_config(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as err:
        raise CliError(f"{path}: cannot read the client config ({type(err).__name__})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise CliError(f"{path}: not valid TOML: {err}") from None
    unknown = sorted(set(data) - {"url", "token", "token_file"})
    if unknown:
        raise CliError(f"{path}: unknown key {unknown[0]!r} (expected url, token, token_file)")
    for key in data:
        if not isinstance(data[key], str) or not data[key]:
            raise CliError(f"{path}: {key} must be a non-empty string")
    return data


def _token_from_file(path: Path, what: str) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CliError(f"{what} {path}: cannot read the token ({type(err).__name__})") from None
    if not token:
        raise CliError(f"{what} {path}: empty")
    return token


def connection(args: argparse.Namespace) -> tuple[str, str | None]:
    """The service's base URL and the bearer token (see the module docstring)."""
    config_path = client_config_path()
    config = _read_client_config(config_path)
    url = args.url or os.environ.get("DLRM_VRGD_URL") or config.get("url") or DEFAULT_URL
    if not url.startswith(("http://", "https://")):
        raise CliError(f"--url {url!r}: expected http://HOST:PORT or https://...")
    token: str | None
    if args.token_file:
        token = _token_from_file(Path(args.token_file), "--token-file")
    elif os.environ.get("DLRM_VRGD_TOKEN"):
        token = os.environ["DLRM_VRGD_TOKEN"].strip()
    elif "token" in config:
        token = config["token"]
    elif "token_file" in config:
        token = _token_from_file(Path(config["token_file"]).expanduser(), f"{config_path}:")
    else:
        token = None
    if token is not None and not re.fullmatch(r"[\x21-\x7e]{1,4096}", token):
        raise CliError(
            "the token holds a space, a control or a non-ASCII character (a bearer token is "
            "one word of printable ASCII): check the token file or DLRM_VRGD_TOKEN"
        )
    return url, token


# ------------------------------------------------------------------------------ configs
def read_job_config(path: Path, overrides: list[str]) -> dict[str, Any]:
    """The YAML file as a mapping with ``--set`` overrides applied (the service validates)."""
    from dlrm_vrgd.config import ConfigError, apply_overrides, read_yaml_mapping

    try:
        return apply_overrides(read_yaml_mapping(path), overrides)
    except ConfigError as err:
        raise CliError(str(err)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise CliError(f"{path}: cannot read ({type(err).__name__})") from None


def job_kind(config: dict[str, Any]) -> str:
    """``study`` for a study config (it has a ``base`` TrainConfig), else ``train``."""
    return "study" if "base" in config else "train"
