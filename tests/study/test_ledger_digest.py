"""A cell's config digest leaves out the keys added after cells were recorded while they hold
the value those cells trained at (``run.precision``, ``model.embedding_precision``: fp32), and
keeps them otherwise."""

from __future__ import annotations

import copy

import pytest

from dlrm_vrgd.config import TrainConfig
from dlrm_vrgd.study.ledger import config_digest


@pytest.mark.parametrize(
    ("section", "key", "other"),
    [("run", "precision", "bf16"), ("model", "embedding_precision", "fp16")],
)
def test_precision_at_fp32_is_left_out_and_another_is_another_cell(section, key, other) -> None:
    config = TrainConfig().to_dict()
    older = copy.deepcopy(config)
    del older[section][key]  # a cell recorded before the key existed
    assert config[section][key] == "fp32"
    assert config_digest(config) == config_digest(older)
    changed = copy.deepcopy(config)
    changed[section][key] = other
    assert config_digest(changed) != config_digest(config)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("tensorboard", False),
        ("heap_release", "never"),
        ("input", {"builder": "processes", "workers": 3, "depth": 4}),
        ("mlflow", {"tracking_uri": "file:///tmp/mlruns", "experiment": "e"}),
    ],
)
def test_how_a_cell_is_carried_out_is_not_part_of_its_digest(key, value) -> None:
    config = TrainConfig().to_dict()
    changed = copy.deepcopy(config)
    changed["run"][key] = value
    assert config_digest(changed) == config_digest(config)


def test_what_a_cell_trains_is_part_of_its_digest() -> None:
    config = TrainConfig().to_dict()
    for section, key, value in [("run", "seed", 3), ("run", "micro_batch", 512),
                                ("optim", "dense", {"name": "sgd"})]:  # fmt: skip
        changed = copy.deepcopy(config)
        changed[section][key] = value
        assert config_digest(changed) != config_digest(config), key
