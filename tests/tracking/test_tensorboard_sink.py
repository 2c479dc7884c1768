"""TensorBoard event files: every scalar equals its metrics.jsonl / gsnr.jsonl value at the
same step, read back with tensorboard's own reader; a rebuild equals live writing."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dlrm_vrgd.cli import main
from dlrm_vrgd.tracking import tensorboard_sink
from dlrm_vrgd.train.run import train

from ..conftest import tiny_config
from .events import accumulator, f32, hparams, jsonl, scalars

REPO = Path(__file__).resolve().parents[2]

VR = {"dense": {"name": "vradam", "lr": 0.01}, "sparse": {"name": "gsnr_rowwise_adagrad"}}
SPLIT_PREFIX = {"val": "val", "test": "test", "train": "train_eval"}


def numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def expected(run_dir: Path) -> dict[tuple[str, int], float]:
    """(tag, step) -> value, from the run directory's records and the tag scheme in README."""
    out: dict[tuple[str, int], float] = {}
    for r in jsonl(run_dir / "metrics.jsonl"):
        if r["kind"] == "train":
            prefix, skip = "train", {"kind", "step", "samples", "wall_time"}
        elif r["kind"] == "eval":
            prefix = SPLIT_PREFIX[r["split"]]
            skip = {"kind", "split", "step", "samples", "rows", "wall_time"}
        else:
            continue
        for key, value in r.items():
            if key not in skip and numeric(value):
                out[(f"{prefix}/{key}", r["step"])] = f32(value)
                out[(f"rows/{prefix}/{key}", r["samples"])] = f32(value)
    for r in jsonl(run_dir / "gsnr.jsonl"):
        for group, entries, name in (
            ("dense", r["dense"], "name"),
            ("table", r["tables"], "table"),
        ):
            for e in entries:
                for key, value in e.items():
                    if key not in ("name", "table", "numel") and numeric(value):
                        out[(f"gsnr/{group}/{e[name]}/{key}", r["step"])] = f32(value)
        noise = r["noise_scale"]
        for key in ("global_batch", "window_steps"):
            out[(f"noise_scale/{key}", r["step"])] = f32(noise[key])
        parts = [(scope, noise[scope]) for scope in ("model", "dense", "tables")]
        parts += [(f"tensor/{e['name']}", e) for e in noise["per_tensor"]]
        parts += [(f"table/{e['table']}", e) for e in noise["per_table"]]
        for prefix, e in parts:
            for key, value in e.items():
                if numeric(value):
                    out[(f"noise_scale/{prefix}/{key}", r["step"])] = f32(value)
    return out


def written(logdir: Path, hparam_tags: bool = False) -> dict[tuple[str, int], float]:
    out = {}
    for tag, points in scalars(logdir).items():
        steps = [s for s, _ in points]
        assert len(steps) == len(set(steps)), f"{tag}: a step written twice: {steps}"
        if tag.startswith("hparams/") == hparam_tags:
            out.update({(tag, s): v for s, v in points})
    return out


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tb") / "run"
    cfg = tiny_config(
        "run.eval_every=2", "run.final_train_eval_rows=256", "run.gsnr_every=1", optim=VR
    )
    assert cfg.run.tensorboard  # on by default
    train(cfg, out)
    return out


def test_every_scalar_equals_its_record_at_the_same_step(live: Path) -> None:
    logdir = live / "tb"
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1
    want, got = expected(live), written(logdir)
    assert got == want
    # what the issue names is there: loss, LRs, rows/s, AUC beside oracle, GSNR per tensor/table
    tags = {tag for tag, _ in got}
    for tag in (
        "train/loss",
        "train/lr_dense",
        "train/lr_sparse",
        "train/rows_per_s",
        "train/data_wait_s",  # the step's wait for input (the GPU starving)
        "val/auc",
        "val/oracle_auc",
        "test/logloss",
        "test/ne",
        "test/calibration",
        "train_eval/auc",
        "rows/val/auc",
        "gsnr/table/t_cat_0/multi_group_rows",
        "gsnr/table/t_cat_0/ratio",
        "gsnr/dense/dlrm.over_arch.model.1.weight/frac_clipped",
        "gsnr/dense/dlrm.over_arch.model.1.weight/raw_gsnr",
    ):
        assert tag in tags, tag
    assert [s for tag, s in got if tag == "train/loss"] == [1, 2, 3, 4]
    assert sorted(s for tag, s in got if tag == "rows/train/loss") == [256, 512, 768, 1024]


