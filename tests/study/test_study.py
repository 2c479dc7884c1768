"""Batch-size studies: grid rules, resumability, selection on validation, consistent outputs."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from dlrm_vrgd.config import ConfigError
from dlrm_vrgd.rundir import read_jsonl
from dlrm_vrgd.study import StudyConfig, run_study
from dlrm_vrgd.study.report import summarize
from dlrm_vrgd.train.loop import Trainer

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
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("protocol,global_batch,")
    assert [line.split(",")[0] for line in csv_lines[1:]] == ["tuned"] * 4 + ["rule"] * 4


def test_rerun_skips_finished_cells(finished) -> None:
    study, out, results = finished
    stamps = {
        c.id: (out / "cells" / c.id / "result.json").stat().st_mtime_ns for c in study.cells()
    }
    victim = study.cells()[5]
    # as if interrupted mid-cell: no result.json, and not in the ledger
    (out / "cells" / victim.id / "result.json").unlink()
    ledger = (out / "cells.jsonl").read_text().splitlines()
    kept = [line for line in ledger if json.loads(line)["cell"] != victim.id]
    assert len(kept) == len(ledger) - 1
    (out / "cells.jsonl").write_text("".join(line + "\n" for line in kept))
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


def _md_rows(md: str) -> list[list[str]]:
    rows = [line for line in md.splitlines() if re.match(r"\| [\d,]+ \| \d+ \|", line)]
    return [[c.strip() for c in line.strip("|").split("|")] for line in rows]


def assert_rows_equal_json(rows: list[list[str]], summary: list[dict]) -> None:
    assert len(rows) == len(summary)
    for cells, s in zip(rows, summary, strict=True):
        assert int(cells[0].replace(",", "")) == s["global_batch"]
        assert int(cells[1]) == s["steps"] and cells[2] == s["optimizer"]
        assert int(cells[3]) == s["groups"]
        assert float(cells[4].split()[0].removeprefix("x")) == s["lr_multiplier"]
        assert ("edge" in cells[4]) == bool(s["edge"])
        assert float(cells[5]) == s["val_auc"] and float(cells[6]) == s["test_auc"]
        # one seed has no spread: "–" (its JSON keeps 0.0)
        sd = "–" if s["seeds"] < 2 else s["test_auc_sd"]
        assert (cells[7] if s["seeds"] < 2 else float(cells[7])) == sd
        assert int(cells[8]) == s["seeds"]
        assert cells[9].startswith(f"{s['collapsed']}/{s['seeds']} [")
        assert float(cells[10]) == s["auc_change"]
        assert float(cells[11]) == s["oracle_gap"] and float(cells[12]) == s["train_test_gap"]


def test_markdown_numbers_equal_the_json(finished) -> None:
    _, out, results = finished
    md = (out / "results.md").read_text()
    tuned_md, rule_md = md.split("## Rule")
    assert_rows_equal_json(_md_rows(tuned_md), results["summary"])
    assert_rows_equal_json(_md_rows(rule_md), results["summary_rule"])
    for part, pairs in ((tuned_md, results["pairs"]), (rule_md.split("Validation AUC by LR")[0],
                                                       results["pairs_rule"])):  # fmt: skip
        pair_rows = [
            line for line in part.splitlines() if "| vrsgd |" in line and "| sgd |" in line
        ]
        assert len(pair_rows) == len(pairs) > 0
        for line, p in zip(pair_rows, pairs, strict=True):
            assert float(line.split("|")[6]) == round(p["delta_test_auc"]["mean"], 4)
            assert int(line.split("|")[8]) == p["delta_test_auc"]["n"]


def test_both_protocols_read_the_same_cells(finished) -> None:
    study, _, results = finished
    cells = results["cells"]
    assert results["rule_multipliers"] == {"sgd": 1.0, "vrsgd": 1.0}
    for tuned, rule in zip(results["summary"], results["summary_rule"], strict=True):
        assert (tuned["global_batch"], tuned["optimizer"]) == (
            rule["global_batch"],
            rule["optimizer"],
        )
        assert rule["protocol"] == "rule" and rule["lr_multiplier"] == 1.0
        at = [c for c in cells if c["global_batch"] == rule["global_batch"]
              and c["optimizer"] == rule["optimizer"] and c["lr_multiplier"] == 1.0]  # fmt: skip
        assert len(at) == rule["seeds"] == 2
        assert rule["test_auc"] == round(sum(c["test_auc"] for c in at) / 2, 4)
        if tuned["best_lr_multiplier"] == 1.0:
            assert tuned["test_auc"] == rule["test_auc"]
    smallest = [r for r in results["summary_rule"] if r["global_batch"] == 128]
    assert all(r["auc_change"] == 0 for r in smallest)


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


@pytest.mark.parametrize(
    "name",
    ["study_cpu", "study_cpu_32k", "study_gpu", "study_cpu_estimator", "study_cpu_cowclip"],
)
def test_shipped_study_configs_load(name: str) -> None:
    study = _shipped_study(name)
    assert {o.baseline for o in study.optimizers if o.baseline} <= {
        o.name for o in study.optimizers
    }


@pytest.mark.parametrize(
    ("name", "out"),
    [
        ("study_cpu", "cpu"),
        ("study_cpu_32k", "cpu_32k"),
        ("study_cpu_estimator", "cpu_estimator"),
        ("study_cpu_cowclip", "cpu_cowclip"),
    ],
)
def test_committed_studies_are_what_their_configs_say(name: str, out: str) -> None:
    """docs/study/OUT was run by configs/NAME.yaml: rerunning it there resumes, not refuses
    (the first studies' VR cells pin `gsnr_placement: gradient`, the placement they really ran
    with; round two ran with `update`)."""
    from dlrm_vrgd.study.run import _spec

    saved = Path(__file__).resolve().parents[2] / "docs" / "study" / out / "study.json"
    assert _spec(json.loads(saved.read_text())) == _spec(
        _shipped_study(name).model_dump(mode="json")
    )
    vr = [o for o in _shipped_study(name).optimizers if o.sparse["name"].startswith("gsnr_")]
    placement = "update" if name == "study_cpu_cowclip" else "gradient"
    assert vr and all(o.sparse["gsnr_placement"] == placement for o in vr)


# study_cpu_estimator is a follow-up around a known best LR, not a full grid
@pytest.mark.parametrize("name", ["study_cpu", "study_cpu_32k", "study_gpu", "study_cpu_cowclip"])
def test_shipped_full_grids_sweep_enough_lrs_and_seeds(name: str) -> None:
    study = _shipped_study(name)
    assert len(study.lr_multipliers) >= 5 and min(study.lr_multipliers) < 1  # below the sqrt rule
    assert len(study.seeds) >= 3


def _fig(g: int, name: str, m: float, seed: int, val: float, test: float, k: int = 4) -> dict:
    return {
        "global_batch": g, "optimizer": name, "groups": k, "lr_multiplier": m, "seed": seed,
        "val_auc": val, "test_auc": test, "steps": 4, "dense_lr": m, "sparse_lr": m,
        "oracle_test_auc": 0.9, "train_auc": 0.8, "rows_to_target": None, "wall_s": 1.0,
        "gsnr_dense": None, "gsnr_dense_clipped": None, "gsnr_tables": None,
        "gsnr_tables_clipped": None,
    }  # fmt: skip


def test_the_rule_protocol_never_reads_validation() -> None:
    study = tiny(lr_multipliers=[0.5, 1.0, 2.0], rule_multiplier=0.5)
    cells = [
        _fig(g, o, m, seed, 0.7 + 0.01 * m + 0.001 * seed, 0.6 + 0.02 * m * (g == 128) + seed / 100)
        for g in (128, 256)
        for o in ("sgd", "vrsgd")
        for m in (0.5, 1.0, 2.0)
        for seed in (0, 1)
    ]
    perturbed = [{**c, "val_auc": 1.0 - c["val_auc"] + (c["lr_multiplier"] == 1.0)} for c in cells]
    rule, rule_p = summarize(study, cells, "rule"), summarize(study, perturbed, "rule")
    tuned, tuned_p = summarize(study, cells, "tuned"), summarize(study, perturbed, "tuned")
    assert [t["best_lr_multiplier"] for t in tuned] == [2.0] * 4  # validation moves "tuned"
    assert [t["best_lr_multiplier"] for t in tuned_p] == [1.0] * 4
    drop = ("val_auc",)  # reported under "rule", never used there
    assert [{k: v for k, v in r.items() if k not in drop} for r in rule] == [
        {k: v for k, v in r.items() if k not in drop} for r in rule_p
    ]
    assert all(r["lr_multiplier"] == 0.5 for r in rule)
    assert rule[0]["test_auc"] == pytest.approx(0.6 + 0.01 + 0.005)
    assert rule[2]["auc_change"] == pytest.approx(-0.01, abs=1e-4)  # 256 vs 128 under the rule


def test_groups_axis_changes_only_the_micro_batch() -> None:
    vr = {**TINY["optimizers"][1], "groups": [4, 16]}
    study = tiny(batch_sizes=[1024, 8192], optimizers=[TINY["optimizers"][0], vr], groups=[4])
    ks = {(c.optimizer, c.groups) for c in study.cells()}
    assert ks == {("sgd", 4), ("vrsgd", 4), ("vrsgd", 16)}
    cell = next(c for c in study.cells() if c.global_batch == 8192 and c.groups == 16)
    assert cell.id == "G8192-vrsgd-k16-lr0.5-s0"
    cfg = study.cell_config(cell)
    assert cfg.run.micro_batch == 512 and cfg.run.accumulation_steps == 16
    at4 = study.cell_config(cell.model_copy(update={"groups": 4})).to_dict()
    at16 = cfg.to_dict()
    assert at4["run"].pop("micro_batch") == 2048 and at16["run"].pop("micro_batch") == 512
    assert at4 == at16  # same LR, data, steps, schedule: only A (and B) differ
    with pytest.raises(ValueError, match="groups and micro_batches"):
        tiny(groups=[4], micro_batches=4)
    with pytest.raises(ValueError, match="not divisible by k = 3"):
        tiny(groups=[3])


COWCLIP = {
    "name": "cowclip",
    "baseline": "sgd",
    "lr_rule": "cowclip",
    "dense": {"name": "sgd", "momentum": 0.9},
    "sparse": {"name": "cowclip_rowwise_adagrad", "weight_decay": 1e-4, "clip_ratio": 1.0},
    "dense_lr": 0.05,
    "sparse_lr": 0.1,
}


def test_cowclip_scaling_rule() -> None:
    study = tiny(batch_sizes=[64, 256], optimizers=[TINY["optimizers"][0], COWCLIP])
    for cell in study.cells():
        cfg = study.cell_config(cell)
        ratio = cell.global_batch / 64
        if cell.optimizer == "cowclip":
            assert cfg.optim.sparse.lr == pytest.approx(0.1 * cell.lr_multiplier)  # fixed
            assert cfg.optim.sparse.weight_decay == pytest.approx(1e-4 * ratio)  # ∝ G
        else:
            assert cfg.optim.sparse.lr == pytest.approx(0.1 * math.sqrt(ratio) * cell.lr_multiplier)
        assert cfg.optim.dense.lr == pytest.approx(0.05 * math.sqrt(ratio) * cell.lr_multiplier)
    bad = {**COWCLIP, "sparse": {"name": "rowwise_adagrad"}}
    with pytest.raises(ValueError, match="cowclip_\\* sparse optimizer"):
        tiny(optimizers=[bad])
    with pytest.raises(ValueError, match="rule_multiplier 3.0 is not one of"):
        tiny(rule_multiplier=3.0)


def test_a_study_with_groups_cowclip_and_adagrad_reports_both_protocols(tmp_path: Path) -> None:
    adagrad = {
        "name": "adagrad",
        "dense": {"name": "adagrad"},
        "sparse": {"name": "rowwise_adagrad"},
        "dense_lr": 0.01,
        "sparse_lr": 0.1,
    }
    vr = {**TINY["optimizers"][1], "groups": [2, 4]}
    study = tiny(
        optimizers=[TINY["optimizers"][0], vr, COWCLIP, adagrad],
        groups=[2],
        max_micro_batch=4096,
        seeds=[0],
    )
    results = run_study(study, tmp_path)
    assert results["cells_finished"] == len(study.cells()) == 2 * 5 * 2
    series = {(s["optimizer"], s["groups"]) for s in results["summary_rule"]}
    assert series == {("sgd", 2), ("vrsgd", 2), ("vrsgd", 4), ("cowclip", 2), ("adagrad", 2)}
    pairs = {(p["optimizer"], p["groups"], p["baseline_groups"]) for p in results["pairs_rule"]}
    assert pairs == {("vrsgd", 2, 2), ("vrsgd", 4, 2), ("cowclip", 2, 2)}
    assert_rows_equal_json(
        _md_rows((tmp_path / "results.md").read_text().split("## Rule")[1]),
        results["summary_rule"],
    )
    for png in ("auc_vs_batch.png", "auc_vs_groups.png", "auc_vs_rows.png", "gsnr_ratio.png"):
        assert (tmp_path / png).stat().st_size > 10_000
    gsnr = read_jsonl(tmp_path / "cells" / "G256-cowclip-k2-lr1-s0" / "gsnr.jsonl")
    assert "cowclip_clipped" in gsnr[-1]["tables"][0]
    # the ledger keeps CowClip's clipped fraction: per step weighted by touched rows, then the
    # mean over steps (computed here from gsnr.jsonl); non-CowClip cells have none
    per_step = [
        sum(t["cowclip_clipped"] * t["touched_rows"] for t in r["tables"])
        / sum(t["touched_rows"] for t in r["tables"])
        for r in gsnr
    ]
    ledger = {
        json.loads(line)["cell"]: json.loads(line)["figures"]
        for line in (tmp_path / "cells.jsonl").read_text().splitlines()
    }
    got = ledger["G256-cowclip-k2-lr1-s0"]["cowclip_clipped"]
    assert got == pytest.approx(sum(per_step) / len(per_step), rel=1e-12)
    assert ledger["G256-sgd-k2-lr1-s0"]["cowclip_clipped"] is None
    clipped = [s["cowclip_clipped"] for s in results["summary_rule"] if s["optimizer"] == "cowclip"]
    assert clipped and all(c is not None and 0 <= c <= 1 for c in clipped)


@pytest.mark.parametrize("name", ["study_cpu_cowclip", "study_gpu"])
def test_shipped_round_two_grids_have_every_axis(name: str) -> None:
    """Issue 18's grid: batches 8x apart or more, >= 500 steps at the largest, VR-SGD at two k,
    CowClip under its own rule, the Adagrad pair, every cell k at its optimizer's k."""
    study = _shipped_study(name)
    sizes = sorted(study.batch_sizes)
    assert sizes[-1] // sizes[0] >= 8 and study.steps_at_largest >= 500
    series = {(c.optimizer, c.groups) for c in study.cells()}
    vr_ks = sorted(k for o, k in series if o == "vrsgd")
    assert len(vr_ks) >= 2 and vr_ks[-1] >= 4 * vr_ks[0]
    cow = study.optimizer("cowclip")
    assert cow.lr_rule == "cowclip" and cow.sparse["name"] == "cowclip_rowwise_adagrad"
    assert study.optimizer("adagrad").dense["name"] == "adagrad"
    assert study.optimizer("sgd").dense["name"] == "sgd"
    for cell in study.cells():
        cfg = study.cell_config(cell)
        k = cfg.run.world_size * cfg.run.accumulation_steps
        assert k == cell.groups and cfg.run.micro_batch * k == cell.global_batch
    assert study.rule_multiplier in study.lr_multipliers


