"""The dashboard in a real headless Chromium (Playwright), against a real service with a
finished tiny job and a running one.

Charts are checked through their data (``window.dashboard.charts[name].data``, what uPlot
draws) against the API's records, and by waiting for conditions, never by sleeping. A
screenshot of each page goes to ``test-artifacts/dashboard/``. Without Chromium (Debian's
``chromium`` at /usr/bin/chromium, or ``DLRM_VRGD_CHROMIUM``) or Playwright the tests skip.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from service.client import ServiceClient
from service.jobs import process
from service.jobs.runner import JOB_ENV
from service.launcher import LocalService

from ..conftest import tiny_config_dict
from .conftest import FAST_ENV, wait_for

try:
    from playwright.sync_api import Browser, BrowserContext, Page, sync_playwright
except ImportError:  # pragma: no cover - depends on the environment
    sync_playwright = None  # type: ignore[assignment]

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
TOKEN_KEY = "dlrm-vrgd.token"
#: Waits for things that happen in the browser (rendering, the event stream) and in jobs.
UI_TIMEOUT_MS = 30_000
JOB_TIMEOUT_MS = 90_000

pytestmark = [
    pytest.mark.skipif(
        sync_playwright is None,
        reason="Playwright is not installed (pip install -e '.[dev]')",
    ),
    pytest.mark.skipif(
        not CHROMIUM.is_file(),
        reason=f"no Chromium at {CHROMIUM}: apt-get install chromium (or set DLRM_VRGD_CHROMIUM)",
    ),
]

VR = {
    "dense": {"name": "vradam", "lr": 0.01},
    "sparse": {"name": "gsnr_rowwise_adagrad", "lr": 0.1},
}


@dataclass
class Served:
    svc: LocalService
    client: ServiceClient
    finished: dict[str, Any]
    running: dict[str, Any]

    def url(self, path: str) -> str:
        return self.svc.base_url + path


@dataclass
class Watched:
    """A page plus what it did: request URLs, uncaught errors, console errors."""

    page: Page
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A real service running two jobs at once: a tiny VR job that finishes (evals every 2
    steps, a checkpoint) and a long one that keeps running (evals every 5 steps)."""
    svc = LocalService.start(
        tmp_path_factory.mktemp("dashboard") / "data",
        secrets.token_urlsafe(24),
        env={**FAST_ENV, "DLRM_VRGD_MAX_CONCURRENT_JOBS": "2"},
    )
    client = svc.client()
    try:
        finished = client.submit(
            "tiny finished",
            tiny_config_dict(run={"steps": 8, "eval_every": 2, "checkpoint_every": 4}, optim=VR),
        )
        running = client.submit(
            "long running",
            tiny_config_dict(run={"steps": 100_000, "log_every": 1, "eval_every": 5}, optim=VR),
        )
        finished = client.wait(finished["id"], timeout=120)
        assert finished["state"] == "succeeded", finished["error"]
        running = wait_for(
            lambda: (j := client.job(running["id"]))["progress"].get("eval_step") and j,
            timeout=120,
        )
        yield Served(svc, client, finished, running)
    finally:
        client.close()
        svc.stop()
        for job_dir in (svc.data_dir / "jobs").glob("*"):
            for pid in process.job_processes(-1, f"{JOB_ENV}={job_dir.name}"):
                os.kill(pid, 9)


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
def browser() -> Iterator[Browser]:
    assert sync_playwright is not None
    pw = sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()
    finally:
        pw.stop()


def _context(browser: Browser, token: str | None) -> BrowserContext:
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    ctx.set_default_timeout(UI_TIMEOUT_MS)
    if token is not None:
        # as if the user had signed in once in this tab (sessionStorage)
        ctx.add_init_script(f"sessionStorage.setItem({json.dumps(TOKEN_KEY)}, {json.dumps(token)})")
    return ctx


def _watch(page: Page) -> Watched:
    w = Watched(page)
    page.on("request", lambda r: w.requests.append(r.url))
    page.on("pageerror", lambda e: w.errors.append(f"uncaught: {e}"))

    def console(msg: Any) -> None:
        # a 4xx the page handles (e.g. the study-kind probe) is logged by the browser itself
        if msg.type == "error" and not msg.text.startswith("Failed to load resource"):
            w.errors.append(f"console: {msg.text}")

    page.on("console", console)
    return w


