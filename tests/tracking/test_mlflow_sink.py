"""MLflow export against a local SQLite tracking store: params, metrics and artifacts arrive and
match the run directory; an unreachable server does not fail the job."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dlrm_vrgd.study import StudyConfig, run_study
from dlrm_vrgd.train.run import train

from ..conftest import tiny_config, tiny_config_dict
from .events import jsonl

pytest.importorskip("mlflow", reason="MLflow is optional: pip install 'dlrm-vrgd[tracking]'")
from mlflow.tracking import MlflowClient  # noqa: E402

# MLflow 3.17's SQLAlchemy models trip a deprecation of SQLAlchemy 2.1: noise we cannot fix
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")

REPO = Path(__file__).resolve().parents[2]
SPLIT_PREFIX = {"val": "val", "test": "test", "train": "train_eval"}


def store(tmp_path: Path) -> tuple[str, str]:
    return f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "artifacts")


def flat(config: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        elif isinstance(value, list):
            out[f"{prefix}{key}"] = json.dumps(value, separators=(",", ":"))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def test_params_metrics_and_artifacts_match_the_run_directory(tmp_path: Path) -> None:
    uri, artifacts = store(tmp_path)
    cfg = tiny_config(
        "run.eval_every=2",
        f"run.mlflow={{tracking_uri: '{uri}', experiment: ctr, artifact_location: '{artifacts}'}}",
        optim={"dense": {"name": "vrsgd", "lr": 0.05}, "sparse": {"name": "gsnr_sgd"}},
    )
    out = tmp_path / "run"
    train(cfg, out)
    result = json.loads((out / "result.json").read_text())
    client = MlflowClient(uri)
    run = client.get_run(result["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert client.get_experiment(run.info.experiment_id).name == "ctr"
    assert result["mlflow"]["tracking_uri"] == uri
    # params: the flattened config (as stored in config.json)
    config = json.loads((out / "config.json").read_text())
    assert run.data.params == flat(config)
    assert run.data.params["optim.dense.name"] == "vrsgd"
    # metrics: every value of metrics.jsonl and gsnr.jsonl at its step
    want: dict[str, list[tuple[int, float]]] = {}
    for r in jsonl(out / "metrics.jsonl"):
        if r["kind"] == "train":
            want.setdefault("train/loss", []).append((r["step"], r["loss"]))
            want.setdefault("train/lr_dense", []).append((r["step"], r["lr_dense"]))
        elif r["kind"] == "eval":
            for key in ("auc", "oracle_auc", "ne", "calibration"):
                tag = f"{SPLIT_PREFIX[r['split']]}/{key}"
                want.setdefault(tag, []).append((r["step"], r[key]))
    for r in jsonl(out / "gsnr.jsonl"):
        for t in r["tables"]:
            tag = f"gsnr/table/{t['table']}/multi_group_rows"
            want.setdefault(tag, []).append((r["step"], t["multi_group_rows"]))
    assert [s for s, _ in want["val/auc"]] == [2, 4] and len(want["train/loss"]) == 4
    for tag, points in want.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag))
        assert history == sorted(points), tag  # doubles, stored as doubles
    # artifacts: result.json and config.json, byte for byte
    names = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"result.json", "config.json"} <= names
    local = client.download_artifacts(run.info.run_id, "result.json", str(tmp_path / "dl"))
    assert Path(local).read_bytes() == (out / "result.json").read_bytes()


def test_an_unreachable_server_does_not_fail_the_job(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # bounded for the test's sake
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    cfg = tiny_config("run.eval_every=2", "run.mlflow.tracking_uri=http://127.0.0.1:9")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        result = train(cfg, tmp_path)
    assert result.steps == 4 and time.monotonic() - t0 < 120
    stored = json.loads((tmp_path / "result.json").read_text())
    assert stored["test"]["auc"] == result.test["auc"]
    assert stored["mlflow"]["tracking_uri"] == "http://127.0.0.1:9"
    assert "run_id" not in stored["mlflow"] and stored["mlflow"]["error"]
    failures = [r for r in caplog.records if "MLflow" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in failures]  # once, not every step
    assert (tmp_path / "tb").is_dir()  # the other tracker is unaffected


def test_a_study_is_a_parent_run_with_its_tables_and_plots(tmp_path: Path) -> None:
    from tests.study.test_study import TINY

    uri, artifacts = store(tmp_path)
    base = json.loads(json.dumps(TINY["base"]))
    base["run"]["mlflow"] = {"tracking_uri": uri, "artifact_location": artifacts}
    study = StudyConfig.model_validate(
        {**TINY, "base": base, "lr_multipliers": [1.0], "seeds": [0]}
    )
    out = tmp_path / "study"
    run_study(study, out)
    parent = json.loads((out / "mlflow.json").read_text())["run_id"]
    client = MlflowClient(uri)
    names = {f.path for f in client.list_artifacts(parent)}
    assert {"results.json", "results.csv", "results.md", "study.json"} <= names
    assert any(n.endswith(".png") for n in names)
    assert client.get_run(parent).data.params["steps_at_largest"] == "4"
    for cell in study.cells():
        result = json.loads((out / "cells" / cell.id / "result.json").read_text())
        child = client.get_run(result["mlflow"]["run_id"])
        assert child.data.tags["mlflow.parentRunId"] == parent
        assert child.info.run_name == cell.id
        assert (out / "cells" / cell.id / "tb").is_dir()
    # a second pass reuses the finished cells and the same parent run
    run_study(study, out)
    assert json.loads((out / "mlflow.json").read_text())["run_id"] == parent


def _cli(cwd: Path, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run the CLI; on a timeout, SIGABRT makes the child's faulthandler print every thread's
    stack, and the test fails with it (a hang says where it hangs)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(
        [sys.executable, "-m", "dlrm_vrgd.cli", *argv],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as child:  # fmt: skip
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGABRT)
            out, err = child.communicate(timeout=30)
            pytest.fail(
                f"dlrm-vrgd {argv[0]} hung for {timeout:.0f} s; its stacks:\n{err[-20000:]}"
            )
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def test_the_cli_keeps_artifacts_beside_the_store_and_registers_the_model(tmp_path: Path) -> None:
    """``train --export-model`` from a working directory that is not the store's: no ``mlruns/``
    appears there, the artifacts sit beside the sqlite database, and the model directory is the
    run's ``model`` artifact and version 1, then 2 (``export --mlflow``), of the registered
    model."""
    work = tmp_path / "cwd"
    (work / "store").mkdir(parents=True)
    (work / "tiny.yaml").write_text(yaml.safe_dump(tiny_config_dict()))
    mlflow = "{tracking_uri: 'sqlite:///store/mlflow.db', register_model: ctr-dlrm}"
    proc = _cli(
        work, "train", "--config", "tiny.yaml", "--out", "run", "--set", f"run.mlflow={mlflow}",
        "--export-model", "model",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in work.iterdir()) == ["model", "run", "store", "tiny.yaml"]
    assert sorted(p.name for p in (work / "store").iterdir()) == ["mlflow-artifacts", "mlflow.db"]
    result = json.loads((work / "run" / "result.json").read_text())["mlflow"]
    run_id = result["run_id"]
    assert result["model_uri"] == f"runs:/{run_id}/model"
    assert result["registered_model"] == {"name": "ctr-dlrm", "version": 1}
    client = MlflowClient(f"sqlite:///{work / 'store' / 'mlflow.db'}")
    run = client.get_run(run_id)
    beside = (work / "store" / "mlflow-artifacts").resolve()
    assert run.info.artifact_uri.startswith(beside.as_uri() + "/")
    # the model directory, byte for byte, as the run's model artifact
    model_files = sorted(p.name for p in (work / "model").iterdir())
    assert {"manifest.json", "weights.pt", "model.pt2"} <= set(model_files)
    assert sorted(Path(f.path).name for f in client.list_artifacts(run_id, "model")) == model_files
    local = Path(client.download_artifacts(run_id, "model", str(tmp_path / "dl")))
    for name in model_files:
        assert (local / name).read_bytes() == (work / "model" / name).read_bytes(), name
    (version,) = client.search_model_versions("name='ctr-dlrm'")
    assert int(version.version) == 1 and version.run_id == run_id
    assert version.source == f"{run.info.artifact_uri}/model"
    # a later export of the same run adds version 2 to the run it came from
    proc = _cli(work, "export", "--run", "run", "--out", "model2", "--mlflow", "--no-program")
    assert proc.returncode == 0, proc.stderr
    assert f"MLflow run {run_id}: logged runs:/{run_id}/model" in proc.stdout
    assert "registered as 'ctr-dlrm' version 2" in proc.stdout
    assert {int(v.version) for v in client.search_model_versions("name='ctr-dlrm'")} == {1, 2}
    assert not (work / "mlruns").exists()


def test_export_mlflow_without_an_mlflow_run_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config_dict()))
    argv = ["--config", "tiny.yaml", "--out", "run", "--set", "run.checkpoint_every=4"]
    assert _cli(tmp_path, "train", *argv).returncode == 0
    proc = _cli(tmp_path, "export", "--run", "run", "--out", "model", "--mlflow")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "has no MLflow run to log to" in proc.stderr and "run.mlflow" in proc.stderr
    assert not (tmp_path / "model").exists()  # refused before anything is written
