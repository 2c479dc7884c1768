from __future__ import annotations

import math

import pytest

from dlrm_vrgd.config import ScheduleConfig
from dlrm_vrgd.optim.schedule import batch_scale, lr_factor


def test_warmup_is_linear() -> None:
    cfg = ScheduleConfig(warmup_steps=4)
    assert [lr_factor(s, 100, cfg) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_poly_decay_hand_computed() -> None:
    cfg = ScheduleConfig(warmup_steps=2, decay="poly", min_lr_factor=0.1)
    # after warm-up, progress p = (step - 2) / (10 - 1 - 2)
    for step in (2, 5, 9):
        p = (step - 2) / 7
        assert lr_factor(step, 10, cfg) == pytest.approx(0.1 + 0.9 * (1 - p) ** 2)
    assert lr_factor(9, 10, cfg) == pytest.approx(0.1)


def test_cosine_decay_hand_computed() -> None:
    cfg = ScheduleConfig(decay="cosine")
    assert lr_factor(0, 11, cfg) == pytest.approx(1.0)
    assert lr_factor(5, 11, cfg) == pytest.approx(0.5)
    assert lr_factor(10, 11, cfg) == pytest.approx(0.0)
    assert lr_factor(2, 11, cfg) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))


def test_batch_scaling_rules() -> None:
    assert batch_scale(32768, ScheduleConfig(lr_scaling="linear", reference_batch=8192)) == 4.0
    assert batch_scale(32768, ScheduleConfig(lr_scaling="sqrt", reference_batch=8192)) == 2.0
    assert batch_scale(32768, ScheduleConfig()) == 1.0


def test_negative_step_is_an_error() -> None:
    with pytest.raises(ValueError):
        lr_factor(-1, 10, ScheduleConfig())
