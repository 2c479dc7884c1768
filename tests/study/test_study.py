"""Batch-size studies: grid rules, resumability, selection on validation, consistent outputs."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from dlrm_vrgd.config import ConfigError
from dlrm_vrgd.study import StudyConfig, run_study
from dlrm_vrgd.study.report import summarize
from dlrm_vrgd.train.loop import Trainer
from dlrm_vrgd.train.rundir import read_jsonl

TINY = {
    "name": "tiny",
    "base": {
        "data": {
            "source": "synthetic",
            "seed": 1,
            "val_rows": 1024,
            "test_rows": 1024,
            "cardinalities": [40, 25, 60, 8, 100, 3],
            "chunk_rows": 512,
            "cache_mb": 64,
        },
        "model": {"embedding_dim": 8, "dense_arch": [16, 8], "over_arch": [16, 1]},
        "run": {"eval_batch": 1024},
    },
    "batch_sizes": [128, 256],
    "max_micro_batch": 64,
    "steps_at_largest": 4,
    "optimizers": [
        {
            "name": "sgd",
            "dense": {"name": "sgd", "momentum": 0.9},
            "sparse": {"name": "rowwise_adagrad"},
            "dense_lr": 0.05,
            "sparse_lr": 0.1,
        },
        {
            "name": "vrsgd",
            "baseline": "sgd",
            "dense": {"name": "vrsgd", "momentum": 0.9},
            "sparse": {"name": "gsnr_rowwise_adagrad"},
            "dense_lr": 0.05,
            "sparse_lr": 0.1,
        },
    ],
    "lr_multipliers": [0.5, 1.0],
    "seeds": [0, 1],
    "reference_batch": 64,
    "evals_per_run": 2,
    "train_eval_rows": 512,
}


def tiny(**changes: object) -> StudyConfig:
    return StudyConfig.model_validate({**TINY, **changes})


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[StudyConfig, Path, dict]:
    study, out = tiny(), tmp_path_factory.mktemp("study")
    return study, out, run_study(study, out)


def test_tiny_grid_writes_every_output(finished) -> None:
    study, out, results = finished
    assert len(study.cells()) == 16 and results["cells_finished"] == 16
    for name in (
        "study.json",
        "results.json",
        "result.json",
        "metrics.jsonl",
        "results.csv",
        "results.md",
        "auc_vs_batch.png",
        "auc_vs_rows.png",
        "gsnr_ratio.png",
    ):
        assert (out / name).stat().st_size > 0, name
    for cell in study.cells():
        assert (out / "cells" / cell.id / "result.json").exists()
        # one TensorBoard run per cell: `tensorboard --logdir OUT` shows the grid
        assert len(list((out / "cells" / cell.id / "tb").glob("events.out.tfevents.*"))) == 1
    assert not (out / "tb").exists()
    progress = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in progress] == list(range(1, 17))
    assert {r["kind"] for r in progress} == {"cell"} and progress[-1]["total_cells"] == 16
    summary = results["summary"]
    assert [(s["global_batch"], s["optimizer"]) for s in summary] == [
        (128, "sgd"),
        (128, "vrsgd"),
        (256, "sgd"),
        (256, "vrsgd"),
    ]
    for s in summary:
        assert s["seeds"] == 2 and 0.5 < s["test_auc"] < 1 and s["oracle_gap"] > 0
        assert s["train_test_gap"] is not None and s["wall_s"] >= 0  # rounded to 0.1 s
    assert all(c["wall_s"] > 0 for c in results["cells"])
    vr = [s for s in summary if s["optimizer"] == "vrsgd"]
    assert all(0.1 <= s["gsnr_dense"] <= 1 and 0.1 <= s["gsnr_tables"] <= 1 for s in vr)
    assert [p["global_batch"] for p in results["pairs"]] == [128, 256]
    assert (out / "results.csv").read_text().splitlines()[0].startswith("global_batch,")


def test_rerun_skips_finished_cells(finished) -> None:
    study, out, results = finished
    stamps = {
        c.id: (out / "cells" / c.id / "result.json").stat().st_mtime_ns for c in study.cells()
    }
    victim = study.cells()[5]
    (out / "cells" / victim.id / "result.json").unlink()  # as if interrupted mid-cell
    seen: list[tuple[str, str]] = []
    again = run_study(study, out, on_cell=lambda i, n, c, status, r: seen.append((c.id, status)))
    assert [s for c, s in seen if c != victim.id] == ["skip"] * 15
    assert [s for c, s in seen if c == victim.id] == ["start", "done"]
    for c in study.cells():
        if c.id != victim.id:
            assert (out / "cells" / c.id / "result.json").stat().st_mtime_ns == stamps[c.id]
    assert again["summary"] == results["summary"]  # the rerun cell reproduces itself


def test_another_study_in_the_same_directory_is_refused(finished) -> None:
    _, out, _ = finished
    with pytest.raises(ValueError, match="different study"):
        run_study(tiny(steps_at_largest=8), out)


def test_a_grown_grid_runs_only_the_new_cells(finished, tmp_path: Path) -> None:
    study, out, _ = finished
    copy = tmp_path / "study"
    shutil.copytree(out, copy)
    grown = tiny(lr_multipliers=[0.5, 1.0, 2.0])
    seen: list[tuple[str, str]] = []
    results = run_study(grown, copy, on_cell=lambda i, n, c, status, r: seen.append((c.id, status)))
    old = {c.id for c in study.cells()}
    assert {c for c, s in seen if s == "skip"} == old
    assert {c for c, s in seen if s == "done"} == {c.id for c in grown.cells()} - old
    assert len(results["cells"]) == len(grown.cells()) == 24


def test_a_finished_cell_trained_with_another_config_is_refused(finished, tmp_path: Path) -> None:
    study, out, _ = finished
    copy = tmp_path / "study"
    shutil.copytree(out, copy)
    victim = study.cells()[3]
    path = copy / "cells" / victim.id / "config.json"
    cfg = json.loads(path.read_text())
    cfg["optim"]["dense"]["lr"] *= 2
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=re.escape(victim.id)):
        run_study(study, copy)


def test_markdown_numbers_equal_the_json(finished) -> None:
    _, out, results = finished
    md = (out / "results.md").read_text()
    rows = [line for line in md.splitlines() if re.match(r"\| [\d,]+ \| \d+ \|", line)]
    assert len(rows) == len(results["summary"])
    for line, s in zip(rows, results["summary"], strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert int(cells[0].replace(",", "")) == s["global_batch"]
        assert int(cells[1]) == s["steps"] and cells[2] == s["optimizer"]
        assert float(cells[3]) == s["best_lr_multiplier"]
        assert float(cells[4]) == s["val_auc"] and float(cells[5]) == s["test_auc"]
        assert float(cells[6]) == s["test_auc_sd"] and float(cells[7]) == s["oracle_gap"]
        assert float(cells[8]) == s["train_test_gap"]
    pair_rows = [line for line in md.splitlines() if "| vrsgd | sgd |" in line]
    for line, p in zip(pair_rows, results["pairs"], strict=True):
        assert float(line.split("|")[4]) == p["delta_test_auc"]


def test_data_sizing_gives_every_batch_at_least_the_steps() -> None:
    study = tiny(batch_sizes=[64, 128, 256], steps_at_largest=5)
    assert study.train_rows == 5 * 256
    for g in study.batch_sizes:
        cell = next(c for c in study.cells() if c.global_batch == g)
        cfg = study.cell_config(cell)
        assert cfg.data.train_rows == study.train_rows
        steps = Trainer(cfg).total_steps
        assert steps == study.train_rows // g >= study.steps_at_largest
        assert cfg.optim.schedule.warmup_steps == math.ceil(0.05 * steps)


def test_lr_grid_is_what_the_config_says() -> None:
    study = tiny(lr_multipliers=[0.125, 0.25, 0.5, 1.0, 2.0])
    seen = {}
    for cell in study.cells():
        cfg = study.cell_config(cell)
        rule = math.sqrt(cell.global_batch / 64)
        assert cfg.optim.dense.lr == pytest.approx(0.05 * rule * cell.lr_multiplier)
        assert cfg.optim.sparse.lr == pytest.approx(0.1 * rule * cell.lr_multiplier)
        assert cfg.run.seed == cell.seed and cfg.data.seed == 1  # same rows for every cell
        seen.setdefault((cell.global_batch, cell.optimizer), set()).add(cell.lr_multiplier)
    assert all(v == {0.125, 0.25, 0.5, 1.0, 2.0} for v in seen.values())  # below the rule too
    assert {c.seed for c in study.cells()} == {0, 1}


def test_selection_uses_validation_never_test() -> None:
    study = tiny(batch_sizes=[256], optimizers=[TINY["optimizers"][0]])

    def fig(m: float, seed: int, val: float, test: float) -> dict:
        return {
            "global_batch": 256,
            "optimizer": "sgd",
            "lr_multiplier": m,
            "seed": seed,
            "val_auc": val,
            "test_auc": test,
            "steps": 4,
            "dense_lr": m,
            "sparse_lr": m,
            "oracle_test_auc": 0.9,
            "train_auc": 0.8,
            "rows_to_target": None,
            "wall_s": 1.0,
            "gsnr_dense": None,
            "gsnr_dense_clipped": None,
            "gsnr_tables": None,
            "gsnr_tables_clipped": None,
        }

    # multiplier 0.5 wins on validation, multiplier 1 would win on test
    cells = [
        fig(0.5, 0, 0.75, 0.70),
        fig(0.5, 1, 0.76, 0.71),
        fig(1.0, 0, 0.74, 0.80),
        fig(1.0, 1, 0.74, 0.81),
    ]
    (s,) = summarize(study, cells)
    assert s["best_lr_multiplier"] == 0.5
    assert s["test_auc"] == pytest.approx(0.705) and s["val_auc"] == pytest.approx(0.755)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"batch_sizes": [96, 256]}, "does not divide"),
        ({"batch_sizes": [32, 256], "max_micro_batch": 48}, "multiple of max_micro_batch"),
        ({"optimizers": [{**TINY["optimizers"][1], "baseline": "adam"}]}, "no optimizer 'adam'"),
    ],
)
def test_bad_study_configs_are_named(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny(**change)


def test_study_cli_loads_and_refuses_unknown_keys(tmp_path: Path) -> None:
    import yaml

    from dlrm_vrgd.study import load_study

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**TINY, "seedz": [1]}))
    with pytest.raises(ConfigError, match="seedz"):
        load_study(path)
    path.write_text(json.dumps(TINY))
    assert load_study(path, ["steps_at_largest=8"]).steps_at_largest == 8


def test_fixed_number_of_micro_batches() -> None:
    study = tiny(micro_batches=4, batch_sizes=[128, 512])
    assert [study.cell_config(c).run.micro_batch for c in study.cells()][:8:4] == [32, 32]
    assert {study.cell_config(c).run.accumulation_steps for c in study.cells()} == {4}
    with pytest.raises(ValueError, match="divisible by micro_batches"):
        tiny(micro_batches=3)


def test_cells_in_parallel_workers_match_the_sequential_run(finished, tmp_path: Path) -> None:
    study, _, results = finished
    parallel = run_study(study.model_copy(update={"workers": 2}), tmp_path)
    assert parallel["cells_finished"] == 16
    for a, b in zip(parallel["summary"], results["summary"], strict=True):
        assert (a["global_batch"], a["optimizer"]) == (b["global_batch"], b["optimizer"])
        assert a["test_auc"] == pytest.approx(b["test_auc"], abs=2e-3)  # 1 vs 2 threads
    # how a study runs is not what it measures: resuming with other workers is allowed
    again = run_study(study.model_copy(update={"workers": 1}), tmp_path)
    assert again["summary"] == parallel["summary"]


def _shipped_study(name: str) -> StudyConfig:
    from dlrm_vrgd.study.config import load_study

    return load_study(Path(__file__).resolve().parents[2] / "configs" / f"{name}.yaml")


@pytest.mark.parametrize("name", ["study_cpu", "study_cpu_32k", "study_gpu", "study_cpu_estimator"])
def test_shipped_study_configs_load(name: str) -> None:
    study = _shipped_study(name)
    assert {o.baseline for o in study.optimizers if o.baseline} <= {
        o.name for o in study.optimizers
    }


# study_cpu_estimator is a follow-up around a known best LR, not a full grid
@pytest.mark.parametrize("name", ["study_cpu", "study_cpu_32k", "study_gpu"])
def test_shipped_full_grids_sweep_enough_lrs_and_seeds(name: str) -> None:
    study = _shipped_study(name)
    assert len(study.lr_multipliers) >= 5 and min(study.lr_multipliers) < 1  # below the sqrt rule
    assert len(study.seeds) >= 3
