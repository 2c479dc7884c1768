"""The dashboard: its pages under ``/ui/`` and its static files under ``/ui/static/``; and the
API docs (``/docs``: Swagger UI, vendored like uPlot, on ``/openapi.json``).

Every page is the same shell (``service/static/index.html``); its scripts pick the view from
the path and fetch the data from ``/api/v1`` with the bearer token the user entered. The shell
and the assets hold no data, so they are served without auth: without a token a page shows
the sign-in prompt and requests nothing. Pages go out with a strict Content-Security-Policy
(scripts, styles and connections to this origin only; images also from ``blob:`` for plots
fetched with the token) and no referrer.

The API schema and its docs page are public too, like the shell: they describe the API's
shape (the same as the published source) and hold no job, record or token, and Swagger UI
must read the schema before its *Authorize* dialog can take the token. Every route that reads
or changes data needs it.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"
INDEX = STATIC_DIR / "index.html"
DOCS = STATIC_DIR / "docs.html"
DOCS_PATH = "/docs"
UI_PREFIX = "/ui"

#: Sent with every page: scripts, styles, fetches from this origin only (no inline script or
#: style; uPlot and the views set styles through the CSSOM, which the policy allows).
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; "
        "img-src 'self' blob: data:; connect-src 'self'; object-src 'none'; "
        "base-uri 'none'; frame-ancestors 'none'; form-action 'none'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}

router = APIRouter(prefix=UI_PREFIX, include_in_schema=False)


def _page() -> FileResponse:
    return FileResponse(INDEX, media_type="text/html", headers=PAGE_HEADERS)


@router.get("")
def ui_root() -> RedirectResponse:
    return RedirectResponse(f"{UI_PREFIX}/")


@router.get("/")
def jobs_page() -> FileResponse:
    """The job list."""
    return _page()


@router.get("/jobs/{job_id}")
def job_page(job_id: str) -> FileResponse:
    """One job: live charts, GSNR, logs, config, artifacts, cancel. The id is checked by the
    API calls the page makes (an unknown one shows "No such job")."""
    return _page()


@router.get("/compare")
def compare_page() -> FileResponse:
    """AUC curves of several jobs (``?ids=a,b``)."""
    return _page()


@router.get("/studies")
def studies_page() -> FileResponse:
    """Study jobs and their results."""
    return _page()


def docs_page() -> FileResponse:
    """Swagger UI on ``/openapi.json``, every asset from ``/ui/static`` (works offline)."""
    return FileResponse(DOCS, media_type="text/html", headers=PAGE_HEADERS)


def install(app: FastAPI) -> None:
    """Add the dashboard to ``app``: the pages, ``/docs`` and ``/ui/static`` (the bundled
    assets). ``app`` is made with ``docs_url=None``: FastAPI's own page loads from a CDN."""
    app.include_router(router)
    app.add_api_route(DOCS_PATH, docs_page, methods=["GET"], include_in_schema=False)
    app.mount(f"{UI_PREFIX}/static", StaticFiles(directory=STATIC_DIR), name="ui-static")
