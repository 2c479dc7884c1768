"""The dashboard in a real headless Chromium (Playwright), against a real service with a
finished tiny job and a running one: sign-in, the job list, a job page's charts checked
against the API's records, a metric point arriving live, compare, cancel. A screenshot of
each page goes to ``test-artifacts/dashboard/`` (see ``dashboard_browser``)."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from service.client import API, ServiceClient
from service.jobs.backends import process
from service.jobs.backends.local import JOB_ENV
from service.launcher import LocalService

from ..conftest import tiny_config_dict
from .conftest import FAST_ENV, wait_for
from .dashboard_browser import (
    BROWSER_MARKS,
    JOB_TIMEOUT_MS,
    TOKEN_KEY,
    Browser,
    Watched,
    approx_flat,
    chart_data,
    chromium,
    flat,
    new_context,
    pairs,
    shot,
    signed_in_page,
    wait_chart,
    watch,
)

pytestmark = BROWSER_MARKS

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
def browser() -> Iterator[Browser]:
    with chromium() as b:
        yield b


@pytest.fixture
def signed_in(browser: Browser, served: Served) -> Iterator[Watched]:
    with signed_in_page(browser, served.svc.token) as w:
        yield w


def test_without_a_token_the_pages_show_a_login_prompt_and_no_data(
    browser: Browser, served: Served
) -> None:
    ctx = new_context(browser, None)
    w = watch(ctx.new_page())
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
    ctx = new_context(browser, "stale-token-from-another-service")
    w = watch(ctx.new_page())
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

    # the noise scale over training, in rows, against a line at the run's global batch
    noise = [r["noise_scale"] for r in gsnr]
    wait_chart(page, "noise-scale", 4, len(gsnr))
    data = chart_data(page, "noise-scale")
    want = [(r["step"], n["model"]["b_simple"]) for r, n in zip(gsnr, noise, strict=True)]
    assert flat(pairs(data, 1)) == approx_flat([(x, y) for x, y in want if y is not None])
    assert [y for _, y in pairs(data, 4)] == [256] * len(gsnr)
    labels = page.evaluate("() => window.dashboard.charts['noise-scale'].axes.map(a => a.label)")
    assert labels == ["step", "batch size (rows)"]
    assert page.evaluate("() => window.dashboard.charts['noise-scale'].scales.y.distr") == 3

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


def test_advice_of_a_running_and_a_finished_job(served: Served) -> None:
    """GET /jobs/{id}/advice reads the run directory's gsnr.jsonl as it stands: a running
    job's advice moves with it; a finished one's is result.json's ``noise_scale``."""
    client, running = served.client, served.running["id"]
    first = client.advice(running)
    assert first["global_batch"] == 256 and first["k"] == 4 and first["rows_per_group"] == 64
    model = first["scopes"]["model"]
    smoothed = model["smoothed"]  # the EMA series' drift, beside the window's estimate
    assert smoothed["p10"] <= smoothed["median"] <= smoothed["p90"]
    if model["b_simple"] is None:  # a window with no gradient signal (Σ|G|² ≤ 0): no trade-off
        assert "tradeoff" not in model and model["tradeoff_reason"]
    else:
        assert model["b_simple"] > 0
        assert [t["batch_over_g"] for t in model["tradeoff"]] == [0.25, 0.5, 1.0, 2.0, 4.0]
    assert "B_simple" in first["text"]  # the CLI's words (tests/service/test_advice_shown.py)
    assert "not a promise" in first["note"]
    wait_for(lambda: client.advice(running)["last_step"] > first["last_step"], timeout=60)
    finished = served.finished["id"]
    assert client.advice(finished) == client.result(finished)["noise_scale"]
    assert client.advice(finished, last=1.0)["steps"][0] == 1
    for bad in ("0", "2", "x"):
        r = client.http.get(f"{API}/jobs/{finished}/advice", params={"last": bad})
        assert r.status_code == 422 and "last" in r.text
    assert client.http.get(f"{API}/jobs/0123456789abcdef/advice").status_code == 404


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


