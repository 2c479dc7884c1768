"""Which trackers a config asks for, and clear errors for bad tracking settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrm_vrgd.config import ConfigError
from dlrm_vrgd.tracking import trackers
from dlrm_vrgd.tracking.tensorboard_sink import TensorBoardSink

from ..conftest import tiny_config


def test_tensorboard_is_on_by_default_and_mlflow_off(tmp_path: Path) -> None:
    sinks = trackers(tiny_config(), tmp_path, resumed=False)
    try:
        assert [type(s) for s in sinks] == [TensorBoardSink]
    finally:
        for s in sinks:
            s.close()
    assert trackers(tiny_config("run.tensorboard=false"), tmp_path, resumed=False) == []


def test_a_stale_tb_dir_of_a_fresh_run_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out.tfevents.old").write_bytes(b"stale")
    sinks = trackers(tiny_config(), tmp_path, resumed=False)
    for s in sinks:
        s.close()
    assert not (tmp_path / "tb" / "events.out.tfevents.old").exists()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1


@pytest.mark.parametrize(
    "override,field",
    [
        ("run.mlflow={experiment: x}", "run.mlflow.tracking_uri"),
        ("run.mlflow={tracking_uri: ''}", "run.mlflow.tracking_uri"),
        ("run.mlflow={tracking_uri: 'sqlite:///m.db', experiment: ''}", "run.mlflow.experiment"),
        ("run.mlflow={tracking_uri: 'sqlite:///m.db', tracking: 1}", "run.mlflow.tracking"),
        ("run.tensorboard=maybe", "run.tensorboard"),
    ],
)
def test_bad_tracking_settings_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        tiny_config(override)
