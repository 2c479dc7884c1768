from __future__ import annotations

from pathlib import Path

import pytest

from dlrm_vrgd.config import ConfigError, TrainConfig, apply_overrides, load_config, parse_config

from .conftest import tiny_config_dict

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "name", ["demo", "synthetic_kaggle", "criteo_kaggle", "criteo_small", "criteo_1tb", "batch512k"]
)
def test_shipped_configs_load(name: str) -> None:
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    assert cfg.run.global_batch % cfg.run.micro_batch == 0


def test_batch512k_is_a_512k_batch() -> None:
    cfg = load_config(REPO / "configs" / "batch512k.yaml")
    assert cfg.run.global_batch == 512 * 1024
    assert cfg.run.world_size == 2 and cfg.run.accumulation_steps == 32  # 2 x 32 x 8192


def test_world_size_rules_are_clear() -> None:
    from dlrm_vrgd.config import parse_config

    from .conftest import tiny_config_dict

    with pytest.raises(ConfigError, match="divisible by the world size"):
        parse_config(tiny_config_dict(run={"global_batch": 255, "nproc_per_node": 2}))
    with pytest.raises(ConfigError, match="multiple of micro_batch"):
        parse_config(
            tiny_config_dict(run={"global_batch": 256, "micro_batch": 96, "nproc_per_node": 2})
        )
    with pytest.raises(ConfigError, match="data_parallel tables would be trained by the dense"):
        parse_config(tiny_config_dict(run={"sharding": ["table_wise", "data_parallel"]}))
    cfg = parse_config(
        tiny_config_dict(run={"nnodes": 2, "nproc_per_node": 2, "global_batch": 256})
    )
    assert cfg.run.world_size == 4 and cfg.run.accumulation_steps == 1


def test_defaults_are_valid() -> None:
    cfg = TrainConfig()
    assert cfg.data.source == "synthetic"
    assert len(cfg.data.cardinalities) == 26
    assert cfg.model.dense_arch[-1] == cfg.model.embedding_dim


def test_unknown_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  dense:\n    lrr: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "optim.dense.lrr" in str(err.value)
    assert "Extra inputs are not permitted" in str(err.value)


def test_wrong_type_is_named() -> None:
    raw = tiny_config_dict(run={"global_batch": "lots"})
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert "run.global_batch" in str(err.value)


def test_data_errors_name_the_field_without_the_union_tag() -> None:
    raw = tiny_config_dict(data={"train_rows": -5})
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert "data.train_rows" in str(err.value)


def test_negative_lr_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"optim\.sparse\.lr"):
        parse_config(tiny_config_dict(optim={"sparse": {"lr": -1.0}}))


def test_batch_must_divide() -> None:
    with pytest.raises(ConfigError, match="multiple of micro_batch"):
        parse_config(tiny_config_dict(run={"global_batch": 100, "micro_batch": 64, "steps": 1}))


def test_dense_arch_must_end_with_embedding_dim() -> None:
    raw = tiny_config_dict(model={"embedding_dim": 8, "dense_arch": [16, 4]})
    with pytest.raises(ConfigError, match=r"model: .*dense_arch must end with embedding_dim"):
        parse_config(raw)


def test_steps_and_epochs_are_exclusive() -> None:
    with pytest.raises(ConfigError, match="not both"):
        parse_config(tiny_config_dict(run={"steps": 3, "epochs": 1.0}))


def test_epochs_give_steps() -> None:
    raw = tiny_config_dict(run={"steps": None, "epochs": 1.5})
    cfg = parse_config(raw)
    assert cfg.total_steps(train_rows=4096) == 24  # ceil(1.5 * 4096 / 256)


def test_overrides_parse_yaml_values() -> None:
    raw = apply_overrides(
        tiny_config_dict(),
        [
            "optim.dense.lr=0.5",
            "model.dense_arch=[32, 8]",
            "run.eval_every=7",
            "model.arch=dlrm_dcn",
        ],
    )
    cfg = parse_config(raw)
    assert cfg.optim.dense.lr == 0.5
    assert cfg.model.dense_arch == [32, 8]
    assert cfg.run.eval_every == 7
    assert cfg.model.arch == "dlrm_dcn"


def test_override_without_equals_is_an_error() -> None:
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides({}, ["optim.dense.lr"])


def test_bad_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("run:\n  steps: 3\n  micro_batch: [1, 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value)
    assert "line" in str(err.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_round_trip_through_dict() -> None:
    cfg = parse_config(tiny_config_dict())
    assert parse_config(cfg.to_dict()) == cfg


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_a_set_of_steps_replaces_the_files_epochs_and_the_other_way_round(
    tmp_path: Path,
) -> None:
    """`--set run.steps=30` on a config with `epochs` (configs/criteo_small.yaml) runs 30
    steps, not an error asking for `run.epochs=null`; likewise epochs over a file's steps.
    Both set on the command line is still the user's mistake, blamed on the overrides."""
    epochs = _yaml(tmp_path, "run:\n  epochs: 3\n")
    cfg = load_config(epochs, ["run.steps=30"])
    assert (cfg.run.steps, cfg.run.epochs) == (30, None)
    steps = _yaml(tmp_path, "run:\n  steps: 7\n")
    cfg = load_config(steps, ["run.epochs=0.5"])
    assert (cfg.run.steps, cfg.run.epochs) == (None, 0.5)
    shipped = load_config(REPO / "configs" / "criteo_small.yaml", ["run.steps=30"])
    assert shipped.run.steps == 30 and shipped.run.epochs is None
    with pytest.raises(ConfigError) as err:
        load_config(epochs, ["run.steps=30", "run.epochs=2"])
    assert "--set" in str(err.value) and "not both" in str(err.value)
    assert str(epochs) not in str(err.value).splitlines()[0]  # the file is not to blame


def test_set_mistakes_are_blamed_on_the_override_with_a_suggestion(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "run:\n  epochs: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["run.stepz=30"])
    message = str(err.value)
    assert "--set run.stepz=30" in message and "did you mean run.steps?" in message, message
    assert f"invalid {path}" not in message
    with pytest.raises(ConfigError) as err:
        load_config(path, ["optim.dense.lrr=0.1"])
    assert "--set optim.dense.lrr=0.1" in str(err.value) and "did you mean optim.dense.lr?" in (
        str(err.value)
    )
    with pytest.raises(ConfigError) as err:
        load_config(path, ["run.global_batch=-1"])
    assert "--set run.global_batch=-1: run.global_batch:" in str(err.value)
    with pytest.raises(ConfigError) as err:  # a file's own mistake stays the file's
        load_config(_yaml(tmp_path, "data:\n  source: criteo\n  pathh: x\n"), ["run.steps=2"])
    message = str(err.value)
    assert "data.pathh" in message and "did you mean data.path?" in message, message
    assert "--set run.steps=2" not in message
