"""Study results in the dashboard, against the artifacts API: a real batch-size study's
report (``dlrm-vrgd study``: results.md, PNG plots, JSON/CSV) in a job's run directory is
shown on the job's page and on the Studies page, and a study job's cells arrive live. The
service does not run study jobs yet: where a page needs one, the job's snapshot, records and
event stream are answered in the browser (``page.route``) the way the service will."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from service.client import ServiceClient
from service.launcher import LocalService

from ..conftest import tiny_config_dict
from .dashboard_browser import (
    BROWSER_MARKS,
    Browser,
    Watched,
    approx_flat,
    chart_data,
    chromium,
    flat,
    idle_service,
    pairs,
    shot,
    signed_in_page,
)

pytestmark = BROWSER_MARKS


@dataclass
class Site:
    """An idle service and one (queued) job whose run directory holds a study's report."""

    svc: LocalService
    client: ServiceClient
    job_id: str
    run_dir: Path

    def url(self, path: str) -> str:
        return self.svc.base_url + path


@pytest.fixture(scope="module")
def study_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real batch-size study's output (dlrm-vrgd study), as small as a grid gets: 2 batch
    sizes x (sgd, vrsgd) x 1 LR x 1 seed, a few steps each."""
    from dlrm_vrgd.study import StudyConfig, run_study

    base = tiny_config_dict()
    study = StudyConfig.model_validate(
        {
            "name": "dashboard",
            "base": {
                "data": {**base["data"], "train_rows": None, "cache_mb": 64},
                "model": base["model"],
                "run": {"eval_batch": 1024},
            },
            "batch_sizes": [128, 256],
            "max_micro_batch": 64,
            "steps_at_largest": 4,
            "optimizers": [
                {
                    "name": name,
                    "dense": {"name": name, "momentum": 0.9},
                    "sparse": {"name": sparse},
                    "dense_lr": 0.05,
                    "sparse_lr": 0.1,
                    **({"baseline": "sgd"} if name == "vrsgd" else {}),
                }
                for name, sparse in (("sgd", "rowwise_adagrad"), ("vrsgd", "gsnr_rowwise_adagrad"))
            ],
            "lr_multipliers": [1.0],
            "seeds": [0],
            "reference_batch": 64,
            "evals_per_run": 2,
            "train_eval_rows": 512,
        }
    )
    out = tmp_path_factory.mktemp("study")
    run_study(study, out)
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, study_out: Path) -> Iterator[Site]:
    """The study's report (not its cells) copied into a job's run directory, as a study job
    leaves it there; the artifacts API serves it like any run's files."""
    with idle_service(tmp_path_factory.mktemp("dashboard-study") / "data") as (svc, client):
        job_id = client.submit("holds a study report", tiny_config_dict())["id"]
        run_dir = svc.data_dir / "jobs" / job_id / "run"
        run_dir.mkdir(parents=True)
        for name in ("results.md", "results.json", "results.csv", "study.json"):
            shutil.copy(study_out / name, run_dir / name)
        for png in study_out.glob("*.png"):
            shutil.copy(png, run_dir / png.name)
        yield Site(svc, client, job_id, run_dir)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as b:
        yield b


@pytest.fixture
def signed_in(browser: Browser, site: Site) -> Iterator[Watched]:
    with signed_in_page(browser, site.svc.token) as w:
        yield w


def _md_cells(markdown: str) -> list[str]:
    """The body cells of every pipe table in a Markdown text, in order."""
    out: list[str] = []
    lines = markdown.splitlines()
    state = "text"  # text -> header -> rule -> body
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            state = "text"
        elif state == "body":
            out += [c.strip() for c in line.strip().strip("|").split("|")]
        elif state == "header":
            state = "body"  # this line is the rule
        elif i + 1 < len(lines) and re.fullmatch(r"[|:\- ]+", lines[i + 1]):
            state = "header"
    return out


