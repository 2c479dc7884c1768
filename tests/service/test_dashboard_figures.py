"""The dashboard's figures as a user reads them at 1,400 px (issue 31, item 10): the jobs list
fits without a cut-off column, a study's "Best AUC" is its best validation AUC over the cells,
a score job's tiles read a formatted rows/s and its AUC, and the dense GSNR small multiples
scale their y-axis to a realised step ratio above 1 (with the reason on the panel).

A real idle service serves the pages and the jobs; where a page needs progress or records no
queued job has, the API's answers are given in the browser (``page.route``) in the shapes
``service/jobs/ingest.py`` and the trainer write."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.client import ServiceClient
from service.launcher import LocalService

from ..conftest import tiny_config_dict
from .dashboard_browser import (
    BROWSER_MARKS,
    Browser,
    Watched,
    chromium,
    idle_service,
    shot,
    signed_in_page,
)

pytestmark = BROWSER_MARKS

VRADAM = {
    "dense": {"name": "vradam", "lr": 0.01, "gamma": 0.1},
    "sparse": {"name": "gsnr_rowwise_adagrad", "lr": 0.1},
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalService, ServiceClient]]:
    with idle_service(tmp_path_factory.mktemp("figures") / "data") as pair:
        yield pair


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as b:
        yield b


@pytest.fixture
def signed_in(browser: Browser, site: tuple[LocalService, ServiceClient]) -> Iterator[Watched]:
    with signed_in_page(browser, site[0].token) as w:
        yield w


def _route_job(page, job: dict, metrics: list[dict], gsnr: list[dict]) -> None:
    """Answer a job's snapshot, history and event stream (the stream ends at once)."""
    api = f".*/api/v1/jobs/{job['id']}"
    page.route(re.compile(api + "$"), lambda r: r.fulfill(json=job))

    def answer(data: list[dict]):
        body = {"job_id": job["id"], "count": len(data), "next_after": None, "data": data}
        return lambda r: r.fulfill(json=body)

    for kind, data in (("metrics", metrics), ("gsnr", gsnr)):
        page.route(re.compile(api + rf"/{kind}\?.*"), answer(data))
    stream = f"event: job\ndata: {json.dumps(job)}\n\nevent: end\ndata: {json.dumps(job)}\n\n"
    page.route(
        re.compile(api + "/events.*"),
        lambda r: r.fulfill(body=stream, headers={"Content-Type": "text/event-stream"}),
    )


def _no_horizontal_overflow(page, selector: str) -> None:
    """Nothing of ``selector`` is cut off: it needs no horizontal scroll, and neither does the
    page."""
    box = page.eval_on_selector(selector, "e => [e.scrollWidth, e.clientWidth]")
    assert box[0] <= box[1] + 1, (selector, box)
    doc = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert doc[0] <= doc[1], doc


