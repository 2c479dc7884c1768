"""Primary endpoints and Holm's correction (issue 41): adjusted p-values checked against ones
computed by hand here; round three's registered family reproduces the outside check's 0.072;
the family is the registered one even while some of it has not run; the report says which
survive, labels exploratory studies, and shows batches that are tuned but not confirmed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dlrm_vrgd.study.config import load_study
from dlrm_vrgd.study.protocol import plan
from dlrm_vrgd.study.report import markdown, primary, summarize, tuned_only
from dlrm_vrgd.study.stats import holm

from .test_report_stats import _cells, _two_stage_cells
from .test_study import tiny

ROOT = Path(__file__).resolve().parents[2]


def test_holm_adjusts_as_computed_by_hand() -> None:
    # round three's four raw p (vrsgd, vradam, adagrad, cowclip_r0.1). Sorted: 0.001236 x 4 =
    # 0.004944; 0.02392 x 3 = 0.07176; 0.03277 x 2 = 0.06554, raised to the running max 0.07176;
    # 0.7784 x 1 = 0.7784.
    assert holm([0.02392, 0.03277, 0.7784, 0.001236]) == pytest.approx(
        [0.07176, 0.07176, 0.7784, 0.004944]
    )
    assert holm([0.6, 0.7]) == [1.0, 1.0]  # 1.2 capped at 1; monotone
    assert holm([0.04]) == [0.04]  # a family of one is not adjusted
    # a missing p counts in m (p = 1, never rejected): 0.01 x 2 = 0.02, not 0.01
    assert holm([0.01, None]) == [pytest.approx(0.02), None]
    assert holm([]) == []
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="not in"):
            holm([0.01, bad])


def test_round_three_s_registered_family_gives_the_outside_check_s_holm_p() -> None:
    """The four endpoints of docs/study/cpu_round3_32k/PREREGISTRATION.md, from the committed
    summary: VR-Adam's p = 0.033 becomes 0.072 under Holm and does not survive; VR-SGD's
    collapse-driven −0.0476 (p = 0.024) does not either; CowClip's does."""
    study = load_study(ROOT / "configs" / "study_cpu_round3_32k.yaml")
    summary = json.loads((ROOT / "docs/study/cpu_round3_32k/results.json").read_text())["summary"]
    family = primary(study, summary)
    assert family["registered"] and family["m"] == 4
    by = {e["optimizer"]: e for e in family["endpoints"]}
    assert list(by) == ["vrsgd", "vradam", "adagrad", "cowclip_r0.1"]
    assert by["vradam"]["p"] == pytest.approx(0.03277, abs=1e-5)
    assert by["vradam"]["p_holm"] == pytest.approx(0.0718, abs=1e-4)
    assert by["vradam"]["interaction"]["ci95"][0] > 0  # the raw interval excludes 0 ...
    assert by["vradam"]["survives"] is False  # ... and the claim still does not survive
    assert by["vrsgd"]["survives"] is False and by["adagrad"]["survives"] is False
    assert by["cowclip_r0.1"]["survives"] is True
    assert by["adagrad"]["edge"] == ["low"]  # its 32,768 pick sits on its grid's edge


def _two_arm_cells() -> list[dict]:
    return _cells(
        {
            (128, "sgd"): [0.800, 0.810, 0.805],
            (128, "vrsgd"): [0.801, 0.812, 0.806],
            (256, "sgd"): [0.790, 0.792, 0.801],
            (256, "vrsgd"): [0.799, 0.805, 0.809],
        }
    )


