"""The dashboard's own modules, run in the page itself (no node needed): the event-stream
reader (sse.js) and the job page's series store (series.js)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from service.launcher import LocalService

from .dashboard_browser import (
    BROWSER_MARKS,
    Watched,
    chromium,
    idle_service,
    signed_in_page,
)

pytestmark = BROWSER_MARKS


@dataclass
class Site:
    svc: LocalService

    def url(self, path: str) -> str:
        return self.svc.base_url + path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with idle_service(tmp_path_factory.mktemp("dashboard-modules") / "data") as (svc, _):
        yield Site(svc)


@pytest.fixture
def signed_in(site: Site) -> Iterator[Watched]:
    with chromium() as browser, signed_in_page(browser, site.svc.token) as w:
        yield w


def test_the_event_stream_reader_parses_any_chunking_and_resumes_after_the_last_event(
    signed_in: Watched, site: Site
) -> None:
    """sse.js in the page itself, with fetch() replaced: events split across chunks anywhere,
    CRLF line ends, comments; a stream that drops without `end` is resumed with the
    Last-Event-ID of the last event received and the bearer header, never a URL token."""
    page = signed_in.page
    page.goto(site.url("/ui/studies"))
    page.wait_for_selector("#no-studies, #studies-table")
    got = page.evaluate(
        r"""async () => {
        const { SSEParser, followEvents } = await import('/ui/static/js/sse.js');
        const text = 'retry: 3000\r\n\r\nid: 7\r\nevent: metrics\r\ndata: {"step": 1}\r\n\r\n' +
                     ': keep-alive\n\nevent: job\ndata: {"state":\ndata: "running"}\n\n';
        const parsed = [];
        for (let size = 1; size <= text.length; size++) {
            const p = new SSEParser();
            const events = [];
            for (let i = 0; i < text.length; i += size) {
                events.push(...p.feed(text.slice(i, i + size)));
            }
            parsed.push(JSON.stringify(events));
        }
        const calls = [];
        const bodies = [
            'id: 5\nevent: metrics\ndata: {"step": 5}\n\n' +
                'id: 6\nevent: gsnr\ndata: {"step": 5}\n\n',  // then the connection drops
            'id: 9\nevent: metrics\ndata: {"step": 6}\n\n' +
                'event: end\ndata: {"state": "succeeded"}\n\n',
        ];
        const realFetch = window.fetch;
        window.fetch = async (url, init) => {
            calls.push({ url: String(url), headers: init.headers });
            return new Response(bodies[calls.length - 1], { status: 200 });
        };
        const seen = [];
        try {
            const onEvent = (name, data, id) => seen.push([name, id, data]);
            await followEvents('abc', { after: 3, onEvent });
        } finally {
            window.fetch = realFetch;
        }
        return { parsed: [...new Set(parsed)], calls, seen };
    }"""
    )
    assert len(got["parsed"]) == 1  # the same events whatever the chunk size
    events = json.loads(got["parsed"][0])
    assert [(e["event"], e["id"]) for e in events] == [("metrics", "7"), ("job", None)]
    assert json.loads(events[1]["data"]) == {"state": "running"}
    assert [(n, i) for n, i, _ in got["seen"]] == [
        ("metrics", 5),
        ("gsnr", 6),
        ("metrics", 9),
        ("end", None),
    ]
    first, second = got["calls"]
    assert first["headers"]["Last-Event-ID"] == "3" and second["headers"]["Last-Event-ID"] == "6"
    for call in got["calls"]:
        assert call["url"] == "/api/v1/jobs/abc/events"
        assert call["headers"]["Authorization"] == f"Bearer {site.svc.token}"


def test_the_series_store_drops_duplicates_and_replaces_rerun_steps(
    signed_in: Watched, site: Site
) -> None:
    """History and stream overlap (records at or below the last seq are dropped); a resumed
    run logs steps again after its checkpoint (they replace what followed)."""
    page = signed_in.page
    page.goto(site.url("/ui/studies"))
    page.wait_for_selector("#no-studies, #studies-table")
    got = page.evaluate(
        """async () => {
        const { JobSeries } = await import('/ui/static/js/series.js');
        const s = new JobSeries();
        const train = (seq, step, loss) => ({ seq, kind: 'train', step, loss });
        const added = [train(1, 1, 0.7), train(2, 2, 0.6), train(3, 3, 0.5), train(2, 2, 0.6),
                       train(4, 2, 0.65), train(5, 3, 0.55)].map(r => s.addMetrics(r));
        s.addGsnr({ seq: 6, step: 1, dense: [{ name: 'w', ratio: 0.5 }], tables: [] });
        s.addGsnr({ seq: 7, step: 2, dense: [{ name: 'w', ratio: 0.6 }, { name: 'b', ratio: 1 }],
                    tables: [{ table: 't', ratio: 0.4, touched_rows: 10, multi_group_rows: 5 }] });
        return { added, steps: s.train.step, loss: s.train.loss,
                 w: s.dense.items.get('w').ratio, b: s.dense.items.get('b').ratio,
                 multi: s.tables.items.get('t').multi_fraction, tableRatio: s.gsnr.table_ratio };
    }"""
    )
    assert got["added"] == [True, True, True, False, True, True]
    assert got["steps"] == [1, 2, 3] and got["loss"] == [0.7, 0.65, 0.55]
    assert got["w"] == [0.5, 0.6] and got["b"] == [None, 1]
    assert got["multi"] == [None, 0.5] and got["tableRatio"] == [None, 0.4]
