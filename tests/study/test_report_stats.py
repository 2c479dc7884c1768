"""The report's statistics (issue 25): paired-by-seed intervals checked against ones computed by
hand here, edge picks flagged, collapses counted, and the two-stage protocol (tune seeds choose,
fresh confirmation seeds report) — including a real two-stage run and `dlrm-vrgd study report`."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dlrm_vrgd.study.config import Cell
from dlrm_vrgd.study.ledger import Ledger
from dlrm_vrgd.study.protocol import plan
from dlrm_vrgd.study.report import batch_effects, compare_pairs, interactions, markdown, summarize
from dlrm_vrgd.study.run import run_study
from dlrm_vrgd.study.stats import clopper_pearson, fisher_exact, t_ppf

from .test_study import TINY, _fig, tiny

#: Student-t 0.975 quantiles from a printed table (df = 1, 2, 7).
T975 = {1: 12.7062, 2: 4.3027, 7: 2.3646}


def test_t_quantiles_and_binomial_intervals_match_tables() -> None:
    for df, q in T975.items():
        assert t_ppf(0.975, df) == pytest.approx(q, abs=1e-4)
    # 0 of 3: the upper bound solves (1 − p)^3 = 0.025; 3 of 3 mirrors it
    assert clopper_pearson(0, 3) == pytest.approx((0.0, 1 - 0.025 ** (1 / 3)))
    assert clopper_pearson(3, 3) == pytest.approx((0.025 ** (1 / 3), 1.0))
    # 1 of 3: lower solves 1 − (1 − p)^3 = 0.025, upper solves (1 − p)^3 + 3p(1 − p)^2 = 0.025
    lo, hi = clopper_pearson(1, 3)
    assert 1 - (1 - lo) ** 3 == pytest.approx(0.025)
    assert (1 - hi) ** 3 + 3 * hi * (1 - hi) ** 2 == pytest.approx(0.025)
    # Fisher: 3 of 3 against 0 of 3 — the two extreme tables, each 1 / C(6, 3)
    assert fisher_exact(3, 3, 0, 3) == pytest.approx(2 / 20)
    assert fisher_exact(0, 3, 1, 3) == pytest.approx(1.0)
    assert fisher_exact(1, 8, 6, 8) == pytest.approx(
        sum(math.comb(8, x) * math.comb(8, 7 - x) for x in (0, 1, 6, 7)) / math.comb(16, 7)
    )


def _cells(test: dict[tuple[int, str], list[float]], vals: dict | None = None) -> list[dict]:
    """Figures of a one-stage grid at one multiplier (x1): test AUC by (batch, optimizer)."""
    out = []
    for (g, name), aucs in test.items():
        for seed, t in enumerate(aucs):
            c = _fig(g, name, 1.0, seed, 0.7, t)
            out.append({**c, "cell": f"G{g}-{name}-lr1-s{seed}"})
    return out


def test_paired_t_interval_equals_one_computed_by_hand() -> None:
    study = tiny(lr_multipliers=[1.0], rule_multiplier=1.0, seeds=[0, 1, 2])
    sgd_lo, sgd_hi = [0.800, 0.810, 0.805], [0.790, 0.792, 0.801]
    vr_lo = [0.801, 0.813, 0.807]  # vr − sgd at 128: +0.001, +0.003, +0.002
    vr_hi = [0.795, 0.800, 0.806]  # at 256: +0.005, +0.008, +0.005
    cells = _cells(
        {(128, "sgd"): sgd_lo, (128, "vrsgd"): vr_lo, (256, "sgd"): sgd_hi, (256, "vrsgd"): vr_hi}
    )
    summary = summarize(study, cells)
    (small, large) = compare_pairs(summary)
    # by hand: d = (0.001, 0.003, 0.002), mean 0.002, sd 0.001, half-width t(0.975, 2)·sd/√3;
    # t = 0.002 / (0.001/√3) = 2√3 and, for df = 2, P(|T| > t) = 1 − t/√(2 + t²)
    st = small["delta_test_auc"]
    assert st["n"] == 3 and st["mean"] == pytest.approx(0.002) and st["sd"] == pytest.approx(0.001)
    half = 4.302653 * 0.001 / math.sqrt(3)
    assert st["ci95"] == pytest.approx([0.002 - half, 0.002 + half], abs=1e-6)
    t = 2 * math.sqrt(3)
    assert st["p"] == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-3)
    # interaction: per seed (vr − sgd at 256) − (vr − sgd at 128) = (0.004, 0.005, 0.003)
    (inter,) = interactions(summary)
    it = inter["interaction"]
    assert it["mean"] == pytest.approx(0.004) and it["sd"] == pytest.approx(0.001)
    assert it["ci95"] == pytest.approx([0.004 - half, 0.004 + half], abs=1e-6)
    assert large["delta_test_auc"]["mean"] == pytest.approx(0.006)
    # each arm's batch effect, sgd per seed (−0.010, −0.018, −0.004); the JSON keeps 6 digits
    effects = {e["optimizer"]: e["batch_effect"] for e in batch_effects(summary)}
    d = [-0.010, -0.018, -0.004]
    sd = math.sqrt(sum((x - sum(d) / 3) ** 2 for x in d) / 2)
    assert effects["sgd"]["mean"] == pytest.approx(sum(d) / 3, abs=1e-6)
    assert effects["sgd"]["sd"] == pytest.approx(sd, abs=1e-6)
    hi = sum(d) / 3 + 4.302653 * sd / math.sqrt(3)
    assert effects["sgd"]["ci95"][1] == pytest.approx(hi, abs=1e-6)
    # the Markdown states the same numbers
    md = markdown(study, summary, 0.8, summarize(study, cells, "rule"))
    assert "| 128 | vrsgd | 4 | sgd | 4 | +0.0020 | 0.0010 | 3 | [-0.0005, +0.0045] |" in md
    assert "| vrsgd | 4 | sgd | +0.0040 | 0.0010 | 3 | [+0.0015, +0.0065] |" in md
    # and a pairing by seed is not an unpaired comparison: shuffling one arm's seeds changes sd
    shuffled = [
        {**c, "seed": (c["seed"] + 1) % 3} if c["optimizer"] == "vrsgd" else c for c in cells
    ]
    assert compare_pairs(summarize(study, shuffled))[0]["delta_test_auc"]["sd"] != pytest.approx(
        0.001
    )


def test_an_edge_pick_is_flagged_in_the_tables_and_the_prose() -> None:
    study = tiny(lr_multipliers=[0.5, 1.0, 2.0], rule_multiplier=1.0)
    cells = [  # validation rises with the multiplier at 256 (edge), peaks at x1 at 128
        _fig(g, o, m, seed, 0.7 + (0.01 * m if g == 256 else -abs(m - 1) / 100), 0.8)
        for g in (128, 256)
        for o in ("sgd", "vrsgd")
        for m in (0.5, 1.0, 2.0)
        for seed in (0, 1)
    ]
    summary = summarize(study, cells)
    assert [(s["global_batch"], s["edge"]) for s in summary] == [
        (128, None), (128, None), (256, "high"), (256, "high")
    ]  # fmt: skip
    pairs = compare_pairs(summary)
    assert [p["edge"] for p in pairs] == [[], ["high", "high"]]
    md = markdown(study, summary, 0.8, summarize(study, cells, "rule"))
    assert md.count("x2 **edge (high)**") == 2
    assert "**2 of 4 tuned picks sit on the grid's edge** — sgd k = 4 at 256: x2 (high" in md
    assert all(not s["edge"] for s in summarize(study, cells, "rule"))  # the rule is not a pick


def test_a_collapsed_cell_is_counted_with_its_interval() -> None:
    study = tiny(lr_multipliers=[1.0], rule_multiplier=1.0, seeds=[0, 1, 2], collapse_auc=0.75)
    cells = _cells(
        {
            (128, "sgd"): [0.80, 0.80, 0.80],
            (128, "vrsgd"): [0.80, 0.80, 0.80],
            (256, "sgd"): [0.80, 0.7499, 0.80],  # one seed below 0.75
            (256, "vrsgd"): [0.80, 0.80, 0.75],  # at the threshold: not collapsed
        }
    )
    summary = summarize(study, cells)
    by = {(s["global_batch"], s["optimizer"]): s for s in summary}
    assert by[(256, "sgd")]["collapsed"] == 1 and by[(256, "vrsgd")]["collapsed"] == 0
    assert by[(256, "sgd")]["collapsed_ci"] == pytest.approx(list(clopper_pearson(1, 3)), abs=1e-6)
    pair = compare_pairs(summary)[1]
    assert pair["collapsed"] == [0, 3] and pair["baseline_collapsed"] == [1, 3]
    assert pair["collapse_fisher_p"] == pytest.approx(1.0)
    md = markdown(study, summary, 0.8)
    assert "1/3 [0.01, 0.91]" in md and "0/3 / 1/3" in md


TWO_STAGE = {
    "lr_multipliers": [0.5, 1.0],
    "tune_seeds": [0, 1],
    "confirm_seeds": [10, 11, 12],
    "edge_extensions": 1,
}


def _two_stage_cells(study, val, test) -> list[dict]:
    """Figures of every cell the plan asks for, validation and test from the given functions."""
    figures: dict[str, dict] = {}
    while True:
        p = plan(study, {i: c["val_auc"] for i, c in figures.items()})
        if not p.todo:
            return list(figures.values())
        for c in p.todo:
            f = _fig(c.global_batch, c.optimizer, c.lr_multiplier, c.seed, 0, 0, c.groups or 4)
            f.update(cell=c.id, val_auc=val(c), test_auc=test(c))
            figures[c.id] = f


def test_confirmation_seed_aucs_never_change_a_pick() -> None:
    study = tiny(**TWO_STAGE)

    def val(c) -> float:  # 128: best at x1 (inside); 256: rises with m (an edge, extended once)
        return 0.7 + (
            0.01 * c.lr_multiplier if c.global_batch == 256 else -abs(c.lr_multiplier - 1)
        )

    cells = _two_stage_cells(study, val, lambda c: 0.8 + c.seed / 1000)
    p = plan(study, {c["cell"]: c["val_auc"] for c in cells})
    assert not p.todo
    assert p.groups[(128, "sgd", None)].pick == 1.0 and p.groups[(128, "sgd", None)].edge is None
    g256 = p.groups[(256, "sgd", None)]
    assert g256.grid == [0.5, 1.0, 2.0] and g256.pick == 2.0 and g256.edge == "high"  # extended
    assert p.rule == {("sgd", None): 1.0, ("vrsgd", None): 1.0}
    confirm = {c.id for c in p.confirm_cells}
    assert all(c.seed in (10, 11, 12) for c in p.confirm_cells)
    assert {c.lr_multiplier for c in p.confirm_cells if c.global_batch == 256} == {1.0, 2.0}
    tuned = summarize(study, cells, "tuned", p)
    rule = summarize(study, cells, "rule", p)
    assert all(s["seeds"] == 3 and set(s["test_auc_by_seed"]) == {"10", "11", "12"} for s in tuned)
    assert [s["lr_multiplier"] for s in rule] == [1.0] * 4
    # perturb every confirmation cell's AUCs, validation and test, in any direction
    for shift in (-0.3, 0.2):
        perturbed = [
            {**c, "val_auc": c["val_auc"] + shift * (1 + c["seed"]), "test_auc": 0.5 + shift / 2}
            if c["cell"] in confirm
            else c
            for c in cells
        ]
        p2 = plan(study, {c["cell"]: c["val_auc"] for c in perturbed})
        assert {k: g.pick for k, g in p2.groups.items()} == {k: g.pick for k, g in p.groups.items()}
        assert p2.rule == p.rule
        t2 = summarize(study, perturbed, "tuned", p2)
        assert [s["lr_multiplier"] for s in t2] == [s["lr_multiplier"] for s in tuned]
        assert [s["test_auc"] for s in t2] != [s["test_auc"] for s in tuned]  # reported: confirm


def test_larger_batches_wait_for_the_smallest_batch_to_fix_the_rule() -> None:
    study = tiny(**TWO_STAGE)
    p = plan(study, {})
    assert p.todo and all(c.global_batch == 128 and c.seed in (0, 1) for c in p.todo)
    assert not p.rule and not p.confirm_cells


def test_two_stage_config_errors_are_named() -> None:
    with pytest.raises(ValueError, match="set both"):
        tiny(tune_seeds=[0])
    with pytest.raises(ValueError, match="fresh"):
        tiny(tune_seeds=[0, 1], confirm_seeds=[1, 2])


@pytest.fixture(scope="module")
def two_stage_run(tmp_path_factory: pytest.TempPathFactory):
    study = tiny(**{**TWO_STAGE, "confirm_seeds": [10, 11]}, workers=1)
    out = tmp_path_factory.mktemp("two_stage")
    return study, out, run_study(study, out)


def test_a_two_stage_study_runs_and_reports_only_confirmation_seeds(two_stage_run) -> None:
    study, out, results = two_stage_run
    assert results["protocol"] == "two-stage"
    picks = json.loads((out / "picks.json").read_text())
    assert {(r["optimizer"], r["lr_multiplier"]) for r in picks["rule"]} <= {
        (o, m) for o in ("sgd", "vrsgd") for m in (0.25, 0.5, 1.0, 2.0)
    }
    tuned_cells = {c["cell"] for c in results["cells"] if c["seed"] in (0, 1)}
    confirm_cells = {c["cell"] for c in results["cells"] if c["seed"] in (10, 11)}
    assert tuned_cells and confirm_cells
    assert results["cells_finished"] == results["cells_total"] == len(tuned_cells | confirm_cells)
    for s in results["summary"] + results["summary_rule"]:
        assert set(s["test_auc_by_seed"]) == {"10", "11"}
    for t in picks["tuned"]:  # confirmation cells ran at each pick, and only there or the rule
        ms = {
            c["lr_multiplier"]
            for c in results["cells"]
            if c["seed"] == 10
            and c["global_batch"] == t["global_batch"]
            and c["optimizer"] == t["optimizer"]
        }
        assert t["lr_multiplier"] in ms and len(ms) <= 2
    again = run_study(study, out)  # resumes: nothing left to run, the same figures
    assert again["summary"] == results["summary"]


def test_a_fresh_checkout_resumes_from_the_ledger_and_trains_nothing_again(
    two_stage_run, tmp_path: Path
) -> None:
    study, out, results = two_stage_run
    copy = tmp_path / "checkout"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("cells"))  # what git holds
    ledger = [json.loads(line) for line in (copy / "cells.jsonl").read_text().splitlines()]
    assert {r["cell"] for r in ledger} == {c["cell"] for c in results["cells"]}
    assert all(len(r["config_sha256"]) == 64 for r in ledger)
    # the noise scale each cell measured is kept with it (the run directories will be gone)
    for r in ledger:
        result = json.loads((out / "cells" / r["cell"] / "result.json").read_text())
        late = result["noise_scale"]["scopes"]["model"]
        assert r["figures"]["b_simple"] == late["b_simple"] and r["figures"]["b_simple_curve"]
    statuses: list[str] = []
    totals: set[int] = set()

    def heard(i: int, n: int, cell: Cell, status: str, rec: dict | None) -> None:
        statuses.append(status)
        totals.add(n)

    again = run_study(study, copy, on_cell=heard)
    assert statuses and set(statuses) == {"skip"}, statuses  # no cell trained again
    # every line names the whole plan as its total, confirmation cells counted ("[9/4 done]" was)
    assert totals == {results["cells_total"]}
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    assert {json.loads(line)["total_cells"] for line in lines} == {results["cells_total"]}
    assert not (copy / "cells").exists()
    assert again["summary"] == results["summary"]
    # a cell stored under another config's digest is refused, by file, and nothing is lost
    first = ledger[0]["cell"]
    ledger[0]["config_sha256"] = "0" * 64
    (copy / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger))
    before = (copy / "cells.jsonl").read_bytes()
    with pytest.raises(ValueError, match=f"cells.jsonl: cell {first} trained another config"):
        run_study(study, copy)
    assert (copy / "cells.jsonl").read_bytes() == before
    # a record that is not a ledger record is named by file and line
    (copy / "cells.jsonl").write_text(
        json.dumps(ledger[1]) + "\n" + json.dumps({"cell": "x", "figures": {}}) + "\n"
    )
    with pytest.raises(ValueError, match=r"cells\.jsonl:2: 'config_sha256'"):
        run_study(study, copy)
    # the file is data: what a cell is comes from the study, and a figure that is not a
    # number is named, as is a curve of the wrong shape
    liar = {**ledger[1], "figures": {**ledger[1]["figures"], "optimizer": "x", "seed": 99}}
    (copy / "cells.jsonl").write_text(json.dumps(liar) + "\n")
    f = ledger[1]["figures"]
    cell = Cell(f["global_batch"], f["optimizer"], f["lr_multiplier"], f["seed"])
    assert cell.id == liar["cell"]
    got = Ledger(study, copy).figures(cell)
    assert got is not None and (got["optimizer"], got["seed"]) == (cell.optimizer, cell.seed)
    for key, bad in (("wall_s", "fast"), ("b_simple", float("inf")), ("val_curve", [[1, 2]])):
        rec = {**ledger[1], "figures": {**ledger[1]["figures"], key: bad}}
        (copy / "cells.jsonl").write_text(json.dumps(rec) + "\n")
        with pytest.raises(ValueError, match=rf"cells\.jsonl:1: figures\.{key} must be"):
            Ledger(study, copy)


def test_study_report_cli_rewrites_the_reports(two_stage_run, tmp_path: Path) -> None:
    _, out, results = two_stage_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    for name in ("results.md", "results.json", "results.csv"):
        (copy / name).unlink()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def report(where: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dlrm_vrgd.cli", "study", "report", str(where)],
            capture_output=True, text=True, env=env, timeout=300, check=False,
        )  # fmt: skip

    done = report(copy)
    assert done.returncode == 0, done.stderr
    assert "rewrote" in done.stdout
    assert json.loads((copy / "results.json").read_text())["summary"] == results["summary"]
    assert (copy / "results.md").read_text() == (out / "results.md").read_text()
    # from the ledger alone (a fresh checkout of a committed study has no cells/), then from
    # results.json alone (a study committed before the ledger): the same tables
    for gone in (copy / "cells", copy / "cells.jsonl"):
        shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
        (copy / "results.md").unlink()
        done = report(copy)
        assert done.returncode == 0, done.stderr
        assert (copy / "results.md").read_text() == (out / "results.md").read_text(), gone.name
    bad = report(tmp_path / "nope")
    assert bad.returncode != 0 and "study.json" in bad.stderr and "Traceback" not in bad.stderr


def test_the_tiny_base_has_no_two_stage_by_default() -> None:
    assert "tune_seeds" not in TINY and not tiny().two_stage


def test_round_three_config_is_the_preregistered_design() -> None:
    from dlrm_vrgd.study.config import load_study

    root = Path(__file__).resolve().parents[2]
    study = load_study(root / "configs" / "study_cpu_round3.yaml")
    assert study.two_stage and len(study.run_seeds) == 2 and len(study.confirm_seeds or []) >= 8
    assert not set(study.run_seeds) & set(study.confirm_seeds or [])
    names = {o.name: o for o in study.optimizers}
    assert {"sgd", "adagrad", "vrsgd", "vradam"} <= set(names)
    assert names["vrsgd"].groups == [16] and names["vradam"].groups == [16]
    ratios = {o.sparse["clip_ratio"] for o in study.optimizers if o.name.startswith("cowclip")}
    assert len(ratios) >= 2  # CowClip's clip_ratio is tuned too
    assert study.edge_extensions >= 1 and study.steps_at_largest >= 1000
    assert study.collapse_auc == 0.75
    prereg = (root / "docs" / "study" / "cpu_round3" / "PREREGISTRATION.md").read_text()
    assert "below 0.75" in prereg and "100–107" in prereg
    pilot = load_study(root / "configs" / "study_pilot_round3.yaml")
    assert pilot.base["data"] == study.base["data"] and pilot.steps_at_largest == 1000


def test_round_three_32k_config_is_the_preregistered_design() -> None:
    """Round three as run: cpu_32k's data and model (the regime that degraded most), the
    two-stage protocol and the endpoints its PREREGISTRATION.md names."""
    from dlrm_vrgd.study.config import load_study

    root = Path(__file__).resolve().parents[2]
    study = load_study(root / "configs" / "study_cpu_round3_32k.yaml")
    assert study.two_stage and study.run_seeds == [0, 1]
    assert study.confirm_seeds == list(range(100, 108))
    assert study.batch_sizes == [4096, 32768] and study.steps_at_largest == 125
    names = {o.name: o for o in study.optimizers}
    assert set(names) == {"sgd", "adagrad", "vrsgd", "vradam", "cowclip_r1", "cowclip_r0.1"}
    assert names["vrsgd"].groups == [16] and names["vradam"].groups == [16]
    assert study.edge_extensions == 2 and study.collapse_auc == 0.78
    regime = load_study(root / "configs" / "study_cpu_32k.yaml")
    assert study.base["data"] == regime.base["data"] and study.base["model"] == regime.base["model"]
    prereg = (root / "docs" / "study" / "cpu_round3_32k" / "PREREGISTRATION.md").read_text()
    assert "below 0.78" in prereg and "100–107" in prereg and "32,768" in prereg


def test_the_noise_scale_columns_are_medians_over_the_reported_cells() -> None:
    study = tiny(lr_multipliers=[1.0], rule_multiplier=1.0, seeds=[0, 1, 2])
    cells = _cells({(128, "sgd"): [0.80, 0.81, 0.82]})
    late = [900.0, 100.0, 400.0]  # median 400
    curves = [  # first tenth: (10, 30) -> 20; (50,) -> 50; none -> left out; median 35
        [[0.05, 10.0], [0.1, 30.0], [0.5, 999.0]],
        [[0.02, 50.0], [0.9, 5.0]],
        [[0.5, 7.0]],
    ]
    for c, b, curve in zip(cells, late, curves, strict=True):
        c.update(b_simple=b, b_simple_curve=curve)
    (row,) = summarize(study, cells)
    assert row["b_simple"] == 400.0 and row["b_simple_early"] == 35.0
    md = markdown(study, [row], 0.8, summarize(study, cells, "rule"))
    assert "| 35 | 400 |" in md
    # restored cells (no curve, no B_simple) give no figure, not a zero
    bare = [{k: v for k, v in c.items() if not k.startswith("b_simple")} for c in cells]
    (row,) = summarize(study, bare)
    assert row["b_simple"] is None and row["b_simple_early"] is None


def test_a_cell_restored_without_its_curve_is_not_counted_as_missing_the_target() -> None:
    """Restored from its one-line record, a cell kept no validation curve: "reached target"
    counts only the cells that can say (2 of 2 here, not 2 of 3), and none at all reads "–"."""
    study = tiny(**TWO_STAGE)
    cells = _two_stage_cells(study, lambda c: 0.7 - abs(c.lr_multiplier - 1), lambda c: 0.8)
    for c in cells:
        c["rows_to_target"] = 1000 if c["seed"] != 10 else None
        if c["seed"] == 10:
            c["restored"] = "metrics.jsonl"
    p = plan(study, {c["cell"]: c["val_auc"] for c in cells})
    rows = summarize(study, cells, "tuned", p)
    assert rows and {r["reached_target"] for r in rows} == {"2/2"}
    for c in cells:
        c["restored"] = "metrics.jsonl"
    rows = summarize(study, cells, "tuned", p)
    assert {r["reached_target"] for r in rows} == {None}
    assert "| – |" in markdown(study, rows, 0.8)
    for c in cells:  # a cell restored from results.json kept its figure: None is "not reached"
        c["restored"] = "results.json"
    assert {r["reached_target"] for r in summarize(study, cells, "tuned", p)} == {"2/3"}


def test_a_ledger_restored_from_results_json_retrains_only_the_skipped_arm(
    two_stage_run, tmp_path: Path
) -> None:
    """docs/study/restore_ledger.py: a study committed before the ledger (results.json, no
    cells) gets its ledger back; the arm left out with --skip-optimizer is trained again, every
    other cell is skipped with the figures it had."""
    study, out, results = two_stage_run
    copy = tmp_path / "old"
    copy.mkdir()
    for name in ("study.json", "results.json"):
        shutil.copy(out / name, copy / name)
    config = tmp_path / "study.yaml"
    config.write_text(json.dumps(study.model_dump(mode="json")))
    script = Path(__file__).resolve().parents[2] / "docs" / "study" / "restore_ledger.py"
    argv = [sys.executable, str(script), str(config), str(copy), "--from", "results.json"]
    env = {**os.environ, "PYTHONPATH": str(script.parents[2])}
    proc = subprocess.run(
        [*argv, "--skip-optimizer", "vrsgd"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (copy / "cells.jsonl").read_text().splitlines()]
    kept = {c["cell"] for c in results["cells"] if c["optimizer"] != "vrsgd"}
    assert {r["cell"] for r in records} == kept
    assert {r["figures"]["restored"] for r in records} == {"results.json"}
    again = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode != 0 and "exists: nothing restored" in again.stderr
    seen: dict[str, str] = {}
    rerun = run_study(study, copy, on_cell=lambda i, n, c, status, rec: seen.update({c.id: status}))
    assert {c for c, st in seen.items() if st == "skip"} == kept
    assert {c for c, st in seen.items() if st == "done"} == {
        c["cell"] for c in results["cells"] if c["optimizer"] == "vrsgd"
    }
    by_id = {c["cell"]: c for c in rerun["cells"]}
    for c in results["cells"]:  # the restored figures are the report's, the retrained equal too
        assert by_id[c["cell"]]["test_auc"] == pytest.approx(c["test_auc"], abs=1e-6)