@pytest.fixture
def signed_in(browser: Browser, served: Served) -> Iterator[Watched]:
    """A page of a tab that holds the token; afterwards: no script error, and the token was
    never part of any URL the page requested."""
    ctx = _context(browser, served.svc.token)
    w = _watch(ctx.new_page())
    yield w
    ctx.close()
    assert not w.errors
    assert w.requests and not [u for u in w.requests if served.svc.token in u]


def shot(page: Page, name: str) -> None:
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


def flat(points: list[tuple[float, float]]) -> list[float]:
    return [v for point in points for v in point]


def approx_flat(points: list[tuple[float, float]]) -> Any:
    """pytest.approx of a list of (x, y) points (approx takes no nested sequences)."""
    return pytest.approx(flat(points))


def pairs(data: list[list[float | None]], s: int) -> list[tuple[float, float]]:
    """(x, y) of series `s` where both have a value."""
    return [
        (x, y) for x, y in zip(data[0], data[s], strict=True) if y is not None and x is not None
    ]


# --------------------------------------------------------------------------------- tests
def test_without_a_token_the_pages_show_a_login_prompt_and_no_data(
    browser: Browser, served: Served
) -> None:
    ctx = _context(browser, None)
    w = _watch(ctx.new_page())
    page = w.page
    fin, run = served.finished["id"], served.running["id"]
    for path in ("/ui/", f"/ui/jobs/{fin}", f"/ui/compare?ids={fin},{run}", "/ui/studies"):
        page.goto(served.url(path))
        page.wait_for_selector("#login-form")
        assert page.locator("#token").is_visible()
        for data_view in ("#jobs", "#charts", "#compare-table", "#studies", "#tiles"):
            assert page.locator(data_view).count() == 0, (path, data_view)
        assert "tiny finished" not in page.content() and fin not in page.inner_text("main")
    assert not [u for u in w.requests if "/api/" in u]  # not one API request without a token
    shot(page, "login")

    page.goto(served.url("/ui/"))  # signing in shows the page asked for: here the list
    page.fill("#token", "not-the-token")
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("#login-error:has-text('refused')")
    assert page.locator("#jobs").count() == 0

    page.fill("#token", served.svc.token)
    page.click("#login-form button[type=submit]")
    page.wait_for_selector(f"tr[data-job-id='{run}']")
    assert page.evaluate(f"sessionStorage.getItem({json.dumps(TOKEN_KEY)})") == served.svc.token
    page.reload()  # kept for the session: no second prompt
    page.wait_for_selector(f"tr[data-job-id='{fin}']")
    assert page.locator("#login-form").count() == 0
    assert not [u for u in w.requests if served.svc.token in u]

    page.click("#sign-out")
    page.wait_for_selector("#login-form")
    assert page.evaluate(f"sessionStorage.getItem({json.dumps(TOKEN_KEY)})") is None
    assert page.locator("#jobs").count() == 0
    ctx.close()
    assert not w.errors


def test_a_token_the_service_refuses_brings_the_prompt_back_without_data(
    browser: Browser, served: Served
) -> None:
    """A stale or wrong token in the tab: the first API answer is 401, the page drops the
    token and shows the prompt (saying why) instead of any data."""
    ctx = _context(browser, "stale-token-from-another-service")
    w = _watch(ctx.new_page())
    page = w.page
    page.goto(served.url(f"/ui/jobs/{served.finished['id']}"))
    page.wait_for_selector("#login-error:has-text('401')")
    assert page.locator("#charts, #tiles, #jobs").count() == 0
    assert "tiny finished" not in page.inner_text("main")
    assert page.evaluate(f"sessionStorage.getItem({json.dumps(TOKEN_KEY)})") is None
    ctx.close()
    assert not w.errors


def test_the_list_shows_the_finished_and_the_running_job(
    signed_in: Watched, served: Served
) -> None:
    page = signed_in.page
    page.goto(served.url("/ui/"))
    fin = page.locator(f"tr[data-job-id='{served.finished['id']}']")
    run = page.locator(f"tr[data-job-id='{served.running['id']}']")
    fin.wait_for()
    run.wait_for()
    assert fin.get_attribute("data-state") == "succeeded"
    assert run.get_attribute("data-state") == "running"
    assert "tiny finished" in fin.inner_text() and "long running" in run.inner_text()
    progress = served.client.job(served.finished["id"])["progress"]
    assert fin.locator("[data-col=best-auc]").inner_text() == f"{progress['best_val_auc']:.4f}"
    assert fin.locator("[data-col=oracle-auc]").inner_text() == f"{progress['val_oracle_auc']:.4f}"
    assert "8 / 8" in fin.inner_text()
    assert run.locator("[data-col=rows-per-s]").inner_text() not in ("", "–")
    assert run.locator(".badge-running").is_visible()
    shot(page, "jobs")


