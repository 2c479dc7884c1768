"""Multi-hot models (``data.multi_hot_sizes``) through export, ScoringModel, ONNX and score.

* A synthetic multi-hot run, trained 3 steps and exported: ScoringModel on the trainer's own
  ``B x L`` eval rows gives the trainer's eval probabilities (float32 rounding), the
  ``torch.export`` program and ONNX Runtime on ``model.onnx`` give ScoringModel's.
* A multi-hot model of Criteo one-hot days (ids synthesized by MLPerf's lookup tables as they
  were read): ``dlrm-vrgd score`` on raw rows, on the one-hot days and on the same days
  materialized as MLPerf's ``day_N_sparse_multi_hot.npz`` gives the trainer's probabilities of
  the rows made multi-hot here by the synthesis.
* Bad input: npz days of other bag sizes, a model directory whose ``features.json`` sizes
  disagree with ``model.json``, ids of the wrong width; a materialized-ids model refuses raw
  rows. One-hot models are covered, unchanged, by the other tests of this directory.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.csv as pcsv
import pytest
import torch

from dlrm_vrgd.config import parse_config
from dlrm_vrgd.data.batch import Batch
from dlrm_vrgd.data.criteo.format import format_criteo_text
from dlrm_vrgd.data.criteo.npz import multi_hot_file, write_multi_hot
from dlrm_vrgd.data.criteo.preprocess import preprocess
from dlrm_vrgd.data.multihot import BagLayout, MultiHotTables
from dlrm_vrgd.data.rows import Rows
from dlrm_vrgd.serve.export import export_model
from dlrm_vrgd.serve.features import FeatureError, FeatureLayout
from dlrm_vrgd.serve.model import ModelError, load_model, load_program, load_scoring
from dlrm_vrgd.serve.onnx import OnnxScorer
from dlrm_vrgd.train.loop import Trainer

from ..conftest import TINY_CARDINALITIES, tiny_config, tiny_config_dict
from ..data.criteo.test_criteo import expected, make_rows
from .test_export import EVAL_ROWS, eval_probs, train_and_save

TOL = {"rtol": 1e-5, "atol": 1e-6}
SIZES = [3, 1, 2, 5, 4, 2][: len(TINY_CARDINALITIES)]
CAP, READ_CAP = 50, 40
CRITEO_SIZES = [(k % 4) + 1 for k in range(26)]  # 1..4, 65 ids a row


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dlrm_vrgd.cli", *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def rehash(model_dir: Path, name: str) -> None:
    """Make the manifest list ``name`` as it now is (an edit the hashes do not catch)."""
    path = model_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    data = (model_dir / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    path.write_text(json.dumps(manifest))


def row_major(sparse: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """A batch's multi-hot ids as ``B x L`` rows, bags side by side: as they are, or from the
    trainer's table-order KJT values (table k's ``B x s_k`` block after table k-1's)."""
    width = sum(sizes)
    if sparse.dim() == 2:
        assert sparse.shape[1] == width
        return sparse
    rows = sparse.numel() // width
    blocks = sparse.split([rows * s for s in sizes])
    return torch.cat([b.view(rows, s) for b, s in zip(blocks, sizes, strict=True)], dim=1)