def test_hparams_set_the_flat_config_against_the_final_metrics(live: Path) -> None:
    result = json.loads((live / "result.json").read_text())
    params, metric_tags = hparams(live / "tb")
    assert params["optim.dense.name"] == "vradam"
    assert params["optim.dense.lr"] == pytest.approx(0.01)
    assert params["run.global_batch"] == 256
    assert params["data.cardinalities"] == "[40,25,60,8,100,3]"
    assert params["run.eval_rows"] == "None"
    finals = written(live / "tb", hparam_tags=True)
    step = result["steps"]
    assert finals[("hparams/test_auc", step)] == f32(result["test"]["auc"])
    assert finals[("hparams/val_oracle_auc", step)] == f32(result["val"]["oracle_auc"])
    assert finals[("hparams/final_loss", step)] == f32(result["final_loss"])
    assert finals[("hparams/train_auc", step)] == f32(result["train"]["auc"])
    assert set(metric_tags) == {tag for tag, _ in finals}


def test_rebuilding_afterwards_equals_writing_live(live: Path, tmp_path: Path, capsys) -> None:
    copy = tmp_path / "old-run"
    shutil.copytree(live, copy)
    shutil.rmtree(copy / "tb")  # a run made before tb/ existed
    assert main(["tensorboard", str(copy)]) == 0
    assert "tensorboard --logdir" in capsys.readouterr().out
    assert scalars(copy / "tb") == scalars(live / "tb")
    assert hparams(copy / "tb") == hparams(live / "tb")
    assert main(["tensorboard", str(copy)]) == 0  # again: replaced, not appended
    assert len(list((copy / "tb").glob("events.*"))) == 1
    assert scalars(copy / "tb") == scalars(live / "tb")


