"""The gradient noise scale in a training run (DESIGN.md 4.6): gsnr.jsonl's ``noise_scale``
records, the trainer's groups and rows per group against a per-group autograd reference,
``k = 1``, TensorBoard, result.json and ``dlrm-vrgd advise``."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlrm_vrgd.advice import advise_records, quantile
from dlrm_vrgd.optim.noise_scale import SINGLE_GROUP_REASON
from dlrm_vrgd.rundir import read_jsonl
from dlrm_vrgd.train.loop import Trainer
from dlrm_vrgd.train.run import train

from ..conftest import tiny_config

SGD = {"optim": {"dense": {"name": "sgd", "lr": 0.1}, "sparse": {"name": "rowwise_adagrad"}}}


def test_trainer_dense_estimate_equals_per_group_autograd_reference() -> None:
    """G = 256 as A = 4 micro-batches of B = 64: the reference takes each micro-batch's dense
    gradient with its own ``autograd.grad`` and applies the estimator with k = 4, b = 64."""
    trainer = Trainer(tiny_config(**SGD))
    params = [p for _, p in trainer.model.named_dense_parameters()]
    groups = []
    for j in range(trainer.A):
        loss, _ = trainer.model.loss(trainer.micro_batch(0, j))
        grads = torch.autograd.grad(loss, params)
        groups.append(torch.cat([g.reshape(-1) for g in grads]).double())
        for lk in trainer.lookups:
            lk.capture.take()  # drop this reference pass's captured lookups
    g = torch.stack(groups)
    k, b = 4, 64
    sq_of_mean, mean_of_sq = g.mean(0).square().sum(), g.square().sum(1).mean()
    g2 = (k * sq_of_mean - mean_of_sq) / (k - 1)
    s = b * k / (k - 1) * (mean_of_sq - sq_of_mean)
    trainer.train_step()
    noise = trainer.gsnr_record()["noise_scale"]
    assert noise["k"] == k and noise["rows_per_group"] == b and noise["global_batch"] == 256
    assert noise["dense"]["g2_raw"] == pytest.approx(float(g2), rel=1e-4)
    assert noise["dense"]["s_raw"] == pytest.approx(float(s), rel=1e-4)
    assert noise["dense"]["g2"] == pytest.approx(float(g2), rel=1e-4)  # one step: EMA = raw
    model = noise["model"]  # the tables add their own |G|² and S
    assert model["s_raw"] == pytest.approx(noise["dense"]["s_raw"] + noise["tables"]["s_raw"])
    assert len(noise["per_table"]) == len(trainer.lookups[0].table_names)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("noise") / "run"
    train(tiny_config("run.steps=6", "run.gsnr_every=2", **SGD), out)
    return out


def test_records_on_gsnr_steps_tensorboard_and_result(run: Path) -> None:
    from tests.tracking.events import f32, scalars

    records = read_jsonl(run / "gsnr.jsonl")
    assert [r["step"] for r in records] == [1, 2, 4, 6]
    for r in records:
        noise = r["noise_scale"]
        assert noise["ema_steps"] == r["step"] and 0 < noise["window_steps"] <= r["step"]
        # plain SGD measures no GSNR (``dense`` is empty), the noise scale all the same
        assert not r["dense"] and len(noise["per_tensor"]) == 8  # 2 MLPs x 2 layers x (W, b)
        assert noise["dense"]["s"] > 0 and noise["tables"]["s"] > 0
    last = records[-1]["noise_scale"]
    tb = scalars(run / "tb")
    assert tb["noise_scale/global_batch"][-1] == (6, 256.0)
    for scope in ("model", "dense", "tables"):
        value = last[scope]["b_simple"]
        if value is not None:
            assert tb[f"noise_scale/{scope}/b_simple"][-1] == (6, f32(value))
    name = last["per_tensor"][0]["name"]
    assert tb[f"noise_scale/tensor/{name}/s"][-1] == (6, f32(last["per_tensor"][0]["s"]))
    result = json.loads((run / "result.json").read_text())
    assert result["noise_scale"]["global_batch"] == 256
    assert result["noise_scale"]["steps"] == [4, 6]  # the last half of 6 steps' records


def test_advise_cli_on_the_run(run: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "advise", str(run), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    advice = json.loads(proc.stdout)
    values = sorted(
        r["noise_scale"]["dense"]["b_simple"]
        for r in read_jsonl(run / "gsnr.jsonl")
        if r["step"] > 3 and r["noise_scale"]["dense"]["b_simple"] is not None
    )
    dense = advice["scopes"]["dense"]
    assert dense["smoothed"]["median"] == pytest.approx(statistics.median(values))
    window = [r["noise_scale"]["dense"] for r in read_jsonl(run / "gsnr.jsonl") if r["step"] > 3]
    g2 = sum(d["g2_raw"] for d in window)
    est = sum(d["s_raw"] for d in window) / g2 if g2 > 0 else None
    assert dense["b_simple"] == (pytest.approx(est) if est is not None else None)
    text = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "advise", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "global batch G = 256" in text and "not a promise" in text
    bad = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "advise", str(run), "--last", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--last" in bad.stderr


def test_one_group_per_step_says_why(tmp_path: Path) -> None:
    out = tmp_path / "k1"
    train(tiny_config("run.steps=2", "run.micro_batch=256", "run.tensorboard=false", **SGD), out)
    for r in read_jsonl(out / "gsnr.jsonl"):
        assert r["noise_scale"]["k"] == 1 and r["noise_scale"]["reason"] == SINGLE_GROUP_REASON
    result = json.loads((out / "result.json").read_text())
    assert result["noise_scale"]["reason"] == SINGLE_GROUP_REASON


def test_advice_numbers_by_hand() -> None:
    """Five records at G = 1000: the last half (steps > 5) holds B_simple 400, 500, 300 (and
    one with no estimate); median 400, p10 = 300 + 0.2·(400 − 300) = 320, and the paper's
    model at B = G: steps/S_min = 1 + 400/1000 = 1.4, rows/E_min = 1 + 1000/400 = 3.5."""

    def rec(step: int, b: float | None) -> tuple[int, dict]:
        raw = {"s_raw": 400.0, "g2_raw": 1.0}  # the window's ratio of means: 400
        return step, {"k": 4, "rows_per_group": 250, "global_batch": 1000,
                      "dense": {"b_simple": b, **raw}}  # fmt: skip

    records = [
        rec(2, 10.0),
        rec(4, 20.0),
        rec(6, 400.0),
        rec(8, 500.0),
        rec(9, None),
        rec(10, 300.0),
    ]
    advice = advise_records(records, last=0.5)
    dense = advice["scopes"]["dense"]
    assert advice["steps"] == [6, 10]
    smoothed = dense["smoothed"]
    assert smoothed["median"] == 400.0 and smoothed["p10"] == pytest.approx(320.0)
    assert smoothed["p90"] == pytest.approx(480.0) and smoothed["records_without_estimate"] == 1
    assert dense["b_simple"] == 400.0  # the headline: the window's ratio of means
    assert dense["g_over_b_simple"] == pytest.approx(2.5)
    at = {t["batch_over_g"]: t for t in dense["tradeoff"]}
    assert at[1.0]["steps_over_min"] == pytest.approx(1.4)
    assert at[1.0]["rows_over_min"] == pytest.approx(3.5)
    assert at[0.25]["steps_over_min"] == pytest.approx(1 + 400 / 250)
    assert at[4.0]["rows_vs_g"] == pytest.approx((1 + 4000 / 400) / 3.5)
    assert quantile([1.0, 2.0], 0.5) == 1.5


def test_advice_skips_malformed_lines() -> None:
    from dlrm_vrgd.advice import noise_records

    lines = [b"not json\n", b"[1]\n", b'{"step": "x", "noise_scale": {}}\n',
             b'{"step": 3, "noise_scale": {"global_batch": 8, "dense": {"b_simple": 2.0}}}\n',
             b'{"step": 4, "noise_scale": {"dense": {"b_simple": "NaN"}}}']  # fmt: skip
    found = list(noise_records(lines))
    assert [s for s, _ in found] == [3, 4]
    advice = advise_records(found)
    assert advice["scopes"]["dense"]["smoothed"]["median"] == 2.0
    assert advice["global_batch"] is None
    assert advise_records([])["reason"].startswith("no noise_scale records")


def test_resume_continues_the_noise_scale_ema(tmp_path: Path) -> None:
    """The EMAs are checkpointed: a run crashed at step 3 and resumed from step 2 writes the
    noise-scale records of the uninterrupted run."""
    from ..checkpoint.test_checkpoint import CrashAt

    cfg = tiny_config("run.steps=4", "run.checkpoint_every=2", "run.tensorboard=false", **SGD)
    train(cfg, tmp_path / "whole")
    with pytest.raises(RuntimeError):
        train(cfg, tmp_path / "crashed", callbacks=[CrashAt(3)])
    train(cfg, tmp_path / "crashed", resume=True)
    whole = read_jsonl(tmp_path / "whole" / "gsnr.jsonl")
    resumed = read_jsonl(tmp_path / "crashed" / "gsnr.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(whole, resumed, strict=True):
        assert b["noise_scale"]["ema_steps"] == a["noise_scale"]["ema_steps"]
        for scope in ("model", "dense", "tables"):
            for f in ("g2", "s", "g2_raw", "s_raw"):
                assert b["noise_scale"][scope][f] == pytest.approx(a["noise_scale"][scope][f])