# ------------------------------------------------------------------- synthetic multi-hot
@pytest.fixture(scope="module", params=["dlrm", "dlrm_dcn"])
def synthetic(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp(f"mh-{request.param}")
    cfg = tiny_config(
        f"model.arch={request.param}",
        "optim.sparse.name=gsnr_rowwise_adagrad",
        f"data.multi_hot_sizes={json.dumps(SIZES)}",
    )
    trainer = train_and_save(cfg, tmp / "run")
    want, batches = eval_probs(trainer)
    export_model(tmp / "run", tmp / "model", onnx=True)
    dense = torch.cat([eb.batch.dense for eb in batches])
    sparse = torch.cat([row_major(eb.batch.sparse, SIZES) for eb in batches])
    return {"model": tmp / "model", "want": want, "dense": dense, "sparse": sparse}


def test_export_of_a_multi_hot_run_gives_the_trainers_probabilities(synthetic: dict) -> None:
    dense, sparse, want = synthetic["dense"], synthetic["sparse"], synthetic["want"]
    assert sparse.shape == (EVAL_ROWS, sum(SIZES))  # the trainer's rows: bags side by side
    model_dir = synthetic["model"]
    arch = json.loads((model_dir / "model.json").read_text())
    features = json.loads((model_dir / "features.json").read_text())
    assert arch["bag_sizes"] == SIZES
    assert features["multi_hot_sizes"] == SIZES
    assert features["multi_hot_synthesis"] == "mlperf-uniform"
    assert features["multi_hot_seed"] == 0
    model = load_model(model_dir)
    with torch.no_grad():
        got = model(dense, sparse)
    torch.testing.assert_close(got, want)
    # the torch.export program equals the eager module, at any batch size
    program = load_program(model_dir).module()
    torch.testing.assert_close(program(dense, sparse), got)
    torch.testing.assert_close(program(dense[:1], sparse[:1]), got[:1])
    # one id a table is not a multi-hot row: refused, naming the sizes
    with pytest.raises(ValueError, match=r"takes 17 ids a row \(bag sizes \[3, 1, 2, 5, 4, 2\]"):
        model(dense, sparse[:, : len(SIZES)])


def test_onnx_of_a_multi_hot_model_matches_scoring_model(synthetic: dict) -> None:
    dense, sparse = synthetic["dense"], synthetic["sparse"]
    with torch.no_grad():
        eager = load_model(synthetic["model"])(dense, sparse)
    scorer = OnnxScorer(synthetic["model"], batch_rows=128)
    got = scorer(dense.numpy(), sparse.numpy())
    torch.testing.assert_close(torch.from_numpy(got), eager, **TOL)
    torch.testing.assert_close(torch.from_numpy(got), synthetic["want"], **TOL)
    # the Triton config takes the B x L ids
    pbtxt = next((synthetic["model"] / "model_repository").glob("*/config.pbtxt")).read_text()
    assert f'name: "sparse" data_type: TYPE_INT64 dims: [ {sum(SIZES)} ]' in pbtxt


def test_a_model_dir_whose_sizes_disagree_is_refused(synthetic: dict, tmp_path: Path) -> None:
    bad = tmp_path / "model"
    shutil.copytree(synthetic["model"], bad)
    features = json.loads((bad / "features.json").read_text())
    features["multi_hot_sizes"] = [1] * len(SIZES)
    (bad / "features.json").write_text(json.dumps(features))
    rehash(bad, "features.json")
    with pytest.raises(ModelError, match=r"features\.json: multi_hot_sizes differ from model"):
        load_scoring(bad)
    shutil.rmtree(bad)
    shutil.copytree(synthetic["model"], bad)
    arch = json.loads((bad / "model.json").read_text())
    arch["bag_sizes"] = arch["bag_sizes"][:-1]
    (bad / "model.json").write_text(json.dumps(arch))
    rehash(bad, "model.json")
    with pytest.raises(ModelError, match=r"model\.json: bag_sizes is not one size"):
        load_scoring(bad)


# ------------------------------------------------------------------- Criteo multi-hot
class CriteoMultiHot:
    """A multi-hot model trained on one-hot preprocessed days (synthesized as read)."""

    def __init__(self, root: Path) -> None:
        raw = root / "raw"
        raw.mkdir(parents=True)
        for i, seed in enumerate((31, 32, 33)):
            (raw / f"day_{i}.tsv").write_bytes(format_criteo_text(*make_rows(400, seed)))
        self.data = root / "criteo"
        preprocess([raw], self.data, max_rows_per_table=CAP, progress=False)
        cfg = tiny_config_dict(run={"steps": 3, "global_batch": 128, "micro_batch": 64})
        cfg["data"] = {"source": "criteo", "path": str(self.data), "shuffle_block_rows": 128,
                       "max_rows_per_table": READ_CAP, "multi_hot_sizes": CRITEO_SIZES}  # fmt: skip
        self.cfg = parse_config(cfg)
        self.trainer = Trainer(self.cfg)
        for _ in range(3):
            self.trainer.train_step()
        self.trainer.save_checkpoint(root / "run")
        self.model = root / "model"
        export_model(root / "run", self.model, onnx=True)
        self.tables = MultiHotTables([READ_CAP] * 26, CRITEO_SIZES)

    def reference(self, ints: np.ma.MaskedArray, cats: np.ma.MaskedArray) -> np.ndarray:
        """The trainer's probabilities of raw rows: ids by the formulas (hex % 50 % 40), made
        multi-hot by MLPerf's synthesis over tables of 40 rows."""
        want = expected(None, ints, cats, cap=CAP)
        sparse = self.tables.expand(want["sparse"] % READ_CAP)
        rows = Rows(want["dense"], sparse, np.zeros(len(ints), np.float32),
                    bags=BagLayout(tuple(CRITEO_SIZES)))  # fmt: skip
        self.trainer.model.eval()
        with torch.no_grad():
            return torch.sigmoid(self.trainer.model(Batch.from_rows(rows))).numpy()


@pytest.fixture(scope="module")
def criteo(tmp_path_factory: pytest.TempPathFactory) -> CriteoMultiHot:
    return CriteoMultiHot(tmp_path_factory.mktemp("criteo-mh"))


def materialize(days: Path, out: Path, tables: MultiHotTables, sizes: list[int]) -> None:
    """``days`` (one-hot, preprocessed) with each day's ids as MLPerf's multi-hot npz: the
    synthesis over ids capped as the model's run read them (caps are then identities)."""
    shutil.copytree(days, out)
    manifest = json.loads((out / "manifest.json").read_text())
    for rec in manifest["days"]:
        onehot = out / rec["files"]["sparse"]["file"]
        ids = np.load(onehot) % READ_CAP
        name = multi_hot_file(rec["day"])

        def bags(k: int, a: int, b: int, ids: np.ndarray = ids) -> np.ndarray:
            return tables.bag(k, ids[a:b, k])[:, : sizes[k]]

        write_multi_hot(out / name, len(ids), sizes, bags)
        onehot.unlink()
        del rec["files"]["sparse"]
        rec["files"]["sparse_multi_hot"] = {
            "file": name, "bytes": (out / name).stat().st_size, "sha256": None, "sizes": sizes,
        }  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(manifest))


