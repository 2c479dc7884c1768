"""TensorBoard at every evaluation: histograms of the dense weights and of the tables' row norms
(equal to the checkpoint written at that step), and a PR curve per eval split whose counts are
the eval's predictions (its ROC AUC is the record's), read back with tensorboard's own reader
from a run made by the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dlrm_vrgd.config import parse_config
from dlrm_vrgd.data.synthetic import SyntheticCriteo

from ..conftest import tiny_config_dict
from .events import accumulator, jsonl

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("details")
    (work / "tiny.yaml").write_text(yaml.safe_dump(tiny_config_dict()))
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "train", "--config", "tiny.yaml", "--out", "run",
         "--set", "run.eval_every=2", "--set", "run.checkpoint_every=2",
         "--set", "optim.dense.name=vradam", "--set", "run.gsnr_every=1"],
        cwd=work, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return work / "run"


def test_histograms_are_the_weights_and_row_norms_at_each_eval(run: Path) -> None:
    acc = accumulator(run / "tb")
    tags = {t for t in acc.Tags()["histograms"] if t.startswith("weights/")}
    for step in (2, 4):  # the periodic eval at 2, the final evals at 4
        state = torch.load(run / "checkpoints" / f"step_{step:08d}" / "rank0.pt", weights_only=True)
        want = {f"weights/dense/{n}": w.float().numpy().ravel() for n, w in state["dense"].items()}
        for table in state["tables"]:
            for name, w in zip(table["names"], table["weights"], strict=True):
                # the L2 norm of each row, written out from its definition
                want[f"weights/row_norm/{name}"] = np.sqrt((w.double().numpy() ** 2).sum(axis=1))
        assert set(want) == tags and len(want) > 6
        for tag, values in want.items():
            (event,) = [e for e in acc.Histograms(tag) if e.step == step]
            h = event.histogram_value
            assert h.num == values.size, tag
            assert h.min == pytest.approx(values.min(), abs=1e-6), tag
            assert h.max == pytest.approx(values.max(), abs=1e-6), tag
            assert h.sum == pytest.approx(values.sum(), rel=1e-4, abs=1e-4), tag
            assert sum(h.bucket) == values.size, tag
    rows = {t: e.histogram_value.num for t, (*_, e) in ((t, acc.Histograms(t)) for t in tags)}
    assert rows["weights/row_norm/t_cat_0"] == 40  # a row per id (TINY_CARDINALITIES[0])


def test_gsnr_ratio_histograms_average_to_the_recorded_ratio(run: Path) -> None:
    """``gsnr/ratio/<tensor>``: the per-element ratio of the step before each eval; its mean is
    gsnr.jsonl's per-tensor ``ratio`` (the mean clipped ratio), computed apart."""
    acc = accumulator(run / "tb")
    records = {r["step"]: r for r in jsonl(run / "gsnr.jsonl")}
    tags = {t for t in acc.Tags()["histograms"] if t.startswith("gsnr/ratio/")}
    dense = records[4]["dense"]
    assert tags == {f"gsnr/ratio/{d['name']}" for d in dense} and dense
    for step in (2, 4):
        for d in records[step]["dense"]:
            (event,) = [e for e in acc.Histograms(f"gsnr/ratio/{d['name']}") if e.step == step]
            h = event.histogram_value
            assert h.num == d["numel"]
            assert 0.0 <= h.min <= h.max <= 1.0
            assert h.sum / h.num == pytest.approx(d["ratio"], rel=1e-4), (step, d["name"])


def roc_auc(tp: np.ndarray, fp: np.ndarray) -> float:
    """The trapezoid area under (FPR, TPR) through the thresholds' counts."""
    tpr, fpr = tp / tp[0], fp / fp[0]
    fpr, tpr = np.append(fpr, 0.0), np.append(tpr, 0.0)
    return float(np.sum((fpr[:-1] - fpr[1:]) * (tpr[:-1] + tpr[1:]) / 2))


def test_a_pr_curve_per_eval_holds_the_eval_s_predictions(run: Path) -> None:
    from tensorboard.util import tensor_util

    acc = accumulator(run / "tb")
    cfg = parse_config(tiny_config_dict())
    data = SyntheticCriteo(cfg.data)
    evals = {
        (r["split"], r["step"]): r for r in jsonl(run / "metrics.jsonl") if r["kind"] == "eval"
    }
    assert sorted(evals) == [("test", 4), ("val", 2), ("val", 4)]
    for (split, step), record in evals.items():
        (event,) = [e for e in acc.Tensors(f"pr/{split}") if e.step == step]
        assert event.wall_time == record["wall_time"]
        tp, fp, tn, fn, precision, recall = tensor_util.make_ndarray(event.tensor_proto)
        labels = data.source(split).read(0, 1024).labels
        positives = int(labels.sum())
        assert np.all(tp + fn == positives) and np.all(fp + tn == 1024 - positives)
        assert tp[0] == positives and fp[0] == 1024 - positives  # threshold 0: all positive
        assert np.all(np.diff(tp) <= 0) and np.all(np.diff(fp) <= 0)
        np.testing.assert_allclose(recall, tp / positives, rtol=1e-6)
        # 127 thresholds: the curve's ROC AUC is the eval's AUC to within the binning
        assert roc_auc(tp, fp) == pytest.approx(record["auc"], abs=0.01), (split, step)
