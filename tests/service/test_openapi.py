"""Property-based run of the OpenAPI schema (schemathesis) against the app: no 5xx, whatever
the input. The runner holds jobs in the queue (max_concurrent_jobs=0): generated configs are
stored, validated and listed, never trained."""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi

from service.main import create_app
from service.settings import Settings

TOKEN = secrets.token_urlsafe(24)
DATA_DIR = Path(tempfile.mkdtemp(prefix="dlrm-vrgd-openapi-"))
APP = create_app(
    Settings(
        data_dir=DATA_DIR / "data",
        token=TOKEN,
        max_concurrent_jobs=0,
        sse_keepalive_s=0.2,
        max_body_bytes=64 << 10,
    )
)
# Built from the app's own schema; the app (and its lifespan: store, runner) starts at the first
# request, not at import. (schemathesis.pytest.from_fixture does not work with pytest 9.)
schema = schemathesis.openapi.from_dict(APP.openapi())
schema.app = APP


@pytest.fixture(scope="module", autouse=True)
def _stop_the_app() -> Iterator[None]:
    yield
    asgi.shutdown_lifespans()  # stops the runner, closes the store, releases the lock
    shutil.rmtree(DATA_DIR, ignore_errors=True)


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_no_input_makes_the_service_fail(case: schemathesis.Case) -> None:
    case.call_and_validate(
        headers={"Authorization": f"Bearer {TOKEN}"}, checks=[not_a_server_error]
    )