def test_study_results_are_shown_from_the_artifacts(
    signed_in: Watched, site: Site, study_out: Path
) -> None:
    """What a study leaves in its run directory (results.md, PNG plots, JSON, CSV) is shown on
    the job's page from the artifacts API: the Markdown tables cell for cell, the plots."""
    page = signed_in.page
    job_id = site.job_id
    (site.run_dir / "notes.md").write_text("- <script>window.injected = 1</script> stays text\n")
    page.goto(site.url(f"/ui/jobs/{job_id}"))
    page.wait_for_selector("#results article[data-path='results.md'] table.md-table")
    shown = page.locator("article[data-path='results.md'] table.md-table td").all_inner_texts()
    assert shown == _md_cells((study_out / "results.md").read_text())
    pngs = sorted(p.name for p in study_out.glob("*.png"))
    assert pngs == ["auc_vs_batch.png", "auc_vs_groups.png", "auc_vs_rows.png", "gsnr_ratio.png"]
    page.wait_for_function(
        """n => {
            const imgs = [...document.querySelectorAll('#result-plots img')];
            return imgs.length === n && imgs.every(i => i.complete && i.naturalWidth > 0);
        }""",
        arg=len(pngs),
    )
    assert (
        sorted(
            page.locator("#result-plots figure").evaluate_all("fs => fs.map(f => f.dataset.path)")
        )
        == pngs
    )
    for name in ("results.json", "results.csv", "study.json"):
        assert page.locator(f"#results button[data-path='{name}']").is_visible()
    assert page.locator("#results script").count() == 0
    # a wide table scrolls sideways under a sticky first column
    table = "article[data-path='results.md'] .table-scroll"
    first = f"{table} tbody tr:first-child td:first-child"
    assert page.eval_on_selector(first, "td => getComputedStyle(td).position") == "sticky"
    left = page.eval_on_selector(first, "td => td.getBoundingClientRect().left")
    page.eval_on_selector(table, "box => { box.style.maxWidth = '300px'; box.scrollLeft = 200; }")
    assert page.eval_on_selector(table, "box => box.scrollLeft") > 0
    assert page.eval_on_selector(first, "td => td.getBoundingClientRect().left") == left
    page.eval_on_selector(table, "box => { box.style.maxWidth = ''; box.scrollLeft = 0; }")
    assert page.evaluate("() => window.injected") is None
    assert "<script>" in page.inner_text("#results")
    assert "null" not in page.inner_text("#results").split()
    shot(page, "job-results")


def test_the_studies_view_lists_study_jobs_and_the_newest_results(
    signed_in: Watched, site: Site, study_out: Path
) -> None:
    page = signed_in.page
    page.goto(site.url("/ui/studies"))
    page.wait_for_selector("#no-studies, #studies-table")
    assert page.locator("#no-studies").is_visible()  # no study job in this service (yet)
    shot(page, "studies")

    # With study jobs: the list, and the newest one's results. (`?kind=study` is answered
    # with the job holding a real study's report, relabelled, until the service runs studies.)
    job_id = site.job_id
    study = {
        **site.client.job(job_id),
        "kind": "study",
        "name": "batch-size study",
        "state": "succeeded",
    }
    page.route(
        re.compile(r".*/api/v1/jobs\?kind=study.*"),
        lambda route: route.fulfill(json={"data": [study], "count": 1}),
    )
    page.goto(site.url("/ui/studies"))
    page.wait_for_selector(f"#studies-table tr[data-job-id='{job_id}']")
    page.wait_for_selector("#latest-study article[data-path='results.md'] table.md-table")
    assert "batch-size study" in page.inner_text("#latest-study .section-title")
    assert "null" not in page.inner_text("#latest-study").split()
    page.wait_for_function(
        "() => [...document.querySelectorAll('#latest-study img')].some(i => i.naturalWidth > 0)"
    )
    shot(page, "studies-with-results")


