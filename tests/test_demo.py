"""configs/demo.yaml, trained for its default budget, lands within 0.03 AUC of the oracle."""

from __future__ import annotations

from pathlib import Path

from dlrm_vrgd.config import load_config
from dlrm_vrgd.train.run import train

REPO = Path(__file__).resolve().parent.parent


def test_demo_config_reaches_the_oracle(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "demo.yaml", ["run.eval_every=0"])
    result = train(cfg, tmp_path / "demo")
    assert result.test["oracle_auc"] > 0.8
    assert result.test["oracle_auc"] - result.test["auc"] < 0.03
    assert result.val["oracle_auc"] - result.val["auc"] < 0.03
    assert 0.9 < result.test["calibration"] < 1.1
