"""MLPerf's protocol as run options: ``run.target_auc`` stops a run at the first validation
eval that reaches it, ``run.evals_per_epoch`` sets the eval cadence from the epoch's steps,
and result.json records the target (reached or not) and the samples/s per rank. Expected
steps and figures are worked out here by hand or from the run's own metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dlrm_vrgd import checkpoint as ckpt
from dlrm_vrgd.config import ConfigError, load_config, parse_config
from dlrm_vrgd.rundir import read_jsonl
from dlrm_vrgd.train.run import Callback, train
from service.jobs.ingest import update_progress

from ..conftest import tiny_config, tiny_config_dict

# tiny_config: 4096 training rows at 256 rows a step, 16 steps an epoch
EVERY_STEP = ("run.steps=12", "run.eval_every=1", "run.eval_rows=256")


class Evals(Callback):
    """(step, AUC) of every validation eval, periodic and final."""

    def __init__(self) -> None:
        self.val: list[tuple[int, float]] = []

    def on_eval(self, record: dict) -> None:
        if record["split"] == "val":
            self.val.append((record["step"], record["auc"]))


def test_a_reachable_target_stops_at_the_first_eval_reaching_it(tmp_path: Path) -> None:
    # the AUCs of the run without a target (the target changes nothing before it is reached)
    seen = Evals()
    train(tiny_config(*EVERY_STEP), None, [seen])
    periodic = seen.val[:-1]  # the last is the final eval
    k = next(
        i for i in range(2, len(periodic) - 1) if periodic[i][1] > max(a for _, a in periodic[:i])
    )
    target = (max(a for _, a in periodic[:k]) + periodic[k][1]) / 2
    expected = periodic[k][0]
    assert expected < 11

    out = tmp_path / "run"
    cfg = tiny_config(*EVERY_STEP, f"run.target_auc={target!r}")
    result = train(cfg, out)
    assert result.steps == expected and result.stopped_early is None

    records = read_jsonl(out / "metrics.jsonl")
    steps = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, expected + 1))  # stopped there
    evals = [r for r in records if r["kind"] == "eval" and r["split"] == "val"]
    at = next(r for r in evals if r["auc"] >= target)
    assert at["step"] == expected and all(r["auc"] < target for r in evals[: evals.index(at)])
    [reached] = [r for r in records if r["kind"] == "target_reached"]
    assert records.index(reached) == records.index(at) + 1  # right after the eval
    # the service folds these records as any run's (its own record kind is passed over)
    progress = update_progress({}, records, [])
    assert progress["step"] == expected and progress["fraction"] == expected / 12
    assert progress["best_val_auc"] == max(r["auc"] for r in evals)

    stored = json.loads((out / "result.json").read_text())
    tgt = stored["target"]
    assert (
        tgt == result.target
        and {k: v for k, v in reached.items() if k not in ("kind", "wall_time")} == tgt
    )
    assert tgt["reached"] is True and tgt["target_auc"] == target
    assert tgt["step"] == expected and tgt["val_auc"] == at["auc"] and tgt["evals"] == expected
    assert tgt["samples"] == at["samples"] == expected * 256
    assert tgt["epochs"] == steps[-1]["epoch"] == pytest.approx(expected * 256 / 4096)
    assert tgt["train_seconds"] == pytest.approx(sum(r["step_seconds"] for r in steps))
    assert 0 < tgt["eval_seconds"] <= stored["timings"]["eval_seconds"]
    # MLPerf's time to train: the steps and the evals (and what lies between), not start-up
    assert tgt["train_seconds"] + tgt["eval_seconds"] <= tgt["wall_seconds"]
    assert tgt["wall_seconds"] <= stored["timings"]["wall_seconds"]
    assert tgt["from_step"] == 0
    timings = stored["timings"]
    assert (
        timings["rows_per_s_per_rank"]
        == timings["rows_per_s"]
        == pytest.approx(expected * 256 / timings["train_seconds"])
    )  # one process: per rank is the whole
    # the final evals still ran, on the weights of the target's step, which is checkpointed
    assert stored["test"]["step"] == expected
    assert [r["step"] for r in records if r["kind"] == "eval" and r["split"] == "test"] == [
        expected
    ]
    assert f"step_{expected:08d}" in [p.name for p in ckpt.list_checkpoints(out)]

    # resuming a run that reached its target does nothing more
    before = (out / "metrics.jsonl").read_bytes(), (out / "result.json").read_bytes()
    again = train(cfg, out, resume=True)
    assert again.already_finished and again.steps == expected and again.target == tgt
    assert ((out / "metrics.jsonl").read_bytes(), (out / "result.json").read_bytes()) == before


def test_evals_per_epoch_and_a_target_never_reached(tmp_path: Path) -> None:
    # 16 steps an epoch, 3 evals an epoch: every floor(4096 / (256 * 3)) = floor(5.33) = 5 steps
    # (MLPerf's reference rounding); the 16th step is the last: the final evals score it
    out = tmp_path / "run"
    cfg = tiny_config(
        "run.epochs=1", "run.steps=null", "run.evals_per_epoch=3", "run.target_auc=1.0"
    )
    assert cfg.run.eval_every == 0 and cfg.run.eval_interval(4096) == 5
    result = train(cfg, out)
    assert result.steps == 16  # never reached: the run goes to its end

    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "eval" and r["split"] == "val"] == [
        5, 10, 15, 16,
    ]  # fmt: skip
    start = next(r for r in records if r["kind"] == "start")
    assert start["eval_every"] == 5 and start["target_auc"] == 1.0
    assert not [r for r in records if r["kind"] == "target_reached"]
    stored = json.loads((out / "result.json").read_text())
    assert stored["target"] == {
        "target_auc": 1.0, "reached": False, "step": None, "samples": None, "epochs": None,
        "val_auc": None, "train_seconds": None, "eval_seconds": None, "evals": 4,
        "wall_seconds": None, "from_step": 0,
    }  # fmt: skip
    assert stored["timings"]["rows_per_s_per_rank"] == stored["timings"]["rows_per_s"] > 0
    assert stored["timings"]["wall_seconds"] >= stored["timings"]["train_seconds"]


def test_no_target_records_none_and_samples_per_rank_still() -> None:
    result = train(tiny_config("run.steps=2"), None)
    assert result.target is None and result.wall_seconds > 0


def test_evals_per_epoch_rounds_down_and_never_below_one_step() -> None:
    cfg = tiny_config("run.evals_per_epoch=20")  # MLPerf's 20 on the tiny epoch: 16 / 20 < 1
    assert cfg.run.eval_interval(4096) == 1
    # MLPerf DLRMv2 at 55,296 rows a step over days 0-22 (4,195,197,692 rows): 75,868 steps
    # an epoch, an eval every floor(75,868.01 / 20) = 3,793 steps, as its reference computes
    mlperf = parse_config(
        tiny_config_dict(run={"global_batch": 55_296, "micro_batch": 6912, "evals_per_epoch": 20})
    )
    assert mlperf.run.eval_interval(4_195_197_692) == 4_195_197_692 // (55_296 * 20) == 3793
    assert mlperf.run.eval_interval(4_195_197_692) * 55_296 * 20 <= 4_195_197_692
    # early stopping counts evals of either cadence
    parse_config(tiny_config_dict(run={"evals_per_epoch": 4, "early_stop_patience": 2}))


def test_both_cadences_are_refused_naming_both_fields(tmp_path: Path) -> None:
    raw = tiny_config_dict(run={"eval_every": 50, "evals_per_epoch": 20})
    with pytest.raises(ConfigError, match=r"run\.eval_every \(50\) and run\.evals_per_epoch"):
        parse_config(raw)
    done = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "config", "--config", "/dev/stdin"],
        input=yaml.safe_dump(raw),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error:") or "error:" in done.stderr
    assert "run.eval_every (50) and run.evals_per_epoch (20) are both set" in done.stderr
    assert "Traceback" not in done.stderr
    # eval_every 0 says "no step cadence": consistent, accepted
    assert parse_config(tiny_config_dict(run={"eval_every": 0, "evals_per_epoch": 2}))
    # --set of one replaces the file's other, as run.steps does run.epochs
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(run={"eval_every": 7})))
    cfg = load_config(path, ["run.evals_per_epoch=4"])
    assert (cfg.run.eval_every, cfg.run.evals_per_epoch) == (0, 4)
    path.write_text(yaml.safe_dump(tiny_config_dict(run={"evals_per_epoch": 4})))
    cfg = load_config(path, ["run.eval_every=7"])
    assert (cfg.run.eval_every, cfg.run.evals_per_epoch) == (7, None)


def test_the_service_refuses_both_naming_both_fields() -> None:
    """A job's config is validated by TrainJobCreate; its error is the 422 the service answers
    (service/main.py: field config.run, the message naming both fields)."""
    from pydantic import ValidationError

    from service.schemas import TrainJobCreate

    config = tiny_config_dict(run={"eval_every": 50, "evals_per_epoch": 20})
    with pytest.raises(ValidationError) as err:
        TrainJobCreate.model_validate({"name": "both", "config": config})
    [issue] = err.value.errors()
    assert issue["loc"] == ("config", "run")
    assert "run.eval_every (50) and run.evals_per_epoch (20) are both set" in issue["msg"]