def test_the_auc_plot_fits_its_y_range_to_the_points() -> None:
    """AUC 0.610..0.630 with error bars, oracle 0.83: the range hugs the points (15% of their
    span each side), not 0.6..0.83 with the points squeezed at the bottom."""
    from dlrm_vrgd.study.plots import _fitted

    lo, hi = _fitted([0.610, 0.612], [0.626, 0.630])
    assert (lo, hi) == pytest.approx((0.610 - 0.003, 0.630 + 0.003))
    assert _fitted([0.7], [0.7]) == pytest.approx((0.7 - 0.0003, 0.7 + 0.0003))  # 0.002 wide
    assert _fitted([], []) is None


def _committed_ledgers() -> list[Path]:
    return sorted((Path(__file__).resolve().parents[2] / "docs" / "study").glob("*/cells.jsonl"))


@pytest.mark.parametrize("ledger", _committed_ledgers(), ids=lambda p: p.parent.name)
def test_every_committed_ledger_resumes_under_todays_config(ledger: Path) -> None:
    """Each committed study's ledger names cells of its config, each under the digest of the
    config that study gives the cell today: a code change that alters what a cell trains shows
    here (the study would refuse to resume), not in a later session's rerun."""
    from dlrm_vrgd.study.ledger import Ledger
    from dlrm_vrgd.study.run import _spec

    out = ledger.parent
    saved = json.loads((out / "study.json").read_text())
    study = _shipped_study(saved["name"])
    assert _spec(saved) == _spec(study.model_dump(mode="json"))
    planned = {c.id: c for c in study.cells()}
    if study.two_stage:  # the confirmation cells are planned from the tuning cells' picks
        from dlrm_vrgd.study.protocol import finished_val_aucs

        _, plan = finished_val_aucs(study, Ledger(study, out).val_auc)
        planned |= {c.id: c for c in plan.tune_cells + plan.confirm_cells}
    stored = [json.loads(line)["cell"] for line in ledger.read_text().splitlines()]
    assert stored and set(stored) <= set(planned), set(stored) - set(planned)
    book = Ledger(study, ledger.parent)
    for cell_id in stored:
        assert book.figures(planned[cell_id]) is not None


def test_a_study_without_k_writes_no_k_plot_and_drops_an_empty_one(tmp_path: Path) -> None:
    """docs/study/cpu has no k (no groups axis, micro-batches unset): `study report` from its
    results.json (no curves there, so no curve plots) writes the AUC plot, no
    auc_vs_groups.png, and removes the empty one older code left."""
    from dlrm_vrgd.study.report import write_report

    src = Path(__file__).resolve().parents[2] / "docs" / "study" / "cpu"
    for name in ("study.json", "results.json"):
        shutil.copy(src / name, tmp_path / name)
    (tmp_path / "auc_vs_groups.png").write_bytes(b"stale")
    write_report(_shipped_study("study_cpu"), tmp_path)
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["auc_vs_batch.png"]


def test_a_base_config_evaluating_per_epoch_gets_the_study_s_cadence() -> None:
    # MLPerf's configs evaluate 20 times an epoch; a study's cells evaluate evals_per_run times
    base = {**TINY["base"], "run": {"eval_batch": 1024, "evals_per_epoch": 20}}
    study = tiny(base=base)
    for cell in study.cells():
        run = study.cell_config(cell).run
        assert run.evals_per_epoch is None and run.eval_every >= 1
