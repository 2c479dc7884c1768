"""The dashboard's pages and assets as the service serves them (no browser needed): every page
is the shell with a strict policy, every asset it loads ships in the package, nothing comes
from another origin, and the demo prints the dashboard URL."""

from __future__ import annotations

import re
import secrets
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service import demo
from service.api.routes.pages import STATIC_DIR
from service.client import Event
from service.demo import dashboard_url
from service.launcher import LocalService

from .conftest import FAST_ENV

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["/ui/", "/ui/jobs/0123456789abcdef", "/ui/compare?ids=a,b", "/ui/studies"]
#: import "./x.js" / from "../y.js" in the modules
IMPORT = re.compile(r"""(?:import|from)\s*["']([^"']+)["']""")
SRC_HREF = re.compile(r"""(?:src|href)="([^"]+)\"""")


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """Unauthenticated HTTP to a real service (its runner holds jobs: nothing trains)."""
    svc = LocalService.start(
        tmp_path_factory.mktemp("pages") / "data",
        secrets.token_urlsafe(24),
        env={**FAST_ENV, "DLRM_VRGD_MAX_CONCURRENT_JOBS": "0"},
    )
    try:
        with httpx.Client(base_url=svc.base_url, timeout=30) as client:
            yield client
    finally:
        svc.stop()


def _module_graph(http: httpx.Client) -> dict[str, str]:
    """Every JS module reachable from app.js: URL -> source (each fetched from the service)."""
    seen: dict[str, str] = {}
    todo = ["/ui/static/js/app.js"]
    while todo:
        url = todo.pop()
        if url in seen:
            continue
        res = http.get(url)
        assert res.status_code == 200, url
        assert "javascript" in res.headers["content-type"], url
        seen[url] = res.text
        base = url.rsplit("/", 1)[0]
        for spec in IMPORT.findall(res.text):
            assert spec.startswith("."), f"{url} imports {spec!r}: only relative modules ship"
            parts = (base + "/" + spec).split("/")
            resolved: list[str] = []
            for part in parts:
                if part == "..":
                    resolved.pop()
                elif part != ".":
                    resolved.append(part)
            todo.append("/".join(resolved))
    return seen


def test_every_page_is_the_shell_with_a_strict_policy(http: httpx.Client) -> None:
    for path in PAGES:
        res = http.get(path, follow_redirects=False)
        assert res.status_code == 200, path
        assert res.headers["content-type"].startswith("text/html")
        assert '<script type="module" src="/ui/static/js/app.js">' in res.text
        csp = res.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert "connect-src 'self'" in csp and "unsafe-inline" not in csp
        assert res.headers["referrer-policy"] == "no-referrer"
    assert http.get("/ui", follow_redirects=False).headers["location"] == "/ui/"
    assert http.get("/", follow_redirects=False).headers["location"] == "/ui/"


def test_pages_carry_no_data_and_stay_out_of_the_api_schema(http: httpx.Client) -> None:
    shell = http.get("/ui/jobs/0123456789abcdef").text
    assert "0123456789abcdef" not in shell  # the same static shell for every job
    paths = http.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if p.startswith("/ui")]


def test_every_asset_ships_in_the_package_and_nothing_comes_from_elsewhere(
    http: httpx.Client,
) -> None:
    shell = http.get("/ui/").text
    refs = SRC_HREF.findall(shell)
    local = [r for r in refs if r.startswith("/ui/static/")]
    assert set(refs) - set(local) == {"/ui/", "/ui/compare", "/ui/studies", "/docs"}
    for ref in local:
        assert http.get(ref).status_code == 200, ref
    modules = _module_graph(http)
    names = {u.rsplit("/", 1)[1] for u in modules}
    assert {"app.js", "api.js", "sse.js", "charts.js", "job.js", "compare.js"} <= names
    for url, source in modules.items():
        # no absolute URL in any string: every request goes to this origin
        assert not re.search(r"[\"'`]https?://|[\"'`]//", source), url
    css = http.get("/ui/static/dashboard.css").text
    assert "url(" not in css and "@import" not in css
    # the charting library is the vendored uPlot, with its license and provenance
    lib = http.get("/ui/static/vendor/uplot/uPlot.iife.min.js").text
    assert lib.startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")
    assert "MIT License" in (STATIC_DIR / "vendor" / "uplot" / "LICENSE").read_text()
    assert "uplot@1.6.32" in (STATIC_DIR / "vendor" / "README.md").read_text()


def test_static_files_cannot_reach_outside_their_directory(http: httpx.Client) -> None:
    for path in ("/ui/static/../main.py", "/ui/static/%2e%2e/main.py", "/ui/static/nope.js"):
        assert http.get(path).status_code == 404, path


def test_the_static_files_are_package_data() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["service"]
    service_dir = STATIC_DIR.parent
    packaged = {p for pat in patterns for p in service_dir.glob(pat) if p.is_file()}
    shipped = {p for p in STATIC_DIR.rglob("*") if p.is_file()}
    assert shipped and shipped <= packaged


class _FakeClient:
    """What run_demo needs of a ServiceClient: a job that succeeds at once."""

    def submit(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        return {"id": "job1", "progress": {"total_steps": 4}}

    def events(self, job_id: str) -> Iterator[Event]:
        yield Event("end", {"state": "succeeded", "progress": {}}, None)

    def result(self, job_id: str) -> dict[str, Any]:
        metrics = {"auc": 0.8, "logloss": 0.45, "ne": 0.8, "oracle_auc": 0.82}
        return {"steps": 4, "samples": 1024, "val": metrics, "test": metrics, "timings": {}}

    def close(self) -> None:
        pass


def test_the_demo_prints_the_dashboard_url_of_its_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    class FakeService:
        base_url = "http://127.0.0.1:8123"
        data_dir = tmp_path

        @classmethod
        def start(cls, *args: Any, **kwargs: Any) -> FakeService:
            return cls()

        def client(self) -> _FakeClient:
            return _FakeClient()

        def stop(self) -> None:
            pass

    monkeypatch.setattr(demo, "LocalService", FakeService)
    assert demo.run_demo(ROOT / "configs" / "demo.yaml", [], tmp_path) == 0
    out = capsys.readouterr().out
    url = "http://127.0.0.1:8123/ui/jobs/job1"
    assert dashboard_url("http://127.0.0.1:8123", "job1") == url
    # once while the job runs (to watch it live), once with the URLs at the end
    assert out.count(url) == 2
    assert "watch it live in the browser" in out