def wall_times(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, wall time)] as TensorBoard reads them."""
    acc = accumulator(logdir)
    return {t: [(e.step, e.wall_time) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_events_carry_the_wall_time_of_their_records_live_and_rebuilt(
    live: Path, tmp_path: Path
) -> None:
    """Every record is stamped with ``wall_time`` when written; its events carry that time,
    live and after ``dlrm-vrgd tensorboard`` (the real CLI) rebuilt ``tb/`` much later."""
    metrics, gsnr = jsonl(live / "metrics.jsonl"), jsonl(live / "gsnr.jsonl")
    assert all(isinstance(r["wall_time"], float) for r in metrics + gsnr)
    train_times = [r["wall_time"] for r in metrics if r["kind"] == "train"]
    assert train_times == sorted(train_times) and train_times[0] < train_times[-1]
    want = {
        "train/loss": [(r["step"], r["wall_time"]) for r in metrics if r["kind"] == "train"],
        "val/auc": [
            (r["step"], r["wall_time"])
            for r in metrics
            if r["kind"] == "eval" and r["split"] == "val"
        ],
        "gsnr/table/t_cat_0/ratio": [(r["step"], r["wall_time"]) for r in gsnr],
    }
    live_times = wall_times(live / "tb")
    for tag, points in want.items():
        assert live_times[tag] == points, tag  # the record's float, as the event's double
    copy = tmp_path / "old-run"
    shutil.copytree(live, copy)
    time.sleep(1.0)  # a rebuild's own clock would differ from every record's
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "tensorboard", str(copy)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rebuilt = wall_times(copy / "tb")

    def runs(times: dict[str, Any]) -> dict[str, Any]:
        return {t: p for t, p in times.items() if not t.startswith("hparams/")}

    assert runs(rebuilt) == runs(live_times)  # every tag, step and time as written live
    # the hparams summary (written live when result.json is) takes the last record's time
    last = max(r["wall_time"] for r in metrics)
    assert {tuple(p) for t, p in rebuilt.items() if t.startswith("hparams/")} == {((4, last),)}
    for tag, points in want.items():
        assert rebuilt[tag] == points, tag


def write_run(run_dir: Path, metrics: list[Any], gsnr: list[Any], tail: str = "") -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    for name, records in (("metrics.jsonl", metrics), ("gsnr.jsonl", gsnr)):
        lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
        (run_dir / name).write_text("".join(line + "\n" for line in lines) + tail)


def test_new_gsnr_fields_flow_through_and_nulls_are_skipped(tmp_path: Path) -> None:
    entry = {"name": "w", "numel": 6, "ratio": 0.5, "step_ratio_mean": 0.25, "raw_gsnr": None}
    entry |= {"placement": "update", "clipped": True}  # text and flags are not scalars
    table = {"table": "t0", "touched_rows": 7, "multi_group_rows": 3, "step_ratio_p10": 0.125}
    write_run(
        tmp_path / "run",
        [{"kind": "train", "step": 3, "samples": 300, "loss": 0.5, "rows_per_s": None}],
        [{"step": 3, "dense": [entry], "tables": [table]}],
        tail='{"step": 4, "dense": [',  # a torn last line (a run still writing) is skipped
    )
    tensorboard_sink.rebuild(tmp_path / "run")
    assert written(tmp_path / "run" / "tb") == {
        ("train/loss", 3): 0.5,
        ("rows/train/loss", 300): 0.5,
        ("gsnr/dense/w/ratio", 3): 0.5,
        ("gsnr/dense/w/step_ratio_mean", 3): 0.25,
        ("gsnr/table/t0/touched_rows", 3): 7.0,
        ("gsnr/table/t0/multi_group_rows", 3): 3.0,
        ("gsnr/table/t0/step_ratio_p10", 3): 0.125,
    }


def test_a_study_directory_rebuilds_every_cell(tmp_path: Path, capsys) -> None:
    study = tmp_path / "study"
    (study).mkdir()
    (study / "metrics.jsonl").write_text('{"kind": "cell", "step": 1}\n')  # the study's own
    for cell in ("G128-sgd", "G256-sgd"):
        write_run(
            study / "cells" / cell, [{"kind": "train", "step": 1, "samples": 1, "loss": 1}], []
        )
    assert main(["tensorboard", str(study)]) == 0
    assert sorted(p.parent.parent.name for p in study.glob("cells/*/tb/events.*")) == [
        "G128-sgd",
        "G256-sgd",
    ]
    assert not (study / "tb").exists()
    assert "[2/2]" in capsys.readouterr().out


def test_a_bad_record_is_an_error_naming_the_file_and_line(tmp_path: Path, capsys) -> None:
    write_run(tmp_path / "run", [{"kind": "train", "step": 1, "loss": 1.0}, "{not json"], [])
    assert main(["tensorboard", str(tmp_path / "run")]) == 2
    assert f"{tmp_path / 'run' / 'metrics.jsonl'}:2:" in capsys.readouterr().err
    assert main(["tensorboard", str(tmp_path / "nowhere")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_resume_rebuilds_so_no_step_shows_twice(tmp_path: Path) -> None:
    cfg = tiny_config("run.checkpoint_every=2", "run.eval_every=2")
    train(cfg, tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000004")  # "crashed" after step 4's records
    (tmp_path / "result.json").unlink()
    train(cfg, tmp_path, resume=True)  # steps 3 and 4 again
    got = written(tmp_path / "tb")  # asserts no (tag, step) twice
    assert got == expected(tmp_path)
    assert [s for tag, s in got if tag == "train/loss"] == [1, 2, 3, 4]


def test_a_failing_writer_is_logged_once_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: Any, values: Any, wall_time: float) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(tensorboard_sink.EventFile, "scalars", broken)
    with caplog.at_level(logging.WARNING):
        result = train(tiny_config("run.eval_every=2"), tmp_path)
    assert result.steps == 4 and (tmp_path / "result.json").exists()
    warnings = [r for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0].getMessage()


def test_tensorboard_off_writes_no_tb_dir(tmp_path: Path) -> None:
    train(tiny_config("run.tensorboard=false", "run.steps=1"), tmp_path)
    assert (tmp_path / "result.json").exists() and not (tmp_path / "tb").exists()


def test_an_event_file_is_closed_even_when_its_last_flush_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk at the end of a run: the flush fails, the error reaches the caller, and the
    file is closed anyway (not left to the garbage collector)."""
    from dlrm_vrgd.tracking.tensorboard_sink import EventFile

    events = EventFile(tmp_path / "tb")
    raw = events._writer._py_recordio_writer._writer

    def full_disk() -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(events._writer, "flush", full_disk)
    with pytest.raises(OSError, match="No space left"):
        events.close()
    assert raw.closed
