"""Checkpoints: resume continues exactly; corrupt checkpoints are detected, never loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlrm_vrgd import checkpoint as ckpt
from dlrm_vrgd.checkpoint.load import _state_problem
from dlrm_vrgd.config import TrainConfig
from dlrm_vrgd.rundir import read_jsonl
from dlrm_vrgd.train.run import Callback, train

from ..conftest import tiny_config

ARGS = (
    "run.steps=7",
    "run.checkpoint_every=3",
    "run.eval_every=2",
    "optim.schedule.decay=cosine",
    "optim.schedule.warmup_steps=2",
    "run.keep_best_checkpoint=false",  # exact checkpoint sets below (see test_best_checkpoint)
)


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step(self, record: dict) -> None:
        if record["step"] == self.step:
            raise RuntimeError("simulated crash")


def train_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"}


def crashed_and_resumed(cfg: TrainConfig, tmp_path: Path) -> None:
    """``cfg`` trained whole (``tmp_path/whole``), and again crashed at step 3 and resumed from
    its step-2 checkpoint (``tmp_path/crashed``): the resumed steps' losses and the test
    metrics are the uninterrupted run's, exactly."""
    whole = train(cfg, tmp_path / "whole")
    with pytest.raises(RuntimeError):
        train(cfg, tmp_path / "crashed", callbacks=[CrashAt(3)])
    resumed = train(cfg, tmp_path / "crashed", resume=True)
    assert resumed.losses == whole.losses[2:]
    assert resumed.test == whole.test


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    cfg = tiny_config(*ARGS)
    whole = train(cfg, tmp_path / "whole")
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(cfg, tmp_path / "crashed", callbacks=[CrashAt(5)])
    assert not (tmp_path / "crashed" / "result.json").exists()
    status = json.loads((tmp_path / "crashed" / "status.json").read_text())
    assert status == {"state": "failed", "step": 5, "error": "RuntimeError: simulated crash"}
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "crashed")] == ["step_00000003"]
    resumed = train(cfg, tmp_path / "crashed", resume=True)

    assert resumed.losses == whole.losses[3:]  # steps 4..7, bit for bit
    assert not (tmp_path / "crashed" / "status.json").exists()
    start = read_jsonl(tmp_path / "crashed" / "metrics.jsonl")[0]
    assert start["kind"] == "start" and start["total_steps"] == 7
    assert train_losses(tmp_path / "crashed") == train_losses(tmp_path / "whole")
    steps = [r["step"] for r in read_jsonl(tmp_path / "crashed" / "metrics.jsonl")]
    assert steps == sorted(steps), "records of the crashed attempt after step 3 were dropped"
    assert resumed.test == whole.test
    result = json.loads((tmp_path / "crashed" / "result.json").read_text())
    assert result["steps"] == 7 and result["test"]["auc"] == whole.test["auc"]


def test_checkpoints_are_complete_and_pruned(tmp_path: Path) -> None:
    train(tiny_config(*ARGS, "run.keep_checkpoints=2"), tmp_path)
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step_00000006", "step_00000007"]  # 3 pruned; final step always saved
    manifest = ckpt.read_manifest(tmp_path / "checkpoints" / "step_00000007")
    assert manifest["step"] == 7 and manifest["world_size"] == 1
    assert manifest["config"]["run"]["steps"] == 7
    state = ckpt.load_rank_state(tmp_path / "checkpoints" / "step_00000007", 0)
    assert state["step"] == 7 and {"dense", "tables", "dense_opt", "sparse_opt"} <= set(state)
    assert not list((tmp_path / "checkpoints").glob(".staging*"))


def test_truncated_checkpoint_is_detected(tmp_path: Path) -> None:
    cfg = tiny_config("run.steps=3", "run.checkpoint_every=3")
    train(cfg, tmp_path)
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest is not None
    path = latest / "rank0.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointError, match="truncated"):
        ckpt.load_rank_state(latest, 0)
    (tmp_path / "result.json").unlink()  # as if it crashed after its last checkpoint
    with pytest.raises(ckpt.CheckpointError):
        train(cfg.model_copy(), tmp_path, resume=True)


def test_altered_checkpoint_is_detected(tmp_path: Path) -> None:
    train(tiny_config("run.steps=2", "run.checkpoint_every=2"), tmp_path)
    path = ckpt.latest_checkpoint(tmp_path) / "rank0.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="checksum"):
        ckpt.load_rank_state(path.parent, 0)


def test_missing_manifest_means_incomplete(tmp_path: Path) -> None:
    d = tmp_path / "checkpoints" / "step_00000001"
    d.mkdir(parents=True)
    with pytest.raises(ckpt.CheckpointError, match="incomplete"):
        ckpt.load_rank_state(d, 0)


def test_resume_refuses_a_different_model(tmp_path: Path) -> None:
    train(tiny_config("run.steps=2", "run.checkpoint_every=2"), tmp_path)
    with pytest.raises(ValueError, match="optim.dense.lr"):
        train(tiny_config("run.steps=4", "optim.dense.lr=0.5"), tmp_path, resume=True)
    # how long to train may change
    result = train(tiny_config("run.steps=4", "run.checkpoint_every=2"), tmp_path, resume=True)
    assert result.steps == 4 and len(result.losses) == 2