def test_the_jobs_list_fits_1400_px_and_a_study_shows_its_best_validation_auc(
    signed_in: Watched, site: tuple[LocalService, ServiceClient]
) -> None:
    svc, client = site
    ids = [
        client.submit(name, tiny_config_dict())["id"]
        for name in ("a-long-training-job-name-as-people-write-them-512k-vradam", "study", "score")
    ]
    listed = {j["id"]: j for j in client.jobs()["data"]}
    train, study, score = (listed[i] for i in ids)
    train = {**train, "state": "running", "progress": {
        "step": 1234, "total_steps": 4000, "fraction": 0.3085, "samples": 646_971_392,
        "loss": 0.4512, "rows_per_s": 9585.9452, "val_auc": 0.7012, "best_val_auc": 0.7024,
        "best_val_step": 1000, "val_oracle_auc": 0.8123, "test_oracle_auc": 0.8121}}  # fmt: skip
    # what ingest folds from three cell records: the best validation cell is the second
    study = {**study, "kind": "study", "state": "succeeded", "progress": {
        "step": 3, "total_steps": 3, "fraction": 1.0, "last_cell": "G512-c", "val_auc": 0.6480,
        "test_auc": 0.6473, "best_val_auc": 0.6686, "best_cell": "G256-b",
        "best_cell_test_auc": 0.6652, "test_oracle_auc": 0.7}}  # fmt: skip
    score = {**score, "kind": "score", "state": "succeeded", "progress": {
        "rows": 1_000_000, "rows_per_s": 9585.9452, "fraction": 1.0, "auc": 0.7312}}  # fmt: skip
    page = signed_in.page
    assert page.viewport_size == {"width": 1400, "height": 900}
    page.route(
        re.compile(r".*/api/v1/jobs\?.*"),
        lambda r: r.fulfill(json={"data": [train, study, score], "count": 3}),
    )
    page.goto(svc.base_url + "/ui/")
    page.wait_for_selector(f"#jobs tr[data-job-id='{ids[1]}']")
    _no_horizontal_overflow(page, ".table-card")
    card = page.eval_on_selector(".table-card", "e => e.getBoundingClientRect().right")
    run_time = page.locator("#jobs th", has_text="Run time")
    box = run_time.bounding_box()
    assert box is not None and box["x"] + box["width"] <= card
    row = f"#jobs tr[data-job-id='{ids[1]}'] td[data-col='best-auc']"
    assert page.inner_text(row) == "0.6686"  # not the last cell's test AUC, 0.6473
    shot(page, "jobs-1400")


def test_a_score_jobs_tiles_read_rows_per_s_and_auc(
    signed_in: Watched, site: tuple[LocalService, ServiceClient]
) -> None:
    svc, client = site
    job = client.submit("scored", tiny_config_dict())
    job = {**job, "kind": "score", "state": "succeeded", "progress": {
        "rows": 1_000_000, "rows_per_s": 9585.9452, "fraction": 1.0, "auc": 0.7312,
        "logloss": 0.4711}}  # fmt: skip
    page = signed_in.page
    _route_job(page, job, [], [])
    page.goto(svc.base_url + f"/ui/jobs/{job['id']}")
    page.wait_for_selector("[data-tile='rows-per-s']")
    tile = page.inner_text("[data-tile='rows-per-s'] .tile-value")
    assert tile == "9,586"
    assert page.inner_text("[data-tile='rows'] .tile-value") == "1,000,000"
    assert page.inner_text("[data-tile='auc'] .tile-value") == "0.7312"
    assert "logloss 0.4711" in page.inner_text("[data-tile='auc']")
    shot(page, "score-tiles")


def test_a_study_jobs_tiles_show_the_best_cell(
    signed_in: Watched, site: tuple[LocalService, ServiceClient]
) -> None:
    svc, client = site
    job = client.submit("study", tiny_config_dict())
    job = {**job, "kind": "study", "state": "succeeded", "progress": {
        "step": 3, "total_steps": 3, "fraction": 1.0, "last_cell": "G512-c", "val_auc": 0.6480,
        "test_auc": 0.6473, "best_val_auc": 0.6686, "best_cell": "G256-b",
        "best_cell_test_auc": 0.6652}}  # fmt: skip
    page = signed_in.page
    _route_job(page, job, [], [])
    page.goto(svc.base_url + f"/ui/jobs/{job['id']}")
    page.wait_for_selector("[data-tile='best-auc']")
    assert page.inner_text("[data-tile='best-auc'] .tile-value") == "0.6686"
    assert "G256-b" in page.inner_text("[data-tile='best-auc']")
    assert page.inner_text("[data-tile='best-test-auc'] .tile-value") == "0.6652"


