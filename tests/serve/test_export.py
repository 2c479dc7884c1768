"""Export: a model directory from 1-rank and 2-rank (sharded) checkpoints of both backends gives
the trainer's own eval probabilities; the torch.export program gives the eager ones; damaged
checkpoints are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlrm_vrgd.config import TrainConfig
from dlrm_vrgd.serve.export import ExportError, export_model
from dlrm_vrgd.serve.model import ModelError, load_model, load_program
from dlrm_vrgd.train.distributed import DistEnv
from dlrm_vrgd.train.evaluate import rank_share
from dlrm_vrgd.train.loop import Trainer

from ..conftest import fill_disk, tiny_config
from ..dist_utils import run_ranks

EVAL_ROWS = 300


def eval_probs(trainer: Trainer) -> tuple[torch.Tensor, list[Any]]:
    """The trainer's eval path (rank_share + sigmoid of its model) on this rank's share of the
    first EVAL_ROWS test rows: probabilities, and the batches."""
    batches = rank_share(trainer.splits.test, 128, trainer.env, EVAL_ROWS)
    trainer.model.eval()
    with torch.no_grad():
        probs = [torch.sigmoid(trainer.model(eb.batch)) for eb in batches]
    return torch.cat(probs), batches


def train_and_save(cfg: TrainConfig, run: Path, env: DistEnv | None = None) -> Trainer:
    trainer = Trainer(cfg, env=env)
    for _ in range(3):
        trainer.train_step()
    trainer.save_checkpoint(run)
    return trainer


def exported_probs(model_dir: Path, trainer_batches: list[Any]) -> torch.Tensor:
    model = load_model(model_dir)
    with torch.no_grad():
        return torch.cat([model(eb.batch.dense, eb.batch.sparse) for eb in trainer_batches])


@pytest.mark.parametrize(
    "overrides",
    [
        ("model.embedding_backend=fbgemm",),
        ("model.embedding_backend=torch",),
        ("model.embedding_backend=fbgemm", "model.arch=dlrm_dcn"),
        ("model.embedding_backend=torch", "model.arch=dlrm_dcn"),
    ],
    ids=["fbgemm", "torch", "fbgemm-dcn", "torch-dcn"],
)
def test_one_rank_export_gives_the_trainers_probabilities(
    tmp_path: Path, overrides: tuple[str, ...]
) -> None:
    cfg = tiny_config(*overrides, "optim.sparse.name=gsnr_rowwise_adagrad")
    trainer = train_and_save(cfg, tmp_path / "run")
    want, batches = eval_probs(trainer)
    result = export_model(tmp_path / "run", tmp_path / "model")
    assert result.step == 3 and result.world_size == 1
    got = exported_probs(tmp_path / "model", batches)
    assert got.shape == (EVAL_ROWS,)
    torch.testing.assert_close(got, want)
    # the weights were trained (not the initial ones): a fresh trainer scores differently
    fresh, _ = eval_probs(Trainer(cfg))
    assert not torch.allclose(fresh, want)

    # the torch.export program equals the eager module, at any batch size
    program = load_program(tmp_path / "model").module()
    dense = torch.cat([eb.batch.dense for eb in batches])
    sparse = torch.cat([eb.batch.sparse for eb in batches])
    torch.testing.assert_close(program(dense, sparse), got)
    torch.testing.assert_close(program(dense[:1], sparse[:1]), got[:1])

    manifest = json.loads((tmp_path / "model" / "manifest.json").read_text())
    assert set(manifest["files"]) == {
        "config.json", "features.json", "model.json", "weights.pt", "model.pt2",
    }  # fmt: skip
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values())


def _two_rank_run(rank: int, world: int, cfg_dict: dict[str, Any], run: str) -> torch.Tensor:
    from dlrm_vrgd.config import parse_config

    cfg = parse_config(cfg_dict)
    trainer = train_and_save(cfg, Path(run), DistEnv(rank=rank, world_size=world, local_rank=rank))
    probs, batches = eval_probs(trainer)
    valid = torch.cat([eb.valid for eb in batches])
    return probs[valid]


@pytest.mark.parametrize(
    "sharding", ["table_wise", pytest.param("column_wise", marks=pytest.mark.slow)]
)
def test_two_rank_sharded_export_gives_the_trainers_probabilities(
    tmp_path: Path, sharding: str
) -> None:
    # torchrec splits columns in slices of at least 128 (MIN_CW_DIM): dim 256 gives two
    dim = (
        ("model.embedding_dim=256", "model.dense_arch=[16,256]")
        if sharding == "column_wise"
        else ()
    )
    cfg = tiny_config(
        "run.nproc_per_node=2", f"run.sharding=[{sharding}]", "run.micro_batch=32",
        "optim.sparse.name=gsnr_rowwise_adagrad", "optim.sparse.estimator=ema", *dim,
    )  # fmt: skip
    run = tmp_path / "run"
    parts = run_ranks(_two_rank_run, 2, tmp_path / "ranks", cfg.to_dict(), str(run))
    want = torch.cat(parts)  # rank shares in order: the first EVAL_ROWS test rows
    assert want.shape == (EVAL_ROWS,)
    states = [torch.load(p, weights_only=True) for p in sorted(run.glob("checkpoints/*/rank*"))]
    labels = [n for s in states for t in s["tables"] for n in t["names"]]
    if sharding == "column_wise":  # the tables really are split between the ranks
        assert any("cols 128+128" in n for n in labels), labels
    result = export_model(run, tmp_path / "model")
    assert result.world_size == 2
    cfg1 = tiny_config()
    batches = rank_share(Trainer(cfg1).splits.test, 128, DistEnv(), EVAL_ROWS)
    torch.testing.assert_close(exported_probs(tmp_path / "model", batches), want)


def test_export_refuses_truncated_or_tampered_checkpoints(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_and_save(tiny_config(), run)
    (ckpt,) = run.glob("checkpoints/step_*")
    rank0 = ckpt / "rank0.pt"
    data = rank0.read_bytes()
    rank0.write_bytes(data[:-100])
    with pytest.raises(ExportError, match=r"rank0\.pt: .* bytes, manifest says .*truncated"):
        export_model(run, tmp_path / "model")
    tampered = bytearray(data)
    tampered[len(data) // 2] ^= 0xFF
    rank0.write_bytes(bytes(tampered))
    with pytest.raises(ExportError, match=r"rank0\.pt: checksum mismatch"):
        export_model(run, tmp_path / "model")
    assert not (tmp_path / "model").exists()
    assert not list(tmp_path.glob(".model*"))  # nothing half-written
    # through the CLI: exit 2 and the message, no traceback
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "export", "--run", str(run), "--out",
         str(tmp_path / "model")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "checksum mismatch" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(ExportError, match="no checkpoint of step 7 \\(there are: 3\\)"):
        export_model(run, tmp_path / "model", step=7)


def test_loading_refuses_an_altered_model_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_and_save(tiny_config(), run)
    export_model(run, tmp_path / "model", program=False)
    load_model(tmp_path / "model")
    weights = tmp_path / "model" / "weights.pt"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="weights.pt: SHA-256 differs"):
        load_model(tmp_path / "model")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_model(run, tmp_path / "model")
    export_model(run, tmp_path / "model", overwrite=True, program=False)
    load_model(tmp_path / "model")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_overwrite_refuses_a_directory_that_is_not_a_model(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_and_save(tiny_config(), run)
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    proc = cli("export", "--run", str(run), "--out", str(precious), "--overwrite")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "refusing to replace" in proc.stderr and "not a model directory" in proc.stderr
    assert sorted(p.name for p in precious.iterdir()) == ["notes.txt"]
    assert (precious / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "run"]  # no staging left
    # a model directory is replaced, as before
    proc = cli("export", "--run", str(run), "--out", str(tmp_path / "model"), "--no-program")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = cli("export", "--run", str(run), "--out", str(tmp_path / "model"), "--overwrite",
               "--no-program")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    load_model(tmp_path / "model")


def test_a_full_disk_is_a_clear_error_and_nothing_is_half_written(
    tmp_path: Path, small_fs: Path
) -> None:
    """A 4 MiB tmpfs filled to 16 kB free; the weights (~70 kB) do not fit."""
    run = tmp_path / "run"
    train_and_save(tiny_config(model={"embedding_dim": 64, "dense_arch": [32, 64]}), run)
    fill_disk(small_fs, 16 << 10)
    proc = cli("export", "--run", str(run), "--out", str(small_fs / "model"))
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "No space left on device; nothing was written" in proc.stderr, proc.stderr[-2000:]
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]


def test_exported_criteo_model_scores_raw_counts_through_the_log_transform(
    tmp_path: Path,
) -> None:
    """A model trained on preprocessed Criteo rows, exported: both ways it scores raw rows —
    ``model_raw.pt2`` on raw integers, and ``dlrm-vrgd score`` on the rows as text — give the
    trainer's probabilities of features computed here, dense ``log(max(x, -3) + 5)``. A scorer
    that fed the raw counts (or ``x + 5``, no log) would be far off: the counts reach hundreds."""
    from dlrm_vrgd.data.criteo.format import format_criteo_text

    from ..data.criteo.test_criteo import make_rows
    from .test_score import Trained, read_csv

    t = Trained(tmp_path / "criteo")
    _, ints, cats = make_rows(300, 46)
    assert int(ints.max()) > 100  # raw counts far from their logs
    want = t.reference(ints, cats)
    program = load_program(t.model, raw=True).module()
    got = program(
        torch.from_numpy(ints.filled(0).astype(np.int64)),
        torch.from_numpy(cats.filled(0).astype(np.int64)),
    )
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-5, atol=1e-6)

    text = tmp_path / "rows.tsv"
    text.write_bytes(format_criteo_text(None, ints, cats))
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "score", "--model", str(t.model),
         "--input", str(text), "--out", str(tmp_path / "p.csv"), "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    scored = np.asarray(read_csv(tmp_path / "p.csv")["probability"], np.float32)
    np.testing.assert_allclose(scored, want, rtol=1e-5, atol=1e-6)
    # and the transform matters to this model: the counts without the log score otherwise
    from dlrm_vrgd.data.batch import Batch
    from dlrm_vrgd.data.rows import Rows

    from ..data.criteo.test_criteo import expected

    sparse = expected(None, ints, cats, cap=50)["sparse"] % 40
    unlogged = (np.maximum(ints.filled(0), -3) + 5).astype(np.float32)
    with torch.no_grad():
        rows = Rows(unlogged, sparse, np.zeros(len(sparse), np.float32))
        skipped = torch.sigmoid(t.trainer.model(Batch.from_rows(rows))).numpy()
    assert np.abs(skipped - want).max() > 1e-3


def test_a_run_without_a_checkpoint_is_told_why_truthfully(tmp_path: Path) -> None:
    """No checkpoint: the message says the run has not finished (a finished run always leaves
    one), and what its status.json says when it stopped early; never that a finished run
    lacks one."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(ExportError) as err:
        export_model(run, tmp_path / "model")
    message = str(err.value)
    assert "has not finished" in message and "a finished run leaves" in message, message
    (run / "status.json").write_text(
        json.dumps({"state": "interrupted", "step": 7, "message": "interrupted (SIGINT)"})
    )
    with pytest.raises(ExportError, match=r"status\.json: interrupted at step 7"):
        export_model(run, tmp_path / "model")
    (run / "status.json").write_text("[" * 100_000)  # whatever the file holds: the same error
    with pytest.raises(ExportError, match="has not finished"):
        export_model(run, tmp_path / "model")


def test_the_export_message_counts_the_files_written_and_onnx_is_quiet(tmp_path: Path) -> None:
    """`export` says how many files it wrote (the manifest too) and their size on disk; the
    ONNX export prints no warnings about torchvision, which the model does not use."""
    run = tmp_path / "run"
    train_and_save(tiny_config(), run)
    for fmt in ("pt2", "onnx"):
        out = tmp_path / f"model-{fmt}"
        done = cli("export", "--run", str(run), "--out", str(out), "--format", fmt)
        assert done.returncode == 0, done.stderr
        files = [p for p in out.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        assert f"({len(files)} files, {size / 1e6:,.1f} MB)" in done.stdout, done.stdout
        assert "torchvision" not in done.stderr, done.stderr