def test_score_raw_rows_one_hot_days_and_npz_days_of_a_multi_hot_model(
    criteo: CriteoMultiHot, tmp_path: Path
) -> None:
    features = json.loads((criteo.model / "features.json").read_text())
    assert features["multi_hot_sizes"] == CRITEO_SIZES
    assert features["multi_hot_synthesis"] == "mlperf-uniform"
    labels, ints, cats = make_rows(300, 51)
    raw = tmp_path / "new.tsv"
    raw.write_bytes(format_criteo_text(labels, ints, cats))
    want = criteo.reference(ints, cats)

    def scored(*inputs: Path, engine: str = "auto") -> np.ndarray:
        out = tmp_path / f"p-{len(list(tmp_path.glob('p-*')))}.csv"
        args = [a for i in inputs for a in ("--input", str(i))]
        proc = cli("score", "--model", str(criteo.model), "--out", str(out), "--no-progress",
                   "--engine", engine, *args)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return np.asarray(pcsv.read_csv(out).to_pydict()["probability"], np.float32)

    for engine in ("torch", "onnxruntime"):
        np.testing.assert_allclose(scored(raw, engine=engine), want, rtol=1e-5, atol=1e-6)
    days = tmp_path / "days"
    preprocess([raw], days, max_rows_per_table=CAP, progress=False)
    np.testing.assert_allclose(scored(days, engine="torch"), want, rtol=0, atol=1e-6)
    npz = tmp_path / "npz"
    materialize(days, npz, criteo.tables, CRITEO_SIZES)
    np.testing.assert_allclose(scored(npz, engine="torch"), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(scored(npz), want, rtol=1e-5, atol=1e-6)  # onnxruntime

    # npz days of other bag sizes: exit 2, naming the file and both sizes
    wrong = tmp_path / "wrong"
    other = [1] * 26
    materialize(days, wrong, criteo.tables, other)
    proc = cli("score", "--model", str(criteo.model), "--input", str(wrong),
               "--out", str(tmp_path / "w.csv"), "--no-progress")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "day_0_sparse_multi_hot.npz: bag sizes [1, 1," in proc.stderr
    assert "multi_hot_sizes) are [1, 2, 3, 4," in proc.stderr and "Traceback" not in proc.stderr


def test_a_model_of_materialized_ids_refuses_one_hot_rows(criteo: CriteoMultiHot) -> None:
    layout = FeatureLayout("criteo", 13, [READ_CAP] * 26, multi_hot_sizes=CRITEO_SIZES)
    assert not layout.raw_rows and not layout.one_hot_rows
    from dlrm_vrgd.serve.features import FeatureMapper

    with pytest.raises(FeatureError, match="materialized multi-hot ids"):
        FeatureMapper(layout).model_ids(np.zeros((2, 26), np.int64))
