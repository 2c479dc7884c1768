"""GET /health: the one route that needs no token."""

from __future__ import annotations

import httpx

from service import __version__
from service.launcher import LocalService


def test_health_answers_without_a_token(anon: httpx.Client) -> None:
    response = anon.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "version": __version__}


def test_openapi_documents_the_bearer_scheme(api: LocalService) -> None:
    schema = httpx.get(f"{api.base_url}/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert "/api/v1/jobs/{job_id}/events" in schema["paths"]