def test_a_step_ratio_spike_gets_its_own_axis_and_never_flattens_the_gsnr_ratio(
    signed_in: Watched, site: tuple[LocalService, ServiceClient], tmp_path: Path
) -> None:
    """VR-Adam under the paper's placement: a realised step ratio of ×1.04 .. ×20 (the outside
    check saw spikes near 20) is drawn whole on a right-hand axis of its own that reaches past
    20, while the ratio r and the fraction clipped keep their 0..1.05 axis (the old panel grew
    that one to 21 and flattened r to a line at the bottom); a tensor whose step ratio stays
    below 1 keeps 0..1.05 on both; the panel says why the ratio can exceed 1."""
    svc, client = site
    job = client.submit("vradam", tiny_config_dict(optim=VRADAM))
    job = {**job, "state": "succeeded"}
    steps = [1, 2, 3, 4]
    realised = [1.04, 2.5, 20.0, 3.1]
    gsnr = [
        {"seq": i + 1, "step": s, "tables": [], "dense": [
            {"name": "dense.w", "numel": 30, "ratio": 0.6, "frac_clipped": 0.1,
             "step_ratio_mean": realised[i]},
            {"name": "dense.b", "numel": 6, "ratio": 0.8, "frac_clipped": 0.0,
             "step_ratio_mean": 0.9}]}
        for i, s in enumerate(steps)
    ]  # fmt: skip
    metrics = [
        {"seq": i + 1, "kind": "train", "step": s, "samples": 256 * s, "loss": 0.7}
        for i, s in enumerate(steps)
    ]
    page = signed_in.page
    _route_job(page, job, metrics, gsnr)
    page.goto(svc.base_url + f"/ui/jobs/{job['id']}")
    page.wait_for_function(
        "() => { const c = window.dashboard.charts['gsnr:dense:dense.w'];"
        " return !!c && c.data[3].filter(v => v != null).length === 4; }"
    )

    def scale(name: str, key: str) -> float:
        return page.evaluate(
            "([n, k]) => window.dashboard.charts[n].scales[k].max", [f"gsnr:dense:{name}", key]
        )

    assert scale("dense.w", "y") == pytest.approx(1.05)  # r keeps its axis
    assert scale("dense.w", "step") >= 20.0  # the spike, whole, on its own axis
    series = page.evaluate("n => window.dashboard.charts[n].series.map(s => s.scale)",
                           "gsnr:dense:dense.w")  # fmt: skip
    assert series[1:] == ["y", "y", "step", "y"]  # r, clipped, realised step ratio, γ
    assert scale("dense.b", "y") == pytest.approx(1.05)
    assert scale("dense.b", "step") == pytest.approx(1.05)
    note = page.inner_text("#gsnr-adam-note")
    assert "gsnr_placement: gradient" in note and "exceed 1" in note
    shot(page, "gsnr-step-axis")


def test_the_step_time_chart_shows_the_wait_for_input(
    signed_in: Watched, site: tuple[LocalService, ServiceClient]
) -> None:
    """Each train record's step_seconds and data_wait_s are drawn against its step, and the
    subtitle gives the last step's wait as a share of it (0.3 of 1.5 s: 20%)."""
    svc, client = site
    job = client.submit("input-wait", tiny_config_dict())
    job = {**job, "state": "succeeded"}
    times = [(1, 2.0, 1.2), (2, 1.6, 0.5), (3, 1.5, 0.3)]
    metrics = [
        {"seq": s, "kind": "train", "step": s, "samples": 256 * s, "loss": 0.7,
         "step_seconds": t, "data_wait_s": w}
        for s, t, w in times
    ]  # fmt: skip
    page = signed_in.page
    _route_job(page, job, metrics, [])
    page.goto(svc.base_url + f"/ui/jobs/{job['id']}")
    page.wait_for_function(
        "() => { const c = window.dashboard.charts['input-wait'];"
        " return !!c && c.data[0].length === 3; }"
    )
    data = page.evaluate("() => window.dashboard.charts['input-wait'].data")
    assert data == [[1, 2, 3], [2.0, 1.6, 1.5], [1.2, 0.5, 0.3]]
    card = page.locator(".chart-card", has_text="Step time and input wait")
    assert "input wait 20%" in card.locator(".chart-sub").inner_text()