def test_the_job_page_draws_the_auc_and_gsnr_charts(signed_in: Watched, served: Served) -> None:
    page = signed_in.page
    job_id = served.finished["id"]
    metrics = served.client.metrics(job_id)["data"]
    val = [r for r in metrics if r["kind"] == "eval" and r["split"] == "val"]
    train = [r for r in metrics if r["kind"] == "train"]
    gsnr = served.client.gsnr(job_id)["data"]
    assert len(val) == 4 and len(train) == 8 and len(gsnr) == 8

    page.goto(served.url(f"/ui/jobs/{job_id}"))
    wait_chart(page, "auc", 1, len(val))
    auc = chart_data(page, "auc")
    assert flat(pairs(auc, 1)) == approx_flat([(r["samples"], r["auc"]) for r in val])
    assert flat(pairs(auc, 2)) == approx_flat([(r["samples"], r["oracle_auc"]) for r in val])
    test = [r for r in metrics if r["kind"] == "eval" and r["split"] == "test"]
    assert flat(pairs(auc, 3)) == approx_flat([(r["samples"], r["auc"]) for r in test])

    wait_chart(page, "loss", 1, len(train))
    assert flat(pairs(chart_data(page, "loss"), 1)) == approx_flat(
        [(r["step"], r["loss"]) for r in train]
    )

    # per-layer and per-table GSNR: one small chart each, with the records' ratios
    dense = [t["name"] for t in gsnr[0]["dense"]]
    tables = [t["table"] for t in gsnr[0]["tables"]]
    assert dense and tables
    for kind, group, key, names in (
        ("dense", "dense", "name", dense),
        ("table", "tables", "table", tables),
    ):
        for name in names:
            chart = f"gsnr:{kind}:{name}"
            wait_chart(page, chart, 1, len(gsnr))
            data = chart_data(page, chart)
            ratios = [next(t for t in r[group] if t[key] == name)["ratio"] for r in gsnr]
            want = [(r["step"], ratio) for r, ratio in zip(gsnr, ratios, strict=True)]
            assert flat(pairs(data, 1)) == approx_flat(want)
            assert all(0 <= y <= 1 for _, y in pairs(data, 2))  # fraction clipped
    assert page.locator("#gsnr-dense .mult").count() == len(dense)
    assert page.locator("#gsnr-table .mult").count() == len(tables)
    wait_chart(page, "gsnr-summary", 1, len(train))

    # the canvas really has ink on it (not only data handed to the library)
    inked = page.evaluate(
        """() => {
            const c = document.querySelector('#charts canvas');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0;
            for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
            return n;
        }"""
    )
    assert inked > 500

    best = served.client.job(job_id)["progress"]["best_val_auc"]
    assert f"{best:.4f}" in page.inner_text("[data-tile=best-auc]")
    assert page.get_attribute("#stream-status", "data-status") == "ended"
    assert page.locator("#cancel-job").is_hidden()

    page.click("button[data-tab=config]")
    assert "global_batch: 256" in page.inner_text("#config")
    page.click("button[data-tab=result]")
    page.wait_for_selector("#final-metrics")
    page.click("button[data-tab=artifacts]")
    page.wait_for_selector("#artifacts button[data-path='result.json']")
    with page.expect_download() as download:
        page.click("#artifacts button[data-path='result.json']")
    saved = json.loads(Path(download.value.path()).read_text())
    assert saved == served.client.result(job_id)
    page.click("button[data-tab=logs]")
    page.wait_for_selector("#logs:has-text('test AUC')")
    shot(page, "job-finished")


