"""The documentation site searches when opened from disk (file://, as `make docs` leaves it
in site/): a query typed in the search box lists the page that holds the word. mkdocs'
default search fetches its index from a web worker, which a browser refuses from file://;
the built-in `offline` plugin of mkdocs-material inlines it."""

from __future__ import annotations

from pathlib import Path

from .service.dashboard_browser import BROWSER_MARKS, chromium
from .test_docs import ROOT, mkdocs_build

pytestmark = BROWSER_MARKS


def test_search_works_from_the_file_system(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = mkdocs_build(ROOT, site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with chromium() as browser:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto((site / "index.html").as_uri())
        page.keyboard.press("/")  # material's shortcut: focus the search box
        page.keyboard.type("heap_release")
        page.wait_for_selector(".md-search-result__item", timeout=20_000)
        found = page.inner_text(".md-search-result__list")
        assert "heap_release" in found or "Configuration" in found, found[:500]
        assert not errors, errors