def test_an_unregistered_family_is_every_tuned_interaction_and_says_so() -> None:
    study = tiny(lr_multipliers=[1.0], rule_multiplier=1.0, seeds=[0, 1, 2])
    summary = summarize(study, _two_arm_cells())
    family = primary(study, summary)
    assert not family["registered"] and family["m"] == 1
    (e,) = family["endpoints"]
    # interactions by seed: (0.799-0.790)-(0.801-0.800) = 0.008, 0.011, 0.007: mean 0.008667,
    # sd 0.002082, t = 7.21 on 2 df, p = 0.0187; a family of one: Holm p = raw p
    assert e["interaction"]["mean"] == pytest.approx(0.008667, abs=1e-6)
    assert e["p"] == pytest.approx(0.0187, abs=2e-4) and e["p_holm"] == e["p"]
    assert e["survives"] is True
    md = markdown(study, summary, 0.8, family=family)
    assert "Not pre-registered" in md and "Holm over m = 1" in md
    assert "Survive Holm: vrsgd k = 4 − sgd. Do not survive: none." in md


def test_the_registered_family_counts_endpoints_that_have_not_run() -> None:
    """An arm with no cells yet stays in m: the other endpoint's Holm p is doubled."""
    study = tiny(
        lr_multipliers=[1.0],
        rule_multiplier=1.0,
        seeds=[0, 1, 2],
        optimizers=[
            *tiny().model_dump()["optimizers"],
            {
                "name": "vr2",
                "baseline": "sgd",
                "dense": {"name": "vrsgd"},
                "sparse": {"name": "gsnr_rowwise_adagrad"},
                "dense_lr": 0.05,
                "sparse_lr": 0.1,
            },
        ],  # fmt: skip
        primary_endpoints=[{"optimizer": "vrsgd"}, {"optimizer": "vr2"}],
    )
    family = primary(study, summarize(study, _two_arm_cells()))
    assert family["registered"] and family["m"] == 2
    done, missing = family["endpoints"]
    assert done["p_holm"] == pytest.approx(2 * done["p"], rel=1e-3)
    assert missing["optimizer"] == "vr2" and missing["p"] is None and missing["survives"] is None
    md = markdown(study, summarize(study, _two_arm_cells()), 0.8, family=family)
    assert "| vr2 − sgd |" in md and "| not run |" in md