def test_a_new_metric_point_arrives_live(signed_in: Watched, served: Served) -> None:
    page = signed_in.page
    job_id = served.running["id"]
    page.goto(served.url(f"/ui/jobs/{job_id}"))
    page.wait_for_function("() => window.dashboard.job && window.dashboard.job.stream === 'live'")
    wait_chart(page, "loss", 1, 1)
    wait_chart(page, "auc", 1, 1)
    page.wait_for_function("() => window.dashboard.job.historyLoaded")
    # the last step of the history the page fetched; a later one can only come from the stream
    history_last = page.evaluate("() => window.dashboard.job.historyLastStep")
    last_step = "() => window.dashboard.charts.loss.data[0].at(-1)"
    dense_name = served.client.gsnr(job_id, max_points=1)["data"][0]["dense"][0]["name"]
    gsnr_points = len(chart_data(page, f"gsnr:dense:{dense_name}")[0])

    page.wait_for_function(f"() => ({last_step})() > {history_last}", timeout=JOB_TIMEOUT_MS)
    after = page.evaluate(last_step)
    loss = dict(pairs(chart_data(page, "loss"), 1))[after]
    record = next(
        r
        for r in served.client.metrics(job_id, kind="train", after=0)["data"]
        if r["step"] == after
    )
    assert loss == pytest.approx(record["loss"])
    # it came over the event stream: the page fetched the metric history once, then listened
    assert page.evaluate("() => window.dashboard.job.metricsEvents") >= 1
    assert len([u for u in signed_in.requests if f"/jobs/{job_id}/metrics" in u]) == 1
    page.wait_for_function(
        "([name, n]) => window.dashboard.charts[name].data[0].length > n",
        arg=[f"gsnr:dense:{dense_name}", gsnr_points],
        timeout=JOB_TIMEOUT_MS,
    )
    assert page.locator("#cancel-job").is_visible()
    shot(page, "job-running")


def test_the_compare_view_overlays_the_auc_curves(signed_in: Watched, served: Served) -> None:
    page = signed_in.page
    fin, run = served.finished["id"], served.running["id"]
    page.goto(served.url(f"/ui/compare?ids={fin},{run}"))
    page.wait_for_function("() => window.dashboard.compare && window.dashboard.compare.loaded")
    # series: x, then (AUC, oracle) per job, in the order of the ids
    wait_chart(page, "compare-auc", 1, 4)
    wait_chart(page, "compare-auc", 3, 1)
    labels = page.evaluate("() => window.dashboard.charts['compare-auc'].series.map(s => s.label)")
    assert labels[1:] == [
        "tiny finished",
        "tiny finished oracle",
        "long running",
        "long running oracle",
    ]
    val = served.client.metrics(fin, kind="eval", split="val")["data"]
    data = chart_data(page, "compare-auc")
    assert flat(pairs(data, 1)) == approx_flat([(r["samples"], r["auc"]) for r in val])
    assert page.locator("#compare-table tbody tr").count() == 2
    assert page.locator("#compare-picker input:checked").count() == 2
    wait_chart(page, "compare-loss", 2, 1)

    page.click("[data-x=step]")  # the same curves against steps
    page.wait_for_function(
        "n => window.dashboard.charts['compare-auc'].data[0].includes(n)", arg=val[-1]["step"]
    )
    shot(page, "compare")


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


def _show_study(served: Served, study_out: Path) -> str:
    """Put a real study's report (not its cells) into the finished job's run directory, as a
    study job leaves it; returns that job's id."""
    job_id = served.finished["id"]
    run_dir = served.svc.data_dir / "jobs" / job_id / "run"
    for name in ("results.md", "results.json", "results.csv", "study.json"):
        shutil.copy(study_out / name, run_dir / name)
    for png in study_out.glob("*.png"):
        shutil.copy(png, run_dir / png.name)
    return job_id


def test_study_results_are_shown_from_the_artifacts(
    signed_in: Watched, served: Served, study_out: Path
) -> None:
    """What a study leaves in its run directory (results.md, PNG plots, JSON, CSV) is shown on
    the job's page from the artifacts API: the Markdown tables cell for cell, the plots."""
    page = signed_in.page
    job_id = _show_study(served, study_out)
    run_dir = served.svc.data_dir / "jobs" / job_id / "run"
    (run_dir / "notes.md").write_text("- <script>window.injected = 1</script> stays text\n")
    page.goto(served.url(f"/ui/jobs/{job_id}"))
    page.wait_for_selector("#results article[data-path='results.md'] table.md-table")
    shown = page.locator("article[data-path='results.md'] table.md-table td").all_inner_texts()
    assert shown == _md_cells((study_out / "results.md").read_text())
    pngs = sorted(p.name for p in study_out.glob("*.png"))
    assert len(pngs) == 3
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
    assert page.evaluate("() => window.injected") is None
    assert "<script>" in page.inner_text("#results")
    assert "null" not in page.inner_text("#results").split()
    shot(page, "job-results")


