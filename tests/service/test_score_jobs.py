"""Score jobs and the model artifact, through a real service process over HTTP: a train job on
preprocessed Criteo rows leaves a downloadable model; a score job scores raw rows under the data
root with it, and its predictions equal the downloaded model's."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.csv as pcsv
import pytest
import torch

from dlrm_vrgd.data.batch import Batch
from dlrm_vrgd.data.criteo.format import format_criteo_text
from dlrm_vrgd.data.criteo.preprocess import preprocess
from dlrm_vrgd.data.rows import Rows
from dlrm_vrgd.serve.model import load_model
from service.client import API, ApiError, ServiceClient
from service.launcher import LocalService

from ..conftest import tiny_config_dict
from ..data.criteo.test_criteo import expected, make_rows


def test_train_job_model_artifact_and_a_score_job(
    tmp_path: Path,
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    data_root = tmp_path / "data" / "data"  # the service's default data root: DATA_DIR/data
    raw = tmp_path / "raw"
    raw.mkdir()
    for i, seed in enumerate((51, 52)):
        (raw / f"day_{i}.tsv").write_bytes(format_criteo_text(*make_rows(300, seed)))
    preprocess([raw], data_root / "criteo", max_rows_per_table=30, progress=False)
    labels, ints, cats = make_rows(250, 53)
    (data_root / "new.tsv").write_bytes(format_criteo_text(labels, ints, cats))

    client = client_of(start_service())
    cfg = tiny_config_dict(run={"steps": 2, "global_batch": 128, "micro_batch": 64})
    cfg["data"] = {"source": "criteo", "path": str(data_root / "criteo"), "shuffle_block_rows": 64}
    train = client.wait(client.submit("train", cfg)["id"])
    assert train["state"] == "succeeded", train["error"]

    # the model artifact: one tar of the model directory, loadable with plain PyTorch
    archive = tarfile.open(fileobj=io.BytesIO(client.model(train["id"])))
    names = sorted(archive.getnames())
    prefix = f"model-{train['id']}"
    assert f"{prefix}/manifest.json" in names and f"{prefix}/model.pt2" in names
    archive.extractall(tmp_path / "dl", filter="data")
    model = load_model(tmp_path / "dl" / prefix)  # checks every file's SHA-256
    want = expected(None, ints, cats, cap=30)
    batch = Batch.from_rows(Rows(want["dense"], want["sparse"], np.zeros(250, np.float32)))
    with torch.no_grad():
        ref = model(batch.dense, batch.sparse).numpy()

    # bad score jobs: 422 naming the field
    for config, field in [
        ({"model_job": "0123456789abcdef", "inputs": ["new.tsv"]}, "config.model_job"),
        ({"model_job": train["id"], "inputs": ["../raw/day_0.tsv"]}, "config.inputs.0"),
        ({"model_job": train["id"], "inputs": ["new.tsv", "nope.tsv"]}, "config.inputs.1"),
    ]:
        with pytest.raises(ApiError) as err:
            client.submit("bad", config, kind="score")
        assert err.value.status_code == 422 and err.value.detail[0]["field"] == field

    job = client.submit("score", {"model_job": train["id"], "inputs": ["new.tsv"]}, kind="score")
    assert job["kind"] == "score" and job["max_retries"] == 0  # train jobs: 1 (issue 27)
    assert train["max_retries"] == 1
    done = client.wait(job["id"])
    assert done["state"] == "succeeded", done["error"]
    assert done["progress"]["rows"] == 250 and done["progress"]["fraction"] == 1.0
    # its log holds whole plain progress lines, no carriage-return redraws (issue 27 item 4)
    log = (tmp_path / "data" / "jobs" / job["id"] / "train.log").read_text()
    assert "\r" not in log and "score 100% 250 rows, " in log, log
    result = client.result(job["id"])
    assert result["rows"] == 250 and 0 <= result["metrics"]["auc"] <= 1
    # the job's progress (the dashboard's tiles) carries the labelled rows' AUC and logloss
    assert done["progress"]["auc"] == pytest.approx(result["metrics"]["auc"])
    assert done["progress"]["logloss"] == pytest.approx(result["metrics"]["logloss"])
    listed = {a["path"] for a in client.artifacts(job["id"])["data"]}
    assert {"predictions.csv", "predictions.csv.metrics.json", "result.json"} <= listed
    table = pcsv.read_csv(io.BytesIO(client.download(job["id"], "predictions.csv"))).to_pydict()
    assert table["line"] == list(range(1, 251)) and table["label"] == labels.tolist()
    np.testing.assert_allclose(np.asarray(table["probability"], np.float32), ref, rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    assert [j["id"] for j in client.jobs(kind="score")["data"]] == [job["id"]]
    with pytest.raises(ApiError) as err:
        client.model(job["id"])  # a score job has no model
    assert err.value.status_code == 404

    # a link in a directory input, pointing out of the data root (issue 24 case 4): the submit
    # check passes (the directory is inside), the job refuses the link when it runs, names the
    # file relative to the data directory and echoes nothing of the linked file
    secret = tmp_path / "outside" / "secret.tsv"
    secret.parent.mkdir()
    secret.write_bytes(b"SECRET-0123456789\tTOKEN-abcdef\n")
    (data_root / "inputs").mkdir()
    (data_root / "inputs" / "day_0.tsv").write_bytes(format_criteo_text(labels, ints, cats))
    (data_root / "inputs" / "leak.tsv").symlink_to(secret)
    linked = client.submit("linked", {"model_job": train["id"], "inputs": ["inputs"]},
                           kind="score")  # fmt: skip
    failed = client.wait(linked["id"])
    assert failed["state"] == "failed" and failed["attempt"] == 1, failed
    assert "data/inputs/leak.tsv: a symlink" in failed["error"], failed["error"]
    logs = client.logs(linked["id"], tail=1000)
    assert "error: data/inputs/leak.tsv: a symlink" in logs, logs
    for shown in (failed["error"], logs):
        assert "SECRET" not in shown and "TOKEN" not in shown and str(tmp_path) not in shown
    # every log view shows the service's paths relative to the data directory
    raw = (tmp_path / "data" / "jobs" / job["id"] / "train.log").read_bytes()
    assert str(tmp_path).encode() in raw  # "scored 250 rows ... -> /abs/.../predictions.csv"
    whole = client.http.get(f"{API}/jobs/{job['id']}/logs", params={"offset": 0})
    assert int(whole.headers["X-Log-Offset"]) == len(raw)
    assert whole.content == raw.replace(f"{tmp_path}/data/jobs/".encode(), b"jobs/")
    assert f"-> jobs/{job['id']}/run/predictions.csv" in client.logs(job["id"])
    assert not (tmp_path / "data" / "jobs" / linked["id"] / "run" / "predictions.csv").exists()