def test_a_study_job_page_shows_its_cells_live(
    signed_in: Watched, site: Site, study_out: Path
) -> None:
    """A study job's page as the service will serve it (kind "study", one metrics record of
    kind "cell" per finished cell; dlrm_vrgd/study/run.py): the cells arrive over the event
    stream into a table and a chart of the best validation AUC per optimizer and batch."""
    page = signed_in.page
    job_id = site.job_id
    cells = [
        {**rec, "seq": seq}
        for seq, rec in enumerate(
            (json.loads(line) for line in (study_out / "metrics.jsonl").read_text().splitlines()),
            start=1,
        )
    ]
    assert len(cells) == 4 and {c["kind"] for c in cells} == {"cell"}
    job = {
        **site.client.job(job_id),
        "kind": "study",
        "name": "batch-size study",
        "config": json.loads((study_out / "study.json").read_text()),
        "progress": {"step": 3, "total_steps": 4, "fraction": 0.75},
        "state": "running",
    }
    done = {**job, "state": "succeeded", "progress": {"step": 4, "total_steps": 4, "fraction": 1}}
    stream = (
        f"event: job\ndata: {json.dumps(job)}\n\n"
        f"id: {cells[-1]['seq']}\nevent: metrics\ndata: {json.dumps(cells[-1])}\n\n"
        f"event: end\ndata: {json.dumps(done)}\n\n"
    )
    api = f".*/api/v1/jobs/{job_id}"
    page.route(re.compile(api + "$"), lambda r: r.fulfill(json=job))
    page.route(
        re.compile(api + r"/metrics\?.*"),
        lambda r: r.fulfill(
            json={"job_id": job_id, "count": 3, "next_after": None, "data": cells[:3]}
        ),
    )
    page.route(
        re.compile(api + r"/gsnr\?.*"),
        lambda r: r.fulfill(json={"job_id": job_id, "count": 0, "next_after": None, "data": []}),
    )
    page.route(
        re.compile(api + "/events.*"),
        lambda r: r.fulfill(body=stream, headers={"Content-Type": "text/event-stream"}),
    )
    page.goto(site.url(f"/ui/jobs/{job_id}"))
    page.wait_for_selector("#stream-status[data-status=ended]")
    page.wait_for_function("() => document.querySelectorAll('#cells-body tr').length === 4")
    assert page.locator("#job-state [data-state=succeeded]").is_visible()
    assert "4 of 4 cells finished" in page.inner_text("#cells-count")
    labels = page.evaluate("() => window.dashboard.charts['study-cells'].series.map(s => s.label)")
    assert labels[1:] == ["sgd", "vrsgd", "oracle AUC"]
    data = chart_data(page, "study-cells")
    for s, opt in ((1, "sgd"), (2, "vrsgd")):
        want = sorted((c["global_batch"], c["val_auc"]) for c in cells if c["optimizer"] == opt)
        assert flat(pairs(data, s)) == approx_flat(want)
    # the y range fits the cells' AUCs (the oracle, far above them, is named beside the title)
    lo, hi = page.evaluate(
        "() => ['min', 'max'].map(k => window.dashboard.charts['study-cells'].scales.y[k])"
    )
    aucs = [c["val_auc"] for c in cells]
    assert lo < min(aucs) and max(aucs) < hi
    assert (min(aucs) - lo) / (hi - lo) < 0.2 and (hi - max(aucs)) / (hi - lo) < 0.2
    oracle = sum(c["oracle_auc"] for c in cells) / len(cells)
    if oracle > hi:
        assert f"oracle AUC {oracle:.4f} (above the range)" in page.inner_text("#study-cells")
    assert page.locator("#charts .chart-card").count() == 0  # no training charts for a study
    page.wait_for_selector("#results article[data-path='results.md']")
    shot(page, "study-job")


def test_a_wide_study_table_scrolls_inside_its_card_and_one_seed_has_no_sd(
    signed_in: Watched, site: Site
) -> None:
    """At 1,400 px the summary table (20 columns) scrolls inside its own box, on the job's page
    and on the Studies page: the page and the card do not widen, and its last column can be
    scrolled to. This study ran one seed: its "± sd" column reads "–", not 0.0000."""
    page = signed_in.page
    study = {**site.client.job(site.job_id), "kind": "study", "state": "succeeded"}
    page.route(
        re.compile(r".*/api/v1/jobs\?kind=study.*"),
        lambda route: route.fulfill(json={"data": [study], "count": 1}),
    )
    for path, scope in ((f"/ui/jobs/{site.job_id}", "#results"), ("/ui/studies", "#latest-study")):
        page.goto(site.url(path))
        table = f"{scope} article[data-path='results.md'] .table-scroll"
        page.wait_for_selector(f"{table} table.md-table")
        doc = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
        assert doc[0] <= doc[1], (path, doc)
        first = page.locator(table).first
        width = first.evaluate("e => [e.scrollWidth, e.clientWidth]")
        assert width[0] > width[1], (path, width)  # wide: it scrolls ...
        rights = first.evaluate(
            "e => [e.getBoundingClientRect().right,"
            " e.closest('.card').getBoundingClientRect().right]"
        )
        assert rights[0] <= rights[1] + 1, (path, rights)  # ... inside its card
        first.evaluate("e => { e.scrollLeft = e.scrollWidth; }")
        last = first.locator("thead th").last.bounding_box()
        assert last is not None and last["x"] + last["width"] <= rights[0] + 1, path
    headers = [t.strip().lower() for t in first.locator("thead th").all_inner_texts()]
    sd = headers.index("± sd")
    rows = first.locator("tbody tr")
    values = [rows.nth(i).locator("td").nth(sd).inner_text() for i in range(rows.count())]
    assert values and set(values) == {"–"}, values