def test_the_studies_view_lists_study_jobs_and_the_newest_results(
    signed_in: Watched, served: Served, study_out: Path
) -> None:
    page = signed_in.page
    page.goto(served.url("/ui/studies"))
    page.wait_for_selector("#no-studies, #studies-table")
    assert page.locator("#no-studies").is_visible()  # no study job in this service (yet)
    shot(page, "studies")

    # With study jobs: the list, and the newest one's results. (`?kind=study` answers with
    # the job holding a real study's report, relabelled, until the service runs studies.)
    job_id = _show_study(served, study_out)
    study = {**served.client.job(job_id), "kind": "study", "name": "batch-size study"}
    page.route(
        re.compile(r".*/api/v1/jobs\?kind=study.*"),
        lambda route: route.fulfill(json={"data": [study], "count": 1}),
    )
    page.goto(served.url("/ui/studies"))
    page.wait_for_selector(f"#studies-table tr[data-job-id='{job_id}']")
    page.wait_for_selector("#latest-study article[data-path='results.md'] table.md-table")
    assert "batch-size study" in page.inner_text("#latest-study .section-title")
    assert "null" not in page.inner_text("#latest-study").split()
    page.wait_for_function(
        "() => [...document.querySelectorAll('#latest-study img')].some(i => i.naturalWidth > 0)"
    )
    shot(page, "studies-with-results")


def test_a_study_job_page_shows_its_cells_live(
    signed_in: Watched, served: Served, study_out: Path
) -> None:
    """A study job's page as the service will serve it (kind "study", one metrics record of
    kind "cell" per finished cell; dlrm_vrgd/study/run.py): the cells arrive over the event
    stream into a table and a chart of the best validation AUC per optimizer and batch."""
    page = signed_in.page
    job_id = _show_study(served, study_out)
    cells = [
        {**rec, "seq": seq}
        for seq, rec in enumerate(
            (json.loads(line) for line in (study_out / "metrics.jsonl").read_text().splitlines()),
            start=1,
        )
    ]
    assert len(cells) == 4 and {c["kind"] for c in cells} == {"cell"}
    job = {
        **served.client.job(job_id),
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
    page.goto(served.url(f"/ui/jobs/{job_id}"))
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
    assert page.locator("#charts .chart-card").count() == 0  # no training charts for a study
    page.wait_for_selector("#results article[data-path='results.md']")
    shot(page, "study-job")


def test_the_event_stream_reader_parses_any_chunking_and_resumes_after_the_last_event(
    signed_in: Watched, served: Served
) -> None:
    """sse.js in the page itself, with fetch() replaced: events split across chunks anywhere,
    CRLF line ends, comments; a stream that drops without `end` is resumed with the
    Last-Event-ID of the last event received and the bearer header, never a URL token."""
    page = signed_in.page
    page.goto(served.url("/ui/studies"))
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
        assert call["headers"]["Authorization"] == f"Bearer {served.svc.token}"


def test_the_series_store_drops_duplicates_and_replaces_rerun_steps(
    signed_in: Watched, served: Served
) -> None:
    """History and stream overlap (records at or below the last seq are dropped); a resumed
    run logs steps again after its checkpoint (they replace what followed)."""
    page = signed_in.page
    page.goto(served.url("/ui/studies"))
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


def test_cancel_works_from_the_job_page(signed_in: Watched, served: Served) -> None:
    page = signed_in.page
    job_id = served.running["id"]
    page.goto(served.url(f"/ui/jobs/{job_id}"))
    page.wait_for_function("() => window.dashboard.job && window.dashboard.job.stream === 'live'")
    page.click("#cancel-job")
    page.wait_for_selector("#cancel-dialog[open]")
    page.click("#confirm-cancel")
    page.wait_for_selector("#job-state [data-state=cancelled]", timeout=JOB_TIMEOUT_MS)
    assert served.client.job(job_id)["state"] == "cancelled"
    page.wait_for_selector("#stream-status[data-status=ended]")
    assert page.locator("#cancel-job").is_hidden()
    shot(page, "job-cancelled")


def _png(width: int, height: int) -> bytes:
    """A small RGB PNG (a gradient), written by hand: no imaging library needed."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = b"".join(
        b"\x00" + b"".join(bytes((4 * x % 256, 4 * y % 256, 160)) for x in range(width))
        for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
