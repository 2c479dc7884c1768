"""A cell's config digest leaves out the run keys added after cells were recorded while they
hold the value those cells trained at (``run.precision: fp32``), and keeps them otherwise."""

from __future__ import annotations

import copy

from dlrm_vrgd.config import TrainConfig
from dlrm_vrgd.study.ledger import config_digest


def test_precision_at_fp32_is_left_out_and_bf16_is_another_cell() -> None:
    config = TrainConfig().to_dict()
    older = copy.deepcopy(config)
    del older["run"]["precision"]  # a cell recorded before the key existed
    assert config["run"]["precision"] == "fp32"
    assert config_digest(config) == config_digest(older)
    bf16 = copy.deepcopy(config)
    bf16["run"]["precision"] = "bf16"
    assert config_digest(bf16) != config_digest(config)
