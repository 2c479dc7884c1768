"""``dlrm-vrgd serve``: run the control service (the command-line side; prints for people)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError


def serve_main(
    host: str | None = None,
    port: int | None = None,
    data_dir: str | None = None,
    max_jobs: int | None = None,
    job_timeout: float | None = None,
) -> int:
    """Start the service with ``DLRM_VRGD_*`` settings, the given flags winning."""
    from service.main import preflight, serve
    from service.security import StartupRefused, resolve_token
    from service.settings import Settings

    overrides: dict[str, Any] = {
        key: value
        for key, value in {
            "host": host,
            "port": port,
            "data_dir": Path(data_dir) if data_dir else None,
            "max_concurrent_jobs": max_jobs,
            "job_timeout_s": job_timeout,
        }.items()
        if value is not None
    }
    try:
        settings = Settings(**overrides)
    except ValidationError as err:
        print(f"error: invalid service settings:\n{err}", file=sys.stderr)
        return 2
    try:
        preflight(settings)
        token = resolve_token(settings)
    except StartupRefused as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.getLogger("service").setLevel(logging.INFO)
    url = f"http://{settings.host}:{settings.port}"
    print(f"dlrm-vrgd service: {url}/api/v1  (API docs {url}/docs)", file=sys.stderr)
    print(f"data directory: {settings.data_dir}", file=sys.stderr)
    if token.source == "environment":
        where = "DLRM_VRGD_TOKEN" if os.environ.get("DLRM_VRGD_TOKEN") else "a secret file"
        print(f"token: from {where}", file=sys.stderr)
    else:
        print(
            f"token: {token.value}\n  ({token.source}; kept in {settings.token_path}; "
            "set DLRM_VRGD_TOKEN to choose one)",
            file=sys.stderr,
        )
    sys.stderr.flush()
    serve(settings)
    return 0