def test_both_rows_per_s_figures_say_what_they_measure(signed_in: Watched, served: Served) -> None:
    """The list and the job's tile show the last step's rows/s, the final metrics the run's
    average (result.json's timings): each is labelled so."""
    page = signed_in.page
    job_id = served.finished["id"]
    page.goto(served.url("/ui/"))
    page.wait_for_selector(f"tr[data-job-id='{job_id}']")
    assert page.inner_text("th[data-col=rows-per-s]").lower() == "rows/s (last step)"

    page.goto(served.url(f"/ui/jobs/{job_id}"))
    tile = page.locator("[data-tile=rows-per-s]")
    tile.wait_for()
    assert tile.locator(".tile-label").inner_text().lower() == "rows/s (last step)"
    last_step = served.client.job(job_id)["progress"]["rows_per_s"]
    value = tile.locator(".tile-value").inner_text()
    assert value not in ("", "–") and value[0] == f"{last_step:.3g}"[0]
    page.click("button[data-tab=result]")
    page.wait_for_selector("#final-metrics")
    facts = dict(
        zip(
            page.locator(".facts dt").all_inner_texts(),
            page.locator(".facts dd").all_inner_texts(),
            strict=True,
        )
    )
    average = served.client.result(job_id)["timings"]["rows_per_s"]
    assert facts["rows/s (run average)"] == f"{round(average):,}"


def test_two_constant_learning_rates_draw_two_visible_lines(
    signed_in: Watched, served: Served
) -> None:
    """Dense 0.01 and sparse 0.1, both constant: each on its own axis, dense in the upper
    half and sparse in the lower, so both lines are on the canvas in their own colours, far
    apart; the GSNR legend tells solid from dashed; the test AUC points are drawn large."""
    page = signed_in.page
    job_id = served.finished["id"]
    train = served.client.metrics(job_id, kind="train")["data"]
    assert {r["lr_dense"] for r in train} == {0.01} and {r["lr_sparse"] for r in train} == {0.1}
    page.goto(served.url(f"/ui/jobs/{job_id}"))
    wait_chart(page, "lr", 2, len(train))
    got = page.evaluate(
        """() => {
            const u = window.dashboard.charts.lr;
            const i = Math.floor(u.data[0].length / 2);
            const x = Math.round(u.valToPos(u.data[0][i], "x", true));
            const at = (v, scale) => u.valToPos(v, scale, true);
            const patch = (y) =>
                Array.from(u.ctx.getImageData(x - 8, Math.round(y) - 2, 17, 5).data);
            const yd = at(u.data[1][i], "y"), ys = at(u.data[2][i], "lr_sparse");
            const rel = (y) => (y - u.bbox.top) / u.bbox.height;
            return { dense: rel(yd), sparse: rel(ys), densePx: patch(yd), sparsePx: patch(ys),
                     shown: [u.series[1].show, u.series[2].show],
                     labels: u.axes.slice(1).map((a) => a.label) };
        }"""
    )
    assert got["shown"] == [True, True]
    assert 0.05 < got["dense"] < 0.5 < got["sparse"] < 0.95  # canvas y grows downwards
    assert got["sparse"] - got["dense"] > 0.3
    assert "dense" in got["labels"][0] and "sparse" in got["labels"][1]

    def has(pixels: list[int], hex_color: str) -> bool:
        want = [int(hex_color[i : i + 2], 16) for i in (1, 3, 5)]
        for k in range(0, len(pixels), 4):
            if pixels[k + 3] > 200 and all(
                abs(a - b) < 40 for a, b in zip(pixels[k : k + 3], want, strict=True)
            ):
                return True
        return False

    colors = page.evaluate("() => window.dashboard.charts.lr.series.slice(1).map(s => s._stroke)")
    assert has(got["densePx"], colors[0]) and has(got["sparsePx"], colors[1])

    wait_chart(page, "gsnr-summary", 1, len(train))
    styles = page.evaluate(
        """() => Array.from(document.querySelectorAll('#charts .u-legend .u-series'))
            .filter(r => /dense (ratio|clipped)/.test(r.textContent))
            .map(r => getComputedStyle(r.querySelector('.u-marker')).borderTopStyle)"""
    )
    assert styles == ["solid", "dashed"]
    assert page.evaluate("() => window.dashboard.charts.auc.series[3].points.size") >= 10
    shot(page, "job-lr-chart")


def test_the_job_page_downloads_a_finished_jobs_model(signed_in: Watched, served: Served) -> None:
    import io
    import tarfile

    page = signed_in.page
    page.goto(served.url(f"/ui/jobs/{served.running['id']}"))  # running or cancelled by now
    page.wait_for_function("() => document.title.startsWith('long running ·')")
    assert page.locator("#download-model").is_hidden()  # it has no model
    job_id = served.finished["id"]
    page.goto(served.url(f"/ui/jobs/{job_id}"))
    page.wait_for_selector("#download-model", state="visible")
    assert page.locator("#download-predictions").is_hidden()
    assert page.locator("#model-job").is_hidden()
    with page.expect_download() as download:
        page.click("#download-model")
    assert download.value.suggested_filename == f"model-{job_id}.tar"
    data = Path(download.value.path()).read_bytes()
    assert data == served.client.model(job_id)
    names = tarfile.open(fileobj=io.BytesIO(data)).getnames()
    assert f"model-{job_id}/weights.pt" in names
