"""The API docs (/docs): Swagger UI served from the package, rendering offline in headless
Chromium under the strict page policy, on a public schema; every data route needs the token."""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from service.api.routes.pages import STATIC_DIR
from service.launcher import LocalService

from .dashboard_browser import BROWSER_MARKS, chromium, idle_service, new_context, shot, watch

LOOPBACK = {"127.0.0.1", "localhost", "[::1]", "::1"}


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    with idle_service(tmp_path_factory.mktemp("api-docs") / "data") as (service, _):
        yield service


def test_the_docs_page_loads_only_vendored_assets_under_the_strict_policy(
    svc: LocalService,
) -> None:
    with httpx.Client(base_url=svc.base_url, timeout=30) as http:
        page = http.get("/docs")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert "unsafe-eval" not in csp
        assert "<script>" not in page.text  # no inline script: the policy forbids it
        for ref in (
            "/ui/static/vendor/swagger-ui/swagger-ui-bundle.js",
            "/ui/static/vendor/swagger-ui/swagger-ui.css",
            "/ui/static/docs.js",
        ):
            assert ref in page.text
            assert http.get(ref).status_code == 200, ref
        refs = re.findall(r"""(?:src|href)="([^"]+)\"""", page.text)
        assert refs and all(r.startswith("/ui/static/") for r in refs), refs  # this origin only
        assert http.get("/redoc").status_code == 404  # FastAPI's CDN-loaded ReDoc is off
    vendor = STATIC_DIR / "vendor"
    assert "Apache License" in (vendor / "swagger-ui" / "LICENSE").read_text()
    assert "swagger-ui-dist@5.35.0" in (vendor / "README.md").read_text()


def test_the_schema_and_docs_are_public_and_every_data_route_needs_the_token(
    svc: LocalService,
) -> None:
    """As the README's auth section says: /openapi.json and /docs answer without a token (no
    data in them), the job routes do not."""
    with httpx.Client(base_url=svc.base_url, timeout=30) as http:
        schema = http.get("/openapi.json")
        assert schema.status_code == 200
        assert "bearer" in schema.json()["components"]["securitySchemes"]
        assert http.get("/docs").status_code == 200
        assert http.get("/api/v1/health").status_code == 200
        for path in ("/api/v1/jobs", "/api/v1/jobs/x", "/api/v1/jobs/x/artifacts"):
            assert http.get(path).status_code == 401, path
        assert svc.token not in schema.text


def test_the_docs_render_offline_in_chromium(svc: LocalService) -> None:
    """Swagger UI's own elements appear with this API's operations; not one request leaves
    loopback (any that tried would be aborted and listed), no script error or policy
    violation is logged."""
    left: list[str] = []
    with chromium() as browser:
        ctx = new_context(browser, None)

        def only_loopback(route):  # type: ignore[no-untyped-def]
            host = urlsplit(route.request.url).hostname or ""
            if route.request.url.startswith(("data:", "blob:")) or host in LOOPBACK:
                route.continue_()
            else:
                left.append(route.request.url)
                route.abort()

        ctx.route("**/*", only_loopback)
        w = watch(ctx.new_page())
        page = w.page
        page.goto(svc.base_url + "/docs")
        page.wait_for_selector(".swagger-ui .info .title")
        assert "dlrm-vrgd control service" in page.inner_text(".swagger-ui .info .title")
        page.wait_for_selector(".swagger-ui .opblock")
        paths = page.locator(".opblock-summary-path").all_inner_texts()
        assert any(p.replace("\u200b", "") == "/api/v1/jobs" for p in paths), paths
        assert page.locator(".swagger-ui .btn.authorize").count() == 1  # bearer scheme
        shot(page, "api-docs")
        ctx.close()
    assert not left
    hosts = {urlsplit(u).hostname for u in w.requests if u.startswith("http")}
    assert hosts <= LOOPBACK, hosts
    assert any(u.endswith("/openapi.json") for u in w.requests)
    assert not w.errors, w.errors


for _mark in BROWSER_MARKS:  # skip (saying why) without Playwright or Chromium
    test_the_docs_render_offline_in_chromium = _mark(test_the_docs_render_offline_in_chromium)
