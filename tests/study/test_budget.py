"""A study in short allocations (issue 41): cells back to back in one process; ``--budget-s``
runs what fits and stops cleanly before a cell that would not; an allocation brings back at
most 8 files; a study cut short — by its budget, or by SIGKILL in the middle of a cell — and
resumed from the files it brought back ends with the same ledger as one never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dlrm_vrgd.study import StudyConfig, run_study
from dlrm_vrgd.study.budget import (
    BUNDLE_FILES,
    MAX_BUNDLE_FILE_BYTES,
    MAX_BUNDLE_FILES,
    Budget,
    estimate,
    write_bundle,
)
from dlrm_vrgd.study.config import Cell
from dlrm_vrgd.study.ledger import CURVE_POINTS
from dlrm_vrgd.train.run import Callback

from .test_study import TINY

ROOT = Path(__file__).resolve().parents[2]
#: Figures that measure time, not what a cell trained: they differ between two runs.
TIMING = ("wall_s",)


def small() -> StudyConfig:
    """8 cells: 2 batches x 2 optimizers x 2 LRs x 1 seed."""
    return StudyConfig.model_validate({**TINY, "seeds": [0]})


def _ledger(out: Path) -> list[dict]:
    """The ledger's records in order, less what measures time."""
    records = []
    for line in (out / "cells.jsonl").read_text().splitlines():
        rec = json.loads(line)
        rec.pop("cost_s", None)
        rec["figures"] = {k: v for k, v in rec["figures"].items() if k not in TIMING}
        records.append(rec)
    return records


def test_a_cell_s_cost_is_the_median_of_the_most_alike_finished_cells() -> None:
    history = [
        ((256, "sgd", 4), 10.0),
        ((256, "sgd", 4), 14.0),
        ((256, "sgd", 4), 30.0),
        ((256, "vrsgd", 4), 20.0),
        ((128, "sgd", 2), 4.0),
    ]
    # the same (batch, optimizer, k): median 14, with the 1.2 margin
    assert estimate((256, "sgd", 4), history) == pytest.approx(16.8)
    # another optimizer at the same batch and k: all four there, median (14 + 20) / 2 = 17
    assert estimate((256, "vradam", 4), history) == pytest.approx(1.2 * 17)
    # the same batch at another k: the batch's four; another batch: every cell, median 14
    assert estimate((256, "sgd", 8), history) == pytest.approx(1.2 * 17)
    assert estimate((512, "sgd", 4), history) == pytest.approx(1.2 * 14)
    assert estimate((512, "sgd", 4), []) is None


class FakeClock(Callback):
    """A clock that moves only when a cell starts training: each cell costs ``per_cell``."""

    def __init__(self, per_cell: float) -> None:
        self.now = 1000.0
        self.per_cell = per_cell

    def __call__(self) -> float:
        return self.now

    def on_start(self, info: dict) -> None:  # a train callback: called once per cell
        self.now += self.per_cell


def test_the_budget_stops_before_a_cell_that_would_not_fit() -> None:
    with pytest.raises(ValueError, match="reserve_s"):
        Budget(10.0, reserve_s=10.0)
    with pytest.raises(ValueError, match="seconds must be > 0"):
        Budget(0.0)
    clock = FakeClock(10.0)
    budget = Budget(35.0, reserve_s=0.0, clock=clock)
    cell = Cell(128, "sgd", 1.0, 0)
    assert budget.check(cell, (128, "sgd", 2)) is None  # nothing to estimate from: it starts
    clock.now += 30.0
    budget.history.append(((128, "sgd", 2), 10.0))
    from dlrm_vrgd.study.budget import BudgetSpent

    with pytest.raises(BudgetSpent) as spent:  # 12 s estimated, 5 s left
        budget.check(cell, (128, "sgd", 2))
    assert spent.value.estimate_s == pytest.approx(12.0) and spent.value.left_s == pytest.approx(5)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("whole")
    return out, run_study(small(), out)


