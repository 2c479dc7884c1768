"""The global-batch-correct loop: A micro-batches of B rows == one step on the G-row batch."""

from __future__ import annotations

import pytest
import torch

from dlrm_vrgd.data.batch import Batch
from dlrm_vrgd.data.rows import Rows
from dlrm_vrgd.train.loop import Trainer

from ..conftest import tiny_config


def reference_step(trainer: Trainer, opt: torch.optim.Optimizer, step: int) -> float:
    """Plain full-batch training: FBGEMM's fused update inside the backward of all G rows, and
    a stock torch optimizer for the dense layers."""
    rows = trainer.stream.rows(step, 0)  # with A = 1 the single group is the whole global batch
    loss, _ = trainer.model.loss(Batch.from_rows(rows))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


@pytest.mark.parametrize(
    "dense,sparse",
    [
        ({"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True}, "rowwise_adagrad"),
        ({"name": "adagrad", "lr": 0.05}, "sgd"),
        ({"name": "adamw", "lr": 0.01, "weight_decay": 0.01}, "rowwise_adagrad"),
    ],
)
def test_micro_batches_equal_one_global_step(dense, sparse) -> None:
    sections = {"optim": {"dense": dense, "sparse": {"name": sparse, "lr": 0.1}}}
    ours = Trainer(tiny_config(**sections))  # G = 256 = 4 x 64
    ref = Trainer(tiny_config("run.micro_batch=256", **sections))
    assert ours.A == 4 and ref.A == 1
    ref.model.embeddings.capture.remove()
    ref_opt = type(ours.dense_opt.optimizer)(
        ref.model.dense_parameters(),
        **{
            k: v
            for k, v in ours.dense_opt.optimizer.defaults.items()
            if k in ("lr", "momentum", "nesterov", "weight_decay", "betas", "eps", "dampening")
        },
    )
    for step in range(3):
        record = ours.train_step()
        ref_loss = reference_step(ref, ref_opt, step)
        assert record["loss"] == pytest.approx(ref_loss, rel=1e-5)
    for (name, a), (_, b) in zip(
        ours.model.named_dense_parameters(), ref.model.named_dense_parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    emb_a, emb_b = ours.model.embeddings, ref.model.embeddings
    for a, b in zip(emb_a.table_weights(), emb_b.table_weights(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(emb_a.row_states(), emb_b.row_states(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_memory_is_set_by_the_micro_batch() -> None:
    """Each micro-batch is built, used and dropped: the trainer never asks for G rows at once.
    The input pipeline reads B rows at a time, at most ``run.input.depth`` micro-batches ahead
    of the step (here the next step's first two)."""
    trainer = Trainer(
        tiny_config("run.global_batch=1024", "run.micro_batch=64", "run.input.depth=2")
    )
    sizes: list[int] = []
    original = trainer.stream.rows

    def spy(step: int, group: int) -> Rows:
        rows = original(step, group)
        sizes.append(len(rows))
        return rows

    trainer.stream.rows = spy  # type: ignore[method-assign]
    trainer.train_step()
    trainer.close_input()
    assert sizes == [64] * (16 + 2)


def test_loss_decreases_and_eval_reports_oracle() -> None:
    trainer = Trainer(tiny_config("run.steps=30", "optim.dense.lr=0.02"))
    first = trainer.evaluate(trainer.splits.val)
    losses = [trainer.train_step()["loss"] for _ in range(30)]
    last = trainer.evaluate(trainer.splits.val)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert last["auc"] > first["auc"] + 0.05
    assert last["oracle_auc"] == pytest.approx(first["oracle_auc"])
    assert last["oracle_auc"] > last["auc"] - 0.02
    assert set(last) >= {"auc", "logloss", "ne", "calibration", "oracle_auc", "oracle_logloss"}


def test_learning_rates_follow_the_schedule() -> None:
    cfg = tiny_config(
        "run.steps=10",
        "optim.schedule.warmup_steps=2",
        "optim.schedule.decay=poly",
        "optim.schedule.lr_scaling=linear",
        "optim.schedule.reference_batch=128",
    )
    trainer = Trainer(cfg)
    lrs = [trainer.train_step()["lr_dense"] for _ in range(10)]
    base = 0.01 * 256 / 128
    assert lrs[0] == pytest.approx(base * 0.5)
    assert lrs[1] == pytest.approx(base)
    assert lrs[-1] == pytest.approx(0.0)
    assert trainer.sparse_opt.param_groups[0]["lr"] == pytest.approx(0.0)


@pytest.mark.parametrize("base,vr", [("sgd", "vrsgd"), ("adamw", "vradam")])
def test_vr_optimizer_with_gamma_one_trains_like_its_base(base: str, vr: str) -> None:
    common = {"lr": 0.05, "momentum": 0.9} if base == "sgd" else {"lr": 0.01}
    a = Trainer(tiny_config(optim={"dense": {"name": base, **common}}))
    b = Trainer(tiny_config(optim={"dense": {"name": vr, "gamma": 1.0, **common}}))
    for _ in range(3):
        ra, rb = a.train_step(), b.train_step()
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
        assert rb["gsnr_ratio"] == 1.0 and rb["gsnr_frac_clipped"] == 0.0
    for (_, x), (_, y) in zip(
        a.model.named_dense_parameters(), b.model.named_dense_parameters(), strict=True
    ):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_vr_telemetry_per_layer() -> None:
    trainer = Trainer(tiny_config(optim={"dense": {"name": "vrlamb", "lr": 0.01, "gamma": 0.1}}))
    record = trainer.train_step()
    assert 0.1 <= record["gsnr_ratio"] <= 1.0 and 0.0 <= record["gsnr_frac_clipped"] <= 1.0
    gsnr = trainer.gsnr_record()
    names = [d["name"] for d in gsnr["dense"]]
    assert names == [n for n, _ in trainer.model.named_dense_parameters()]
    assert any(n.startswith("dlrm.over_arch") for n in names)
    assert all(d["raw_gsnr"] >= 0 for d in gsnr["dense"])
    assert gsnr["tables"][0]["table"] == "t_cat_0"


@pytest.mark.parametrize(
    ("mode", "expected"),
    # 4 micro-batches, then the dense step; auto is micro_batch on a CPU
    [("micro_batch", 4 + 1), ("never", 0), ("auto", 4 + 1)],
)
def test_heap_release_follows_the_config(mode: str, expected: int, monkeypatch) -> None:
    """run.heap_release chooses the trainer's hand-back after each micro-batch and the dense
    step; the weights do not depend on it."""
    import dlrm_vrgd.malloc as malloc

    calls: list[int] = []
    monkeypatch.setattr(malloc, "release_free_memory", lambda: calls.append(1) or True)
    trainer = Trainer(tiny_config(f"run.heap_release={mode}"))
    trainer.train_step()
    assert len(calls) == expected
    if mode == "never":  # same step, same weights, whatever the hand-back
        other = Trainer(tiny_config("run.heap_release=micro_batch"))
        other.train_step()
        for (name, a), (_, b) in zip(
            trainer.model.named_dense_parameters(),
            other.model.named_dense_parameters(),
            strict=True,
        ):
            assert torch.equal(a, b), name


def test_heap_release_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="heap_release"):
        tiny_config("run.heap_release=sometimes")
