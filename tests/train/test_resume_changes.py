"""What a resumed run may change: how long and how it is carried out (tracking, the input
pipeline, the heap's hand-back: every field marked OPERATIONAL, down to its sub-keys), never
what it trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrm_vrgd.train.resume import check_resume
from dlrm_vrgd.train.run import train

from ..conftest import tiny_config


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resume") / "run"
    train(
        tiny_config(
            "run.steps=2",
            "run.tensorboard=false",
            "run.mlflow.tracking_uri=file:///tmp/mlruns-a",
        ),
        out,
    )
    return out


@pytest.mark.parametrize(
    "change",
    [
        "run.steps=6",
        "run.tensorboard=true",
        "run.heap_release=never",
        "run.input.builder=threads",
        "run.input.depth=3",
        # a sub-key of an operational section: the resume check compares key by key, so the
        # section's name must cover what is below it
        "run.mlflow.tracking_uri=file:///tmp/mlruns-b",
        "run.precision=bf16",
    ],
)
def test_a_resume_may_change_how_the_run_is_carried_out(finished: Path, change: str) -> None:
    cfg = tiny_config(
        "run.steps=2",
        "run.tensorboard=false",
        "run.mlflow.tracking_uri=file:///tmp/mlruns-a",
        change,
    )
    assert check_resume(finished, cfg, resume=True) is not None


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("run.seed=7", "run.seed"),
        ("optim.dense.lr=0.02", "optim.dense.lr"),
        ("run.micro_batch=32", "run.micro_batch"),
    ],
)
def test_a_resume_may_not_change_what_is_trained(finished: Path, change: str, named: str) -> None:
    cfg = tiny_config(
        "run.steps=2",
        "run.tensorboard=false",
        "run.mlflow.tracking_uri=file:///tmp/mlruns-a",
        change,
    )
    with pytest.raises(ValueError, match=rf"config differs in {named}$"):
        check_resume(finished, cfg, resume=True)


def test_a_checkpoint_from_before_a_field_existed_resumes_at_its_default(
    finished: Path, tmp_path: Path
) -> None:
    """Fields added since (marked ADDED_LATER, at any depth) are missing from an older
    checkpoint's config: it trained at their defaults, so it resumes; another value is another
    run."""
    import json
    import shutil

    old = tmp_path / "old"
    shutil.copytree(finished, old)
    [manifest_path] = old.glob("checkpoints/step_*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    cfg = manifest["config"]
    del cfg["optim"]["dense"]["initial_accumulator_value"], cfg["data"]["multi_hot_sizes"]
    del cfg["run"]["evals_per_epoch"], cfg["run"]["target_auc"]
    manifest_path.write_text(json.dumps(manifest))
    base = ("run.steps=2", "run.tensorboard=false", "run.mlflow.tracking_uri=file:///tmp/mlruns-a")
    assert check_resume(old, tiny_config(*base), resume=True) is not None
    changed = tiny_config(*base, "optim.dense.initial_accumulator_value=0.5")
    with pytest.raises(ValueError, match="optim.dense.initial_accumulator_value"):
        check_resume(old, changed, resume=True)