def _bring_back(bundle: Path, checkout: Path) -> None:
    """What a user commits after an allocation: the bundle's files into the study directory
    of a fresh checkout (no run directories: they stayed on the GPU host)."""
    checkout.mkdir(parents=True, exist_ok=True)
    for f in bundle.iterdir():
        (checkout / f.name).write_bytes(f.read_bytes())


def test_cut_by_the_budget_and_resumed_it_ends_with_the_uninterrupted_ledger(
    uninterrupted, tmp_path: Path
) -> None:
    whole, results = uninterrupted
    study = small()
    # allocation 1: cells cost 10 s each; 35 s with no reserve fits 3 (10, then 12 estimated
    # with 25 left, 12 with 15 left; the 4th, 12 with 5 left, is not started)
    clock = FakeClock(10.0)
    bundle1 = tmp_path / "bundle1"
    first = run_study(
        study,
        tmp_path / "gpu1",
        train_callbacks=[clock],
        budget=Budget(35.0, reserve_s=0.0, clock=clock),
        bundle=bundle1,
    )
    assert first["cells_finished"] == 3 and first["stopped"]
    assert not (tmp_path / "gpu1" / "result.json").exists()  # not complete
    names = sorted(p.name for p in bundle1.iterdir())
    assert set(names) <= set(BUNDLE_FILES) and len(names) <= MAX_BUNDLE_FILES
    assert all(p.stat().st_size <= MAX_BUNDLE_FILE_BYTES for p in bundle1.iterdir())
    alloc = json.loads((bundle1 / "allocation.json").read_text())
    assert [c["cost_s"] for c in alloc["cells_run"]] == [10.0, 10.0, 10.0]
    assert alloc["stopped"]["next_cell"] == study.cells()[3].id and not alloc["complete"]
    assert alloc["stopped"]["estimate_s"] == 12.0 and alloc["stopped"]["left_s"] == 5.0
    # allocation 2, on a fresh host from the committed files: the ledger's costs estimate the
    # first cell at 12 s, so 11 s fits none (it is not started) ...
    checkout = tmp_path / "checkout"
    _bring_back(bundle1, checkout)
    clock2 = FakeClock(10.0)
    none = run_study(
        study,
        checkout,
        train_callbacks=[clock2],
        budget=Budget(11.0, reserve_s=0.0, clock=clock2),
        bundle=tmp_path / "bundle_none",
    )
    assert none["cells_finished"] == 3 and clock2.now == 1000.0  # no cell started
    alloc = json.loads((tmp_path / "bundle_none" / "allocation.json").read_text())
    assert alloc["cells_run"] == [] and alloc["stopped"]["estimate_s"] == 12.0
    # ... and 40 s fits 3 more
    clock2 = FakeClock(10.0)
    bundle2 = tmp_path / "bundle2"
    second = run_study(
        study,
        checkout,
        train_callbacks=[clock2],
        budget=Budget(40.0, reserve_s=0.0, clock=clock2),
        bundle=bundle2,
    )
    assert second["cells_finished"] == 6
    assert len(json.loads((bundle2 / "allocation.json").read_text())["cells_run"]) == 3
    # allocation 3 finishes the study
    _bring_back(bundle2, checkout)
    third = run_study(study, checkout, bundle=tmp_path / "bundle3")
    assert third["cells_finished"] == 8 and not third["stopped"]
    assert json.loads((tmp_path / "bundle3" / "allocation.json").read_text())["complete"]
    assert _ledger(checkout) == _ledger(whole)
    untimed = [[{k: v for k, v in s.items() if k not in TIMING} for s in r["summary"]]
               for r in (third, results)]  # fmt: skip
    assert untimed[0] == untimed[1]
    lines = (checkout / "cells.jsonl").read_text().splitlines()
    assert all("cost_s" in json.loads(line) for line in lines)


