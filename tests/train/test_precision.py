"""``run.precision``: bf16 autocast for the MLPs and the interaction, float32 master weights and
float32 (or wider) sums everywhere the optimizers add up gradients. On the CPU (bf16 autocast
runs there) a VRGD run in bf16 reaches the AUC of the same run in fp32, its GSNR ratios stay
close, and no statistic it writes is non-finite."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from dlrm_vrgd.config import load_config
from dlrm_vrgd.precision import configure
from dlrm_vrgd.train.loop import Trainer
from dlrm_vrgd.train.run import train

REPO = Path(__file__).resolve().parents[2]


def test_bf16_runs_the_mlps_in_bfloat16_and_keeps_float32_weights_and_grads() -> None:
    autocast = configure("bf16", torch.device("cpu"))
    layer = torch.nn.Linear(8, 4)
    with autocast():
        out = layer(torch.randn(3, 8))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(out[:, 0], torch.ones(3))
    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    assert layer.weight.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    with configure("fp32", torch.device("cpu"))():
        assert layer(torch.randn(3, 8)).dtype == torch.float32
    assert torch.get_float32_matmul_precision() == "highest"
    configure("tf32", torch.device("cpu"))
    assert torch.get_float32_matmul_precision() == "high"
    configure("fp32", torch.device("cpu"))
    with pytest.raises(ValueError, match="precision"):
        configure("fp16", torch.device("cpu"))  # type: ignore[arg-type]


def test_trainer_collects_float32_gradients_under_bf16() -> None:
    """The tables' pooled gradients and every dense .grad the optimizers sum are float32."""
    cfg = load_config(
        REPO / "configs/demo.yaml",
        ["data.train_rows=16384", "optim.dense.name=vradam",
         "optim.sparse.name=gsnr_rowwise_adagrad", "run.precision=bf16", "run.epochs=null",
         "run.steps=1"],
    )  # fmt: skip
    t = Trainer(cfg)
    seen: list[torch.dtype] = []
    collect = t.dense_opt.collect

    def spy() -> None:
        seen.extend(p.grad.dtype for _, p in t.model.named_dense_parameters())
        collect()

    t.dense_opt.collect = spy  # type: ignore[method-assign]
    calls = t.lookups[0].capture._calls
    with t.autocast():
        logits = t.model(t.micro_batch(0, 0))
    assert logits.dtype == torch.bfloat16
    assert all(c.leaf.dtype == torch.float32 for c in calls)  # the pooled lookups
    t.lookups[0].capture.take()
    record = t.train_step()
    assert seen and set(seen) == {torch.float32}
    assert math.isfinite(record["loss"])


def ratios(run: Path, key: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for line in (run / "gsnr.jsonl").read_text().splitlines():
        for entry in json.loads(line)[key]:
            out.setdefault(entry.get("name") or entry["table"], []).append(entry["ratio"])
    return out


def finite_everywhere(obj) -> bool:
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(finite_everywhere(v) for v in obj.values())
    if isinstance(obj, list):
        return all(finite_everywhere(v) for v in obj)
    return True


def compare_precisions(tmp_path: Path, overrides: list[str]) -> None:
    runs = {}
    for precision in ("fp32", "bf16"):
        cfg = load_config(
            REPO / "configs/demo.yaml",
            [*overrides, "optim.dense.name=vradam", "optim.sparse.name=gsnr_rowwise_adagrad",
             f"run.precision={precision}", "run.checkpoint_every=0", "run.tensorboard=false"],
        )  # fmt: skip
        runs[precision] = (train(cfg, tmp_path / precision), tmp_path / precision)
    (fp32, fp32_dir), (bf16, bf16_dir) = runs["fp32"], runs["bf16"]
    assert abs(bf16.test["auc"] - fp32.test["auc"]) <= 0.002, (bf16.test, fp32.test)
    for key, tol in (("dense", 0.05), ("tables", 0.01)):
        a, b = ratios(fp32_dir, key), ratios(bf16_dir, key)
        assert a.keys() == b.keys()
        for name in a:  # each tensor's / table's ratio, averaged over the run's steps
            assert abs(statistics.mean(a[name]) - statistics.mean(b[name])) <= tol, (key, name)
    for name in ("metrics.jsonl", "gsnr.jsonl"):
        for line in (bf16_dir / name).read_text().splitlines():
            assert finite_everywhere(json.loads(line)), line[:200]


def test_bf16_demo_matches_fp32_small(tmp_path: Path) -> None:
    """The demo at 1/16 of its rows (8 steps); measured: AUC 1e-4 apart."""
    compare_precisions(
        tmp_path,
        [
            "data.train_rows=65536",
            "data.val_rows=20000",
            "data.test_rows=20000",
            "run.eval_every=4",
        ],
    )


@pytest.mark.slow
def test_bf16_demo_matches_fp32(tmp_path: Path) -> None:
    """The whole demo (123 steps); measured at 1/4 of it: AUC 4.6e-5 apart, per-tensor ratios
    averaged over the steps at most 0.030 (dense) and 0.0044 (tables) apart."""
    compare_precisions(tmp_path, [])