def test_an_exploratory_study_is_labelled_above_every_figure() -> None:
    study = tiny(lr_multipliers=[1.0], rule_multiplier=1.0, seeds=[0, 1, 2], exploratory=True)
    summary = summarize(study, _two_arm_cells())
    md = markdown(study, summary, 0.8, family=primary(study, summary))
    head = md.split("## ")[0]
    assert "**Exploratory cells**, not pre-registered" in head  # before the first table
    assert "(exploratory)" in md.split("\n## ")[1].splitlines()[0]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"primary_endpoints": [{"optimizer": "nope"}]}, r"primary_endpoints\.0\.optimizer"),
        ({"primary_endpoints": [{"optimizer": "sgd"}]}, "sgd has no baseline"),
        ({"primary_endpoints": [{"optimizer": "vrsgd", "baseline": "vrsgd"}]}, "not another"),
        ({"primary_endpoints": [{"optimizer": "vrsgd", "groups": 3}]}, "no k = 3"),
        ({"primary_endpoints": [{"optimizer": "vrsgd"}] * 2}, "listed twice"),
        ({"exploratory": True, "preregistration": "docs/x.md"}, "exploratory"),
        ({"preregistration": "/etc/passwd"}, "preregistration"),
        ({"confirm_batches": [128, 256]}, "two-stage"),
    ],
)
def test_reporting_fields_are_checked_and_named(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny(**change)


def test_a_batch_left_out_of_confirm_batches_is_tuned_only_and_labelled() -> None:
    study = tiny(
        batch_sizes=[128, 256, 512],
        lr_multipliers=[0.5, 1.0],
        tune_seeds=[0],
        confirm_seeds=[10, 11],
        edge_extensions=0,
        confirm_batches=[128, 512],
    )
    with pytest.raises(ValueError, match="smallest and largest"):
        tiny(**{**study.model_dump(), "confirm_batches": [128, 256]})
    cells = _two_stage_cells(study, lambda c: 0.7 - abs(c.lr_multiplier - 1), lambda c: 0.8)
    p = plan(study, {c["cell"]: c["val_auc"] for c in cells})
    assert not p.todo and p.groups[(256, "sgd", None)].pick == 1.0  # tuned at 256 ...
    assert {c.global_batch for c in p.confirm_cells} == {128, 512}  # ... never confirmed there
    assert {c["global_batch"] for c in cells if c["seed"] >= 10} == {128, 512}
    summary = summarize(study, cells, "tuned", p)
    assert {s["global_batch"] for s in summary} == {128, 512}
    extra = tuned_only(study, p)
    assert [(r["global_batch"], r["optimizer"], r["lr_multiplier"]) for r in extra] == [
        (256, "sgd", 1.0),
        (256, "vrsgd", 1.0),
    ]
    md = markdown(study, summary, 0.8, plan=p, tuned_only=extra)
    assert "| 256 | sgd (tuning seeds only, not confirmed) |" in md
    assert "Batches [256] are tuned but not confirmed" in md


def test_the_gpu_study_is_its_preregistered_design() -> None:
    """configs/study_gpu_512k.yaml as docs/study/gpu_512k/PREREGISTRATION.md fixes it: 32k,
    128k and 512k at equal rows (one pass over 16.8M rows), k = 8, six arms, grid x0.5-x2 with
    three edge extensions, one tuning seed then 8 fresh ones at 32k and 512k, six primary
    endpoints under Holm; day files read for exactly the study's rows."""
    study = load_study(ROOT / "configs" / "study_gpu_512k.yaml")
    data = load_study(ROOT / "configs" / "study_gpu_512k.yaml").base["data"]
    assert study.batch_sizes == [32768, 131072, 524288] and study.groups == [8]
    assert study.train_rows == 16_777_216 and [study.steps(g) for g in study.batch_sizes] == [
        512,
        128,
        32,
    ]
    names = {o.name: o for o in study.optimizers}
    assert set(names) == {"sgd", "adagrad", "vrsgd", "vradam", "cowclip", "cowclip_sgdrule"}
    assert study.lr_rule_of(names["cowclip"]) == "cowclip"
    assert study.lr_rule_of(names["cowclip_sgdrule"]) == "sqrt"
    assert names["cowclip"].sparse == names["cowclip_sgdrule"].sparse
    assert study.lr_multipliers == [0.5, 1.0, 2.0] and study.edge_extensions == 3
    assert study.run_seeds == [0] and study.confirm_seeds == list(range(1000, 1008))
    assert study.confirmed_batches == [32768, 524288] and study.collapse_auc == 0.78
    endpoints = [(e.optimizer, e.baseline) for e in study.primary_endpoints or []]
    assert endpoints == [
        ("vrsgd", "sgd"), ("vrsgd", "adagrad"), ("vradam", "sgd"), ("vradam", "adagrad"),
        ("cowclip", "sgd"), ("cowclip_sgdrule", "sgd"),
    ]  # fmt: skip
    assert study.preregistration == "docs/study/gpu_512k/PREREGISTRATION.md"
    prereg = (ROOT / study.preregistration).read_text()
    for fact in ("1000–1007", "below **0.78**", "16,777,216", "m = 6", "×0.5, ×1, ×2"):
        assert fact in prereg, fact
    # the rows the study reads are the rows the data config generates, and each cell runs
    # its steps over them (day files are not sized by the study, as synthetic data is)
    from dlrm_vrgd.config import load_config

    gen = load_config(ROOT / "configs" / "study_gpu_512k_data.yaml").data
    assert gen.train_rows == study.train_rows and data["source"] == "criteo"
    for cell in study.cells()[:: len(study.lr_multipliers)]:
        cfg = study.cell_config(cell)
        assert cfg.run.steps == study.steps(cell.global_batch) and cfg.run.epochs is None
        assert cfg.run.micro_batch * 8 == cell.global_batch


def _committed_studies() -> list[Path]:
    return sorted(p.parent for p in (ROOT / "docs" / "study").glob("**/study.json"))


@pytest.mark.parametrize("study_dir", _committed_studies(), ids=lambda p: p.name)
def test_every_committed_report_is_today_s_report_code(study_dir: Path, tmp_path: Path) -> None:
    """Each committed results.md is what today's report code writes from the committed cells
    (`dlrm-vrgd study report DIR` rewrites it): with its primary endpoints, raw and
    Holm-adjusted p, and which survive; an exploratory study says so before any figure."""
    from dlrm_vrgd.study.run import rewrite_report

    for name in ("study.json", "cells.jsonl", "results.json", "result.json", "picks.json"):
        if (study_dir / name).exists():
            (tmp_path / name).write_bytes((study_dir / name).read_bytes())
    rewrite_report(tmp_path)
    committed = (study_dir / "results.md").read_text()
    assert (tmp_path / "results.md").read_text() == committed, "run `dlrm-vrgd study report`"
    assert "Holm" in committed and "over m = " in committed
    assert "p Holm" in committed or "No interaction can be formed" in committed
    saved = json.loads((study_dir / "study.json").read_text())
    if saved.get("exploratory"):
        assert "**Exploratory cells**" in committed.split("\n## ")[0]


#: How the pages name each arm of the committed studies.
ARM_NAMES = {
    "vrsgd": "VR-SGD",
    "vradam": "VR-Adam",
    "adagrad": "Adagrad",
    "cowclip": "CowClip",
    "cowclip_r1": "CowClip",
    "cowclip_r0.1": "CowClip",
}


def _ci(lo: float, hi: float) -> str:
    """An interval as the pages write it (a true minus sign, four decimals)."""
    return "[" + ", ".join(f"{x:+.4f}".replace("-", "−") for x in (lo, hi)) + "]"


def _pages() -> dict[str, str]:
    """README.md and every hand-written page (the generated study reports aside)."""
    pages = {"README.md": (ROOT / "README.md").read_text()}
    for p in sorted((ROOT / "docs").rglob("*.md")):
        if p.name not in ("results.md", "configuration.md", "api.md"):
            pages[str(p.relative_to(ROOT))] = p.read_text()
    return pages


def _quoting(text: str, figure: str) -> list[str]:
    """The paragraphs (list items and table rows count as paragraphs) that quote ``figure``."""
    blocks = re.split(r"\n\s*\n|\n(?=\s*[-*] )|\n(?=\|)", text)
    return [b for b in blocks if figure in b]


def test_no_claim_that_fails_holm_is_bold_and_every_edge_is_said_where_quoted() -> None:
    """Wherever a page quotes a committed study's interaction that does not survive Holm, no
    bold span in that paragraph names its arm; wherever it quotes a comparison (interaction or
    arm − base) whose pick sits on a grid's edge, the paragraph says "edge"."""
    pages = _pages()
    problems = []
    for results in sorted((ROOT / "docs" / "study").glob("**/results.json")):
        data = json.loads(results.read_text())
        rows = [(e, e["interaction"], e["survives"]) for e in data["primary"]["endpoints"]]
        rows += [(p, p["delta_test_auc"], None) for p in data["pairs"]]
        for row, stat, survives in rows:
            if stat["ci95"] is None:
                continue
            figure = _ci(*stat["ci95"])
            name = ARM_NAMES.get(row["optimizer"], row["optimizer"])
            for page, text in pages.items():
                for block in _quoting(text, figure):
                    bold = re.findall(r"\*\*(.+?)\*\*", block, flags=re.S)
                    if survives is False and any(name in b for b in bold):
                        problems.append(f"{page}: bold {name} beside {figure} (fails Holm)")
                    if row["edge"] and "edge" not in block:
                        problems.append(f"{page}: {figure} ({results.parent.name}) is an edge pick")
    assert not problems, "\n".join(problems)