def test_existing_run_is_not_overwritten(tmp_path: Path) -> None:
    train(tiny_config("run.steps=1"), tmp_path)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(FileExistsError, match="--resume"):
        train(tiny_config("run.steps=1"), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_resume_with_vr_optimizer_equals_uninterrupted(tmp_path: Path) -> None:
    cfg = tiny_config(
        "run.steps=5",
        "run.checkpoint_every=2",
        "optim.dense.name=vradam",
        "optim.dense.gamma=0.2",
        "optim.dense.gsnr_placement=update",
    )
    whole = train(cfg, tmp_path / "whole")
    with pytest.raises(RuntimeError):
        train(cfg, tmp_path / "crashed", callbacks=[CrashAt(3)])
    resumed = train(cfg, tmp_path / "crashed", resume=True)
    assert resumed.losses == whole.losses[2:]
    gsnr = read_jsonl(tmp_path / "crashed" / "gsnr.jsonl")
    assert [r["step"] for r in gsnr] == [1, 2, 3, 4, 5]
    assert gsnr[-1]["dense"][0]["name"].startswith("dlrm.")
    # the realised step ratio is recorded; under `update` every element moves by p̂ ∈ [γ, 1]
    for entry in gsnr[-1]["dense"]:
        assert 0.2 - 1e-4 <= entry["step_ratio_p10"] <= entry["step_ratio_mean"] <= 1 + 1e-4
        assert 0.2 - 1e-4 <= entry["scale"] <= 1 + 1e-4


def test_resume_with_gsnr_sparse_ema_equals_uninterrupted(tmp_path: Path) -> None:
    cfg = tiny_config(
        "run.steps=5",
        "run.checkpoint_every=2",
        "optim.sparse.name=gsnr_rowwise_adagrad",
        "optim.sparse.estimator=ema",
        "optim.sparse.gamma=0.2",
    )
    crashed_and_resumed(cfg, tmp_path)
    tables = read_jsonl(tmp_path / "crashed" / "gsnr.jsonl")[-1]["tables"]
    assert {"touched_rows", "multi_group_rows", "ratio", "frac_clipped", "raw_gsnr"} <= set(
        tables[0]
    )
    assert tables[0]["placement"] == "update"  # the default: each row moves by r_row x its step
    assert tables[0]["step_ratio_mean"] == pytest.approx(tables[0]["ratio"], rel=1e-4)
    result = json.loads((tmp_path / "crashed" / "result.json").read_text())
    assert result["optimizers"]["sparse_gsnr_estimator"] == "ema"
    assert result["optimizers"]["sparse_gsnr_placement"] == "update"


def test_resume_with_cowclip_equals_uninterrupted(tmp_path: Path) -> None:
    cfg = tiny_config(
        "run.steps=5",
        "run.checkpoint_every=2",
        "optim.sparse.name=cowclip_rowwise_adagrad",
        "optim.sparse.clip_ratio=0.05",
        "optim.sparse.weight_decay=0.01",
    )
    crashed_and_resumed(cfg, tmp_path)
    result = json.loads((tmp_path / "crashed" / "result.json").read_text())
    assert result["optimizers"]["sparse_cowclip"]["clip_ratio"] == 0.05


def test_resume_at_the_last_step_evaluates_once(tmp_path: Path) -> None:
    """A run that crashed after its last checkpoint, in its final evals: resumed, it runs
    them again and keeps one val and one test record, not the earlier attempt's too."""
    cfg = tiny_config("run.steps=4", "run.checkpoint_every=4")
    first = train(cfg, tmp_path)
    (tmp_path / "result.json").unlink()
    again = train(cfg, tmp_path, resume=True)
    evals = [
        (r["split"], r["step"])
        for r in read_jsonl(tmp_path / "metrics.jsonl")
        if r["kind"] == "eval"
    ]
    assert evals == [("val", 4), ("test", 4)]
    assert again.test == first.test and not again.already_finished
    assert json.loads((tmp_path / "result.json").read_text())["steps"] == 4


@pytest.mark.parametrize("name", ["adagrad", "gsnr_adagrad"])
def test_resume_with_elementwise_adagrad_equals_uninterrupted(tmp_path: Path, name: str) -> None:
    """``optim.sparse.name: adagrad`` (FBGEMM's EXACT_ADAGRAD) and its GSNR form: the checkpoint
    carries one Adagrad sum per weight element, and a resumed run continues bit for bit."""
    cfg = tiny_config(
        "run.steps=5",
        "run.checkpoint_every=2",
        f"optim.sparse.name={name}",
        "optim.sparse.gamma=0.2",
    )
    crashed_and_resumed(cfg, tmp_path)
    last = [ckpt.list_checkpoints(tmp_path / d)[-1] for d in ("whole", "crashed")]
    a, b = (ckpt.load_rank_state(p, 0) for p in last)
    for ta, tb in zip(a["tables"], b["tables"], strict=True):
        for w, s, wb, sb in zip(
            ta["weights"], ta["states"], tb["weights"], tb["states"], strict=True
        ):
            assert s.shape == w.shape  # element-wise: rows x dim
            assert bool((s > 0).any())
            assert torch.equal(w, wb) and torch.equal(s, sb)
    # a state that is not the weights' shape (here transposed) is refused when loaded
    manifest = ckpt.read_manifest(last[0])
    assert _state_problem(a, manifest) is None
    a["tables"][0]["states"][1] = a["tables"][0]["states"][1].t().contiguous()
    assert "optimizer state of shape" in str(_state_problem(a, manifest))