KILLER = """
import os, signal, sys, torch
from pathlib import Path
torch.set_num_threads(1)
from dlrm_vrgd.study import StudyConfig, run_study
import yaml
from dlrm_vrgd.train.run import Callback

class Killer(Callback):
    # SIGKILL in the middle of cell number `at` (its second step): no cleanup of any kind
    def __init__(self, at):
        self.at, self.cells, self.steps = at, 0, 0
    def on_start(self, info):
        self.cells += 1
        self.steps = 0
    def on_step(self, record):
        self.steps += 1
        if self.cells == self.at and self.steps == 2:
            os.kill(os.getpid(), signal.SIGKILL)

study = StudyConfig.model_validate(yaml.safe_load(Path(sys.argv[1]).read_text()))
at = int(sys.argv[3])
run_study(study, Path(sys.argv[2]), train_callbacks=[Killer(at)] if at else [])
"""


def _study_process(config: Path, out: Path, kill_at: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", KILLER, str(config), str(out), str(kill_at)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_sigkill_in_the_middle_of_a_cell_loses_only_that_cell(tmp_path: Path) -> None:
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump(small().model_dump(mode="json")))
    whole = _study_process(config, tmp_path / "whole", 0)
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = _study_process(config, tmp_path / "cut", 3)
    assert killed.returncode == -signal.SIGKILL
    cut = tmp_path / "cut"
    done = [json.loads(x)["cell"] for x in (cut / "cells.jsonl").read_text().splitlines()]
    in_flight = small().cells()[2]
    assert done == [c.id for c in small().cells()[:2]]  # the two before it, whole
    assert (cut / "cells" / in_flight.id).is_dir()  # it had started ...
    assert not (cut / "cells" / in_flight.id / "result.json").exists()  # ... and never ended
    resumed = _study_process(config, cut, 0)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _ledger(cut) == _ledger(tmp_path / "whole")
    assert (cut / "result.json").exists()


def test_the_gpu_study_s_ledger_fits_one_result_file() -> None:
    """Every cell the pre-registered GPU study can plan (every edge extended, both protocols
    confirmed), each with the longest curves the ledger keeps, fits in one 16 MiB file."""
    from dlrm_vrgd.study.config import load_study

    study = load_study(ROOT / "configs" / "study_gpu_512k.yaml")
    grid = len(study.lr_multipliers) + 2 * study.edge_extensions
    groups = sum(len(study.groups_of(o)) for o in study.optimizers) * len(study.batch_sizes)
    cells = groups * grid * len(study.run_seeds)
    cells += groups * 2 * len(study.confirm_seeds or [])  # the pick and the rule's, everywhere
    point = [1.0e-6 / 3.0, 0.123456789012, 123456]  # as long as a float gets
    figures = {
        "cell": "G524288-cowclip_sgdrule-k8-lr0.0625-s1007",
        "val_curve": [point] * study.evals_per_run,
        "gsnr_curve": [point] * CURVE_POINTS,
        "b_simple_curve": [point[:2]] * CURVE_POINTS,
        **{f"figure_{i}": 0.123456789012345 for i in range(40)},
    }
    line = json.dumps({"cell": figures["cell"], "config_sha256": "0" * 64, "figures": figures,
                       "cost_s": 12345.67}, separators=(",", ":"))  # fmt: skip
    assert cells * (len(line) + 1) < MAX_BUNDLE_FILE_BYTES / 2, (cells, len(line))


def test_a_bundle_file_over_the_limit_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "study"
    out.mkdir()
    with (out / "cells.jsonl").open("wb") as f:
        f.truncate(MAX_BUNDLE_FILE_BYTES + 1)
    with pytest.raises(ValueError, match="cells.jsonl: 16,777,217 bytes"):
        write_bundle(out, tmp_path / "bundle", {})


def test_a_budget_with_worker_processes_is_refused(tmp_path: Path) -> None:
    from dlrm_vrgd.config import ConfigError

    study = StudyConfig.model_validate({**TINY, "workers": 2})
    with pytest.raises(ConfigError, match="workers: 1"):
        run_study(study, tmp_path / "s", budget=Budget(100.0))


