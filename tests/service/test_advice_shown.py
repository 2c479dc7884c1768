"""Issue 48: the service's advice says what ``dlrm-vrgd advise`` says. A run directory's
gsnr.jsonl planted in a queued train job (nothing trains): ``GET /jobs/{id}/advice`` is the
CLI's ``--json`` and its ``text`` the CLI's printed words, and the job page shows that text."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from service.launcher import LocalService

from .conftest import tiny_job
from .dashboard_browser import CHROMIUM, chromium, idle_service, signed_in_page, sync_playwright


def _plant(run: Path) -> None:
    """120 records of a run at G = 1,024 (k = 4 x 256), B_simple ≈ 2,000: an interval."""
    rng = np.random.default_rng(48)
    s_raw = 2000.0 + rng.normal(0, 400, 120)
    g2_raw = 1.0 + rng.normal(0, 0.5, 120)
    run.mkdir(parents=True, exist_ok=True)
    with (run / "gsnr.jsonl").open("w") as f:
        for i in range(120):
            smooth = s_raw[: i + 1].sum() / g2_raw[: i + 1].sum()
            scope = {"b_simple": smooth, "s_raw": s_raw[i], "g2_raw": g2_raw[i]}
            noise = {"k": 4, "rows_per_group": 256, "global_batch": 1024, "model": scope}
            f.write(json.dumps({"step": i + 1, "noise_scale": noise}) + "\n")


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalService, str, Path]]:
    with idle_service(tmp_path_factory.mktemp("advice") / "data") as (svc, client):
        made = client.submit("advice", tiny_job())
        run = svc.data_dir / "jobs" / made["id"] / "run"
        _plant(run)
        yield svc, made["id"], run


def _cli(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "advise", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_api_gives_the_cli_s_numbers_and_words(planted) -> None:
    svc, job_id, run = planted
    with svc.client() as client:
        advice = client.advice(job_id)
        quarter = client.advice(job_id, last=0.25)
    assert advice == json.loads(_cli(str(run), "--json"))
    assert advice["text"] == _cli(str(run)).rstrip("\n")
    model = advice["scopes"]["model"]
    assert model["interval"]["batches"] >= 5  # an interval, with the batches it used
    assert f"B_simple {model['b_simple']:,.0f} (Σ S / Σ |G|²" in advice["text"]
    assert quarter["text"] == _cli(str(run), "--last", "0.25").rstrip("\n")


@pytest.mark.skipif(
    sync_playwright is None or not CHROMIUM.is_file(), reason="no Playwright or no Chromium"
)
def test_the_job_page_shows_the_advice_text(planted) -> None:
    svc, job_id, run = planted
    with svc.client() as client:
        text = client.advice(job_id)["text"]
    with chromium() as browser, signed_in_page(browser, svc.token) as w:
        w.page.goto(f"{svc.base_url}/ui/jobs/{job_id}")
        w.page.wait_for_selector("#advice-text:not(:empty)")
        shown = w.page.inner_text("#advice-text")
        assert w.page.is_visible("#advice")
    assert shown.strip() == text.strip()
    assert "95% interval" in shown and "critical batch" in shown
