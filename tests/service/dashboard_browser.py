"""Shared parts of the dashboard's browser tests: Chromium through Playwright, pages that
record what they requested and every script error, screenshots, and reading a chart's data.

Charts are checked through their data (``window.dashboard.charts[name].data``, what uPlot
draws), and by waiting for conditions, never by sleeping. Screenshots go to
``test-artifacts/dashboard/``. Without Chromium (Debian's ``chromium`` at /usr/bin/chromium,
or ``DLRM_VRGD_CHROMIUM``) or Playwright, the tests that use :data:`BROWSER_MARKS` skip.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from service.client import ServiceClient
from service.launcher import LocalService

from .conftest import FAST_ENV

try:
    from playwright.sync_api import Browser, BrowserContext, Page, sync_playwright
except ImportError:  # pragma: no cover - depends on the environment
    sync_playwright = None  # type: ignore[assignment]
    Browser = BrowserContext = Page = Any  # type: ignore[assignment,misc]

CHROMIUM = Path(os.environ.get("DLRM_VRGD_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
#: Where the dashboard keeps the token (sessionStorage).
TOKEN_KEY = "dlrm-vrgd.token"
#: Waits for things that happen in the browser (rendering, the event stream) and in jobs.
UI_TIMEOUT_MS = 30_000
JOB_TIMEOUT_MS = 90_000

#: pytestmark of every browser test module: skip, saying why, without Playwright or Chromium.
BROWSER_MARKS = [
    pytest.mark.skipif(
        sync_playwright is None,
        reason="Playwright is not installed (pip install -e '.[dev]')",
    ),
    pytest.mark.skipif(
        not CHROMIUM.is_file(),
        reason=f"no Chromium at {CHROMIUM}: apt-get install chromium (or set DLRM_VRGD_CHROMIUM)",
    ),
]


@dataclass
class Watched:
    """A page plus what it did: request URLs, uncaught errors, console errors."""

    page: Page
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@contextmanager
def chromium() -> Iterator[Browser]:
    """Debian's Chromium, headless, driven by Playwright (never `playwright install`)."""
    assert sync_playwright is not None
    pw = sync_playwright().start()
    try:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield browser
        finally:
            browser.close()
    finally:
        pw.stop()


def new_context(browser: Browser, token: str | None) -> BrowserContext:
    """A browser tab's context; with `token`, as if the user had signed in once in it."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    ctx.set_default_timeout(UI_TIMEOUT_MS)
    if token is not None:
        ctx.add_init_script(f"sessionStorage.setItem({json.dumps(TOKEN_KEY)}, {json.dumps(token)})")
    return ctx


def watch(page: Page) -> Watched:
    w = Watched(page)
    page.on("request", lambda r: w.requests.append(r.url))
    page.on("pageerror", lambda e: w.errors.append(f"uncaught: {e}"))

    def console(msg: Any) -> None:
        # a 4xx the page handles (e.g. the study-kind probe) is logged by the browser itself
        if msg.type == "error" and not msg.text.startswith("Failed to load resource"):
            w.errors.append(f"console: {msg.text}")

    page.on("console", console)
    return w


@contextmanager
def signed_in_page(browser: Browser, token: str) -> Iterator[Watched]:
    """A page of a tab that holds the token; afterwards: no script error, and the token was
    never part of any URL the page requested."""
    ctx = new_context(browser, token)
    w = watch(ctx.new_page())
    yield w
    ctx.close()
    assert not w.errors
    assert w.requests and not [u for u in w.requests if token in u]


@contextmanager
def idle_service(data_dir: Path) -> Iterator[tuple[LocalService, ServiceClient]]:
    """A real service whose runner starts nothing (jobs stay queued): for pages that need the
    service's origin, its token and its artifacts API, but no training."""
    svc = LocalService.start(
        data_dir,
        secrets.token_urlsafe(24),
        env={**FAST_ENV, "DLRM_VRGD_MAX_CONCURRENT_JOBS": "0"},
    )
    client = svc.client()
    try:
        yield svc, client
    finally:
        client.close()
        svc.stop()


def shot(page: Page, name: str) -> None:
    """Save a full-page screenshot as test-artifacts/dashboard/NAME.png."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.evaluate("window.scrollTo(0, 0)")  # the sticky top bar where it belongs
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def chart_data(page: Page, name: str) -> list[list[float | None]]:
    """What the named uPlot chart draws: x values, then one array per series."""
    return page.evaluate(
        "name => window.dashboard.charts[name].data.map(a => Array.from(a, v => v ?? null))",
        name,
    )


def wait_chart(
    page: Page, name: str, series: int, points: int, timeout: int = UI_TIMEOUT_MS
) -> None:
    """Wait until chart `name` draws at least `points` values of its series `series`."""
    page.wait_for_function(
        """([name, s, n]) => {
            const u = window.dashboard && window.dashboard.charts[name];
            return !!u && u.data.length > s && u.data[s].filter(v => v != null).length >= n;
        }""",
        arg=[name, series, points],
        timeout=timeout,
    )


def pairs(data: list[list[float | None]], s: int) -> list[tuple[float, float]]:
    """(x, y) of series `s` where both have a value."""
    return [(x, y) for x, y in zip(data[0], data[s], strict=True) if None not in (x, y)]


def flat(points: list[tuple[float, float]]) -> list[float]:
    return [v for point in points for v in point]


def approx_flat(points: list[tuple[float, float]]) -> Any:
    """pytest.approx of a list of (x, y) points (approx takes no nested sequences)."""
    return pytest.approx(flat(points))