def test_a_study_on_generated_day_files_checks_their_rows_and_records_their_oracle(
    tmp_path: Path,
) -> None:
    """`dlrm-vrgd generate` writes the day files once; the study reads them for exactly its
    steps (no rows made to measure), refuses files with fewer rows than it needs, and each
    allocation records the files' rows and the oracle metrics of their manifest."""
    from dlrm_vrgd.config import ConfigError, parse_config
    from dlrm_vrgd.data.export import generate_days

    base = small().base
    study_rows = small().train_rows  # 4 steps x 256
    data_cfg = parse_config({"data": {**base["data"], "train_rows": study_rows}})
    generate_days(data_cfg, tmp_path / "days", rows_per_day=512, workers=1, progress=False)
    criteo = {"source": "criteo", "path": str(tmp_path / "days"), "max_val_rows": None}
    study = StudyConfig.model_validate(
        {**TINY, "seeds": [0], "lr_multipliers": [1.0], "rule_multiplier": 1.0,
         "base": {**base, "data": criteo}}
    )  # fmt: skip
    cfg = study.cell_config(study.cells()[0])
    assert cfg.run.steps == study.steps(128) and cfg.run.epochs is None
    bundle = tmp_path / "bundle"
    results = run_study(study, tmp_path / "study", bundle=bundle)
    assert results["cells_finished"] == 4
    alloc = json.loads((bundle / "allocation.json").read_text())
    manifest = json.loads((tmp_path / "days" / "manifest.json").read_text())
    assert alloc["data"]["train_rows"] == study_rows
    assert alloc["data"]["oracle"]["test"]["auc"] == manifest["generated"]["oracle"]["test"]["auc"]
    # every cell read the rows it was given: steps x batch = the files' training rows
    for c in results["cells"]:
        assert c["rows"] == study_rows and c["oracle_test_auc"] is not None
    bigger = StudyConfig.model_validate({**study.model_dump(), "steps_at_largest": 8})
    with pytest.raises(ConfigError, match="fewer than the study's"):
        run_study(bigger, tmp_path / "bigger")


def test_the_dry_run_is_the_registered_study_at_1_64_scale() -> None:
    """bench/study_dryrun.py derives its config from the registered one: batches, rows,
    evaluation sizes divided by 64; steps, LRs (base x rule(G / reference), both divided),
    model, arms, grid, seeds, protocol and endpoints kept; labelled exploratory."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "study_dryrun", ROOT / "bench" / "study_dryrun.py"
    )
    assert spec and spec.loader
    dryrun = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dryrun)
    raw = yaml.safe_load((ROOT / "configs" / "study_gpu_512k.yaml").read_text())
    raw_data = yaml.safe_load((ROOT / "configs" / "study_gpu_512k_data.yaml").read_text())
    s, d = dryrun.scaled(raw, raw_data, 64, "runs/x")
    gpu, dry = StudyConfig.model_validate(raw), StudyConfig.model_validate(s)
    assert dry.exploratory and dry.preregistration is None
    assert dry.batch_sizes == [g // 64 for g in gpu.batch_sizes]
    assert d["data"]["train_rows"] == dry.train_rows == gpu.train_rows // 64
    assert dry.primary_endpoints == gpu.primary_endpoints and dry.optimizers == gpu.optimizers
    for a, b in zip(gpu.cells(), dry.cells(), strict=True):
        ca, cb = gpu.cell_config(a), dry.cell_config(b)
        assert (ca.run.steps, ca.optim.dense.lr, ca.optim.sparse.lr) == (
            cb.run.steps, cb.optim.dense.lr, cb.optim.sparse.lr
        )  # fmt: skip
        assert ca.model == cb.model and cb.run.micro_batch * 64 == ca.run.micro_batch
        assert cb.run.device == "cpu"
