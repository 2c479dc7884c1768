"""Scoring: raw Criteo text (labelled, unlabelled 39-field, Kaggle CSV with Id, gzip) and
preprocessed days, against the trainer's own model on rows computed here from the formulas."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch

from dlrm_vrgd.config import parse_config
from dlrm_vrgd.data.batch import Batch
from dlrm_vrgd.data.criteo.format import MalformedRowError, format_criteo_text
from dlrm_vrgd.data.criteo.preprocess import preprocess
from dlrm_vrgd.data.rows import Rows
from dlrm_vrgd.metrics import binary_metrics
from dlrm_vrgd.serve.export import export_model
from dlrm_vrgd.serve.features import FeatureError
from dlrm_vrgd.serve.score import score
from dlrm_vrgd.serve.score.sinks import StreamingMetrics
from dlrm_vrgd.train.loop import Trainer

from ..conftest import tiny_config_dict
from ..data.criteo.test_criteo import expected, make_rows

CAP = 50


class Trained:
    """A model trained on preprocessed raw rows, its export, and the trainer for reference."""

    def __init__(self, root: Path, threshold: int = 0) -> None:
        self.root = root
        raw = root / "raw"
        raw.mkdir(parents=True)
        for i, seed in enumerate((31, 32, 33)):
            (raw / f"day_{i}.tsv").write_bytes(format_criteo_text(*make_rows(400, seed)))
        self.data = root / "criteo"
        preprocess([raw], self.data, max_rows_per_table=CAP, frequency_threshold=threshold,
                   progress=False)  # fmt: skip
        raw_cfg = tiny_config_dict(run={"steps": 3, "global_batch": 128, "micro_batch": 64})
        raw_cfg["data"] = {"source": "criteo", "path": str(self.data), "shuffle_block_rows": 128}
        if threshold == 0:
            raw_cfg["data"]["max_rows_per_table"] = 40  # read-time cap on top of preprocessing's
        self.cfg = parse_config(raw_cfg)
        self.trainer = Trainer(self.cfg)
        for _ in range(3):
            self.trainer.train_step()
        self.trainer.save_checkpoint(root / "run")
        self.model = root / "model"
        export_model(root / "run", self.model)

    def reference(self, ints: np.ma.MaskedArray, cats: np.ma.MaskedArray) -> np.ndarray:
        """The trainer's eval probabilities of rows given as raw values: dense and ids by the
        formulas (log(max(x, -3) + 5); hex % 50 % 40)."""
        want = expected(None, ints, cats, cap=CAP)
        rows = Rows(want["dense"], want["sparse"] % 40, np.zeros(len(ints), np.float32))
        self.trainer.model.eval()
        with torch.no_grad():
            return torch.sigmoid(self.trainer.model(Batch.from_rows(rows))).numpy()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    return Trained(tmp_path_factory.mktemp("score"))


def read_csv(path: Path) -> dict[str, list]:
    return pcsv.read_csv(path).to_pydict()


def test_raw_tsv_scores_equal_the_trainer_and_preprocess_then_days(
    trained: Trained, tmp_path: Path
) -> None:
    labels, ints, cats = make_rows(700, 41)
    raw = tmp_path / "new.tsv"
    raw.write_bytes(format_criteo_text(labels, ints, cats))
    res = score(trained.model, [raw], tmp_path / "raw.csv", block_bytes=1 << 14, progress=False)
    assert res.rows == 700 and res.bad_rows == 0
    out = read_csv(tmp_path / "raw.csv")
    assert list(out) == ["file", "line", "label", "probability"]
    assert out["line"] == list(range(1, 701)) and out["label"] == labels.tolist()
    probs = np.asarray(out["probability"], dtype=np.float32)
    np.testing.assert_allclose(probs, trained.reference(ints, cats), rtol=1e-5, atol=1e-6)

    days = tmp_path / "days"
    preprocess([raw], days, max_rows_per_table=CAP, progress=False)
    res_days = score(trained.model, [days], tmp_path / "days.parquet", progress=False)
    table = pq.read_table(tmp_path / "days.parquet").to_pydict()
    assert table["line"] == list(range(1, 701)) and table["label"] == labels.tolist()
    # Equal within float32 rounding, not bit for bit: the raw path scores each parsed block as
    # one forward pass and the day-file path scores batch_rows rows at a time, and the CPU's
    # matrix kernels choose their summation order by batch size (a fresh CI machine differed in
    # 1 of 700 probabilities by 1 ulp, 5.96e-8). 1e-6 is ~17 ulp at p = 0.5; a wrong row or a
    # wrong table mapping moves a probability by far more.
    np.testing.assert_allclose(
        np.asarray(table["probability"], np.float32), probs, rtol=0, atol=1e-6
    )

    # metrics: printed + written, equal to the in-memory metrics of the same predictions
    assert res.metrics_path is not None and res_days.metrics is not None
    written = json.loads(res.metrics_path.read_text())
    ref = binary_metrics(torch.from_numpy(probs), torch.from_numpy(labels.astype(np.float32)))
    for key in ("logloss", "ne", "calibration"):
        assert written[key] == pytest.approx(ref[key], rel=1e-6)
    assert written["auc"] == pytest.approx(ref["auc"], abs=1e-3)
    assert written["rows"] == 700 and res_days.metrics["auc"] == pytest.approx(written["auc"])


def test_unlabelled_39_field_file_and_kaggle_csv_with_id_in_order(
    trained: Trained, tmp_path: Path
) -> None:
    _, ints, cats = make_rows(300, 42)
    test_txt = tmp_path / "test.txt"
    test_txt.write_bytes(format_criteo_text(None, ints, cats))
    ids = np.arange(60_000_000, 60_000_300)[::-1]  # not in sorted order: order is the file's
    kaggle = tmp_path / "test.csv.gz"
    kaggle.write_bytes(
        gzip.compress(format_criteo_text(None, ints, cats, delimiter=",", header=True, ids=ids))
    )
    res = score(trained.model, [test_txt, kaggle], tmp_path / "p.csv", block_bytes=1 << 13,
                progress=False)  # fmt: skip
    assert res.rows == 600 and res.metrics is None and res.metrics_path is None
    out = read_csv(tmp_path / "p.csv")
    assert list(out) == ["file", "line", "Id", "probability"]
    assert out["file"] == [str(test_txt)] * 300 + [str(kaggle)] * 300
    assert out["line"] == list(range(1, 301)) + list(range(2, 302))  # the header is line 1
    assert out["Id"][:300] == [None] * 300
    assert [int(i) for i in out["Id"][300:]] == ids.tolist()
    ref = trained.reference(ints, cats)
    probs = np.asarray(out["probability"], dtype=np.float32)
    np.testing.assert_allclose(probs[:300], ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(probs[300:], ref, rtol=1e-5, atol=1e-6)


def test_bad_rows_name_file_and_line_or_are_skipped(trained: Trained, tmp_path: Path) -> None:
    labels, ints, cats = make_rows(50, 43)
    lines = format_criteo_text(labels, ints, cats).decode().splitlines(keepends=True)
    lines[30] = "1\tnot-a-number" + "\t" * 38 + "\n"
    lines.insert(10, "\n")  # blank lines are not rows and keep their number
    raw = tmp_path / "bad.tsv"
    raw.write_text("".join(lines))
    out = tmp_path / "p.csv"
    with pytest.raises(MalformedRowError, match=r"bad\.tsv:32: I1: not an integer"):
        score(trained.model, [raw], out, block_bytes=1 << 11, progress=False)
    assert not out.exists() and not list(tmp_path.glob(".p.csv*"))  # nothing half-written
    res = score(trained.model, [raw], out, skip_bad_rows=True, block_bytes=1 << 11,
                progress=False)  # fmt: skip
    assert res.rows == 49 and res.bad_rows == 1
    assert res.bad_row_examples[0]["line"] == 32
    got = read_csv(out)
    assert got["line"] == [n for n in range(1, 52) if n not in (11, 32)]
    keep = [i for i in range(50) if i != 30]  # row 30 (0-based) was replaced; on line 32
    ref = trained.reference(ints[keep], cats[keep])
    np.testing.assert_allclose(np.asarray(got["probability"], np.float32), ref, rtol=1e-5,
                               atol=1e-6)  # fmt: skip


def test_frequency_threshold_model_maps_raw_rows_like_preprocess(tmp_path: Path) -> None:
    t = Trained(tmp_path / "thr", threshold=3)
    raw = t.root / "raw"
    files = sorted(raw.iterdir())
    res = score(t.model, files, tmp_path / "raw.csv", progress=False)
    res_days = score(t.model, [t.data], tmp_path / "days.csv", progress=False)
    a, b = read_csv(tmp_path / "raw.csv"), read_csv(tmp_path / "days.csv")
    assert res.rows == res_days.rows == 1200
    np.testing.assert_array_equal(a["probability"], b["probability"])
    assert a["label"] == b["label"]
    # day files made with other rules are refused
    other = tmp_path / "other"
    preprocess([files[0]], other, max_rows_per_table=CAP, progress=False)
    with pytest.raises(FeatureError, match="frequency_threshold=0; the model's data used"):
        score(t.model, [other], tmp_path / "o.csv", progress=False)


def test_streaming_auc_matches_the_exact_one() -> None:
    rng = np.random.default_rng(5)
    probs = rng.random(50_000).astype(np.float32) ** 2
    labels = (rng.random(50_000) < probs).astype(np.int32)
    acc = StreamingMetrics()
    for a in range(0, 50_000, 7_000):
        acc.update(probs[a : a + 7_000], labels[a : a + 7_000])
    ref = binary_metrics(torch.from_numpy(probs), torch.from_numpy(labels.astype(np.float32)))
    got = acc.compute()
    assert got["auc"] == pytest.approx(ref["auc"], abs=2e-4)
    assert got["logloss"] == pytest.approx(ref["logloss"], rel=1e-9)
    assert got["calibration"] == pytest.approx(ref["calibration"], rel=1e-9)


def test_cli_scores_and_refuses_bad_input_with_exit_2(trained: Trained, tmp_path: Path) -> None:
    labels, ints, cats = make_rows(20, 44)
    raw = tmp_path / "a.tsv"
    raw.write_bytes(format_criteo_text(labels, ints, cats))
    cmd = [sys.executable, "-m", "dlrm_vrgd.cli", "score", "--model", str(trained.model),
           "--input", str(raw), "--out", str(tmp_path / "p.csv"), "--no-progress"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "scored 20 rows" in proc.stdout and "AUC" in proc.stdout
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    raw.write_text("x\ty\n")
    proc = subprocess.run([*cmd, "--overwrite"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "a.tsv:1:" in proc.stderr and "Traceback" not in proc.stderr


def test_splits_and_days_of_the_training_data_and_a_warning_for_training_days(
    trained: Trained, tmp_path: Path
) -> None:
    data = trained.data  # days 0, 1, 2 of 400 rows; the model trained on 0-1, val/test = day 2
    every = score(trained.model, [data], tmp_path / "all.csv", progress=False)
    assert every.rows == 1200
    assert every.training_days == [f"{data}/day_0", f"{data}/day_1"]
    whole = read_csv(tmp_path / "all.csv")
    rows = zip(whole["file"], whole["line"], whole["probability"], strict=True)
    by_row = {(f, n): p for f, n, p in rows}

    # the test split: the second half of day 2 (val_fraction 0.5), exactly the trainer's rows
    test = score(trained.model, [data], tmp_path / "test.csv", split="test", progress=False)
    assert test.rows == 200 and test.training_days == []
    out = read_csv(tmp_path / "test.csv")
    assert out["file"] == [f"{data}/day_2"] * 200 and out["line"] == list(range(201, 401))
    assert out["probability"] == [by_row[(f"{data}/day_2", n)] for n in range(201, 401)]
    src = trained.trainer.splits.test
    assert src.segments == [(2, 200, 400)]  # what the trainer tested on
    assert test.metrics is not None

    val = score(trained.model, [data], tmp_path / "val.csv", split="val", progress=False)
    assert val.rows == 200 and read_csv(tmp_path / "val.csv")["line"] == list(range(1, 201))

    one = score(trained.model, [data], tmp_path / "d1.csv", days=[1], progress=False)
    assert one.rows == 400 and one.training_days == [f"{data}/day_1"]

    with pytest.raises(FeatureError, match=r"--days 7: no such day \(it holds 0, 1, 2\)"):
        score(trained.model, [data], tmp_path / "d7.csv", days=[7], progress=False)
    with pytest.raises(ValueError, match="--days and --split"):
        score(trained.model, [data], tmp_path / "x.csv", days=[1], split="test", progress=False)
    assert not (tmp_path / "d7.csv").exists() and not (tmp_path / "x.csv").exists()

    # the CLI says so when it scores training days, and not for the test split
    cmd = [sys.executable, "-m", "dlrm_vrgd.cli", "score", "--model", str(trained.model),
           "--input", str(data), "--no-progress"]  # fmt: skip
    warned = subprocess.run(
        [*cmd, "--out", str(tmp_path / "c1.csv")], capture_output=True, text=True, timeout=120
    )
    assert warned.returncode == 0, warned.stderr
    assert f"warning: scored days the model trained on ({data}/day_0, {data}/day_1)" in (
        warned.stderr
    )
    quiet = subprocess.run(
        [*cmd, "--out", str(tmp_path / "c2.csv"), "--split", "test"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert quiet.returncode == 0 and "warning" not in quiet.stderr
    bad = subprocess.run(
        [*cmd, "--out", str(tmp_path / "c3.csv"), "--days", "1,x"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "--days '1,x': expected day numbers" in bad.stderr


def test_a_kaggle_submission_is_id_and_predicted_in_input_order(
    trained: Trained, tmp_path: Path
) -> None:
    _, ints, cats = make_rows(250, 43)
    ids = np.arange(60_000_000, 60_000_250)[::-1]
    kaggle = tmp_path / "test.csv"
    kaggle.write_bytes(format_criteo_text(None, ints, cats, delimiter=",", header=True, ids=ids))
    res = score(trained.model, [kaggle], tmp_path / "sub.csv", fmt="kaggle", progress=False)
    assert res.rows == 250
    lines = (tmp_path / "sub.csv").read_text().splitlines()
    assert lines[0] == '"Id","Predicted"'
    sub = read_csv(tmp_path / "sub.csv")
    assert list(sub) == ["Id", "Predicted"] and [int(i) for i in sub["Id"]] == ids.tolist()
    np.testing.assert_allclose(
        np.asarray(sub["Predicted"], np.float32), trained.reference(ints, cats), rtol=1e-5,
        atol=1e-6,
    )  # fmt: skip
    test_txt = tmp_path / "test.txt"  # no Id column: no submission
    test_txt.write_bytes(format_criteo_text(None, ints, cats))
    with pytest.raises(ValueError, match="every input must be a Kaggle CSV with an Id column"):
        score(trained.model, [test_txt], tmp_path / "no.csv", fmt="kaggle", progress=False)


def _raw_program_matches_score(t: Trained, tmp_path: Path, seed: int) -> None:
    """``model_raw.pt2`` on raw integers (missing -> 0, hex -> int) gives the probabilities
    ``score`` gives for the same rows as text."""
    _, ints, cats = make_rows(500, seed)
    text = tmp_path / f"rows{seed}.txt"
    text.write_bytes(format_criteo_text(None, ints, cats))
    score(t.model, [text], tmp_path / f"p{seed}.csv", progress=False)
    want = np.asarray(read_csv(tmp_path / f"p{seed}.csv")["probability"], np.float32)
    program = torch.export.load(str(t.model / "model_raw.pt2")).module()
    dense_raw = torch.from_numpy(ints.filled(0).astype(np.int64))
    ids_raw = torch.from_numpy(cats.filled(0).astype(np.int64))  # 32-bit hex ids fit int64
    got = program(dense_raw, ids_raw).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # batch sizes are dynamic: one row alone gives its probability
    np.testing.assert_allclose(
        program(dense_raw[:1], ids_raw[:1]).detach().numpy(), want[:1], rtol=1e-5
    )


def test_the_raw_program_holds_the_input_transform(trained: Trained, tmp_path: Path) -> None:
    manifest = json.loads((trained.model / "manifest.json").read_text())
    assert {"model.pt2", "model_raw.pt2"} <= set(manifest["files"])
    _raw_program_matches_score(trained, tmp_path, 44)


def test_the_raw_program_with_a_frequency_threshold_vocabulary(tmp_path: Path) -> None:
    t = Trained(tmp_path / "thr", threshold=3)
    _raw_program_matches_score(t, tmp_path, 45)
    # and the rows of the training files, whose ids are mostly kept ones
    from dlrm_vrgd.serve.featurizer import parse_raw_fields

    line = (t.root / "raw" / "day_0.tsv").read_text().splitlines()[0].split("\t")[1:]
    dense, ids = parse_raw_fields(line)
    score(t.model, [t.root / "raw" / "day_0.tsv"], tmp_path / "d0.csv", progress=False)
    first = read_csv(tmp_path / "d0.csv")["probability"][0]
    program = torch.export.load(str(t.model / "model_raw.pt2")).module()
    got = program(torch.tensor([dense]), torch.tensor([ids])).detach()
    assert float(got[0]) == pytest.approx(first, rel=1e-5)
    with pytest.raises(ValueError, match="field C3: not a hex id"):
        parse_raw_fields(line[:15] + ["zz"] + line[16:])
