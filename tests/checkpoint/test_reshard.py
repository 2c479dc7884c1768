"""Resuming on another number of ranks: a 2-rank checkpoint continues on 1 (and 4) ranks with
the weights and optimizer state it was saved with, and the run goes on as it would have (same
losses, weights and optimizer state at the end)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dlrm_vrgd.checkpoint.reshard import (
    ColumnSegment,
    FullTable,
    Shard,
    gather_checkpoint,
    shard_scalars,
)
from dlrm_vrgd.config import parse_config
from dlrm_vrgd.train.loop import Trainer
from dlrm_vrgd.train.resume import load_checkpoint

from ..train.test_distributed import assert_same_model, cli, losses, train, write_config

EMA = ("optim.sparse.estimator=ema",)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 steps on 2 ranks (VR-Adam, GSNR row-wise Adagrad with the EMA estimator, table-wise),
    checkpoints at steps 3 and 6."""
    return train(tmp_path_factory.mktemp("reshard"), "two", 2, *EMA)


def resume_from_step_3(two: Path, tmp: Path, nproc: int) -> Path:
    part = tmp / f"on{nproc}"
    shutil.copytree(two, part)
    shutil.rmtree(part / "checkpoints" / "step_00000006")
    (part / "result.json").unlink()  # as if it had stopped after step 3 (a finished run is kept)
    cfg = write_config(tmp / f"on{nproc}.yaml", nproc)
    proc = cli("train", "--config", str(cfg), "--out", str(part), "--resume", "--set", EMA[0])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return part


def assert_same_optimizer_state(a: Path, b: Path, step: int) -> None:
    """The optimizer state of two runs' step-``step`` checkpoints, whatever their world sizes:
    every table's Adagrad sums and sparse EMA pairs (per table name), and the dense optimizer's
    Adam moments, step counts and GSNR ratio EMA (replicated: rank 0's)."""
    ckpts = [run / "checkpoints" / f"step_{step:08d}" for run in (a, b)]
    ranks = [[torch.load(p, weights_only=True) for p in sorted(c.glob("rank*.pt"))] for c in ckpts]
    sums = [
        {
            n: s
            for st in per_run
            for t in st["tables"]
            for n, s in zip(t["names"], t["states"], strict=True)
        }
        for per_run in ranks
    ]
    assert sums[0].keys() == sums[1].keys() and len(sums[0]) == 6
    for name, value in sums[0].items():
        assert value.gt(0).any(), name  # not trivially zero
        torch.testing.assert_close(sums[1][name], value, rtol=1e-5, atol=1e-7, msg=name)
    full = [gather_checkpoint(c) for c in ckpts]
    for name, table in full[0].tables.items():
        ((seg_a,), (seg_b,)) = table.segments, full[1].tables[name].segments
        assert seg_a.ema is not None and seg_b.ema is not None and seg_a.ema[1].gt(0).any()
        for x, y in zip(seg_a.ema, seg_b.ema, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-7, msg=name)
    dense = [per_run[0]["dense_opt"]["state"] for per_run in ranks]
    assert dense[0].keys() == dense[1].keys() and dense[0]
    for key, value in dense[0].items():
        assert {"exp_avg", "exp_avg_sq", "gsnr_ema", "step"} <= value.keys()
        assert value.keys() == dense[1][key].keys()
        for k, v in value.items():
            torch.testing.assert_close(dense[1][key][k], v, rtol=1e-5, atol=1e-7, msg=f"{key} {k}")


def test_two_rank_checkpoint_loads_on_one_rank_with_its_state(two: Path) -> None:
    ckpt = two / "checkpoints" / "step_00000003"
    saved = [torch.load(ckpt / f"rank{r}.pt", weights_only=True) for r in range(2)]
    raw = saved[0]["config"]
    raw["run"]["nproc_per_node"] = 1
    trainer = Trainer(parse_config(raw))
    load_checkpoint(trainer, ckpt)
    state = trainer.state_dict()
    assert state["step"] == 3
    # weights and Adagrad sums: every table of either rank, unchanged
    (mine,) = state["tables"]
    loaded = dict(
        zip(mine["names"], zip(mine["weights"], mine["states"], strict=True), strict=True)
    )
    seen = 0
    for s in saved:
        for t in s["tables"]:
            for name, w, st in zip(t["names"], t["weights"], t["states"], strict=True):
                torch.testing.assert_close(loaded[name][0], w, rtol=0, atol=0)
                torch.testing.assert_close(loaded[name][1], st, rtol=0, atol=0)
                seen += 1
    assert seen == len(loaded) == 6
    # dense weights and the dense optimizer's state (replicated: rank 0's)
    for name, value in saved[0]["dense"].items():
        torch.testing.assert_close(state["dense"][name], value, rtol=0, atol=0)
    for key, value in saved[0]["dense_opt"]["state"].items():
        for k, v in value.items():
            torch.testing.assert_close(state["dense_opt"]["state"][key][k], v, rtol=0, atol=0)
    # the sparse EMA state moved with its rows: per table, the owner's slice of its row space
    full = gather_checkpoint(ckpt)
    (spaces,) = state["sparse_opt"]["ema"]
    (signal, second) = spaces[0]
    offset = 0
    for name, table in full.tables.items():
        (seg,) = table.segments
        assert seg.ema is not None
        torch.testing.assert_close(signal[offset : offset + table.rows], seg.ema[0])
        torch.testing.assert_close(second[offset : offset + table.rows], seg.ema[1])
        assert seg.ema[1].gt(0).any(), name  # the EMA state is not trivially zero
        offset += table.rows
    assert state["sparse_opt"]["param_groups"] == saved[0]["sparse_opt"]["param_groups"]


def test_two_rank_run_resumed_on_one_rank_continues_the_same_run(two: Path, tmp_path: Path) -> None:
    """Same global batch and micro-batch: steps 4-6 read the same rows in the same groups, so
    the losses and the final model are those of the uninterrupted 2-rank run."""
    part = resume_from_step_3(two, tmp_path, 1)
    whole, resumed = losses(two), losses(part)
    assert list(resumed) == [1, 2, 3, 4, 5, 6]
    assert resumed == pytest.approx(whole, rel=1e-5)
    assert_same_model(two, part, 6)
    assert_same_optimizer_state(two, part, 6)


@pytest.mark.slow
def test_two_rank_run_resumed_on_four_ranks_continues_the_same_run(
    two: Path, tmp_path: Path
) -> None:
    part = resume_from_step_3(two, tmp_path, 4)
    assert losses(part) == pytest.approx(losses(two), rel=1e-5)
    assert_same_model(two, part, 6)
    assert_same_optimizer_state(two, part, 6)


def test_column_split_changes_combine_the_row_scalars() -> None:
    """Hand-computed: a table of 2 rows x 8 columns saved as two 4-column shards."""
    table = FullTable(
        "t", torch.zeros(2, 8),
        [
            ColumnSegment(0, 4, torch.tensor([1.0, 2.0]),
                          (torch.tensor([3.0, 0.0]), torch.tensor([5.0, 0.0]))),
            ColumnSegment(4, 4, torch.tensor([3.0, 6.0]),
                          (torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0]))),
        ],
    )  # fmt: skip
    # merged into the whole row: Adagrad sums average (means over columns), EMA sums add
    state, ema = shard_scalars(table, Shard("t", 0, 2, 0, 8))
    torch.testing.assert_close(state, torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(ema[0], torch.tensor([4.0, 0.0]))
    torch.testing.assert_close(ema[1], torch.tensor([7.0, 0.0]))
    # the same split: exactly the saved values; row 1 only
    state, ema = shard_scalars(table, Shard("t", 1, 1, 4, 4))
    torch.testing.assert_close(state, torch.tensor([6.0]))
    # a new split across the old one (columns 2-5): half of each
    state, ema = shard_scalars(table, Shard("t", 0, 2, 2, 4))
    torch.testing.assert_close(state, torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(ema[0], torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(ema[1], torch.tensor([3.5, 0.0]))


def test_elementwise_adagrad_reshards_one_to_two_column_wise_ranks_and_back(
    tmp_path: Path,
) -> None:
    """Full Adagrad (``adagrad``: one sum per weight element): a 1-rank run resumed from step 3
    on 2 ranks with column-wise shards (each rank holds column slices of the tables, with their
    element-wise sums) ends as the uninterrupted 1-rank run, and its 2-rank checkpoint loads
    back on 1 rank with every element's sum in place."""
    # torchrec cuts columns in slices of at least 128 (MIN_CW_DIM): dim 256 gives two
    sets = ("optim.sparse.name=adagrad", "model.embedding_dim=256", "model.dense_arch=[16,256]")
    one = train(tmp_path, "one", 1, *sets)
    part = tmp_path / "two"
    shutil.copytree(one, part)
    shutil.rmtree(part / "checkpoints" / "step_00000006")
    (part / "result.json").unlink()
    cfg = write_config(tmp_path / "two.yaml", 2, sharding=["column_wise"])
    proc = cli(
        "train", "--config", str(cfg), "--out", str(part), "--resume",
        *(a for s in sets for a in ("--set", s)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(part) == pytest.approx(losses(one), rel=1e-5)
    step6 = part / "checkpoints" / "step_00000006"
    labels = [
        n
        for p in sorted(step6.glob("rank*.pt"))
        for t in torch.load(p, weights_only=True)["tables"]
        for n in t["names"]
    ]
    assert any("cols 128+128" in n for n in labels), labels  # really cut by columns
    whole, split = (
        gather_checkpoint(one / "checkpoints" / "step_00000006"),
        gather_checkpoint(step6),
    )
    assert whole.tables.keys() == split.tables.keys() and len(whole.tables) == 6
    for name, table in whole.tables.items():
        torch.testing.assert_close(split.tables[name].weight, table.weight, rtol=1e-5, atol=1e-6)
        (seg,) = table.segments
        assert seg.state is not None and seg.state.shape == (table.rows, table.dim)
        assert seg.state.gt(0).any(), name
        for other in split.tables[name].segments:  # each column slice: its elements' sums
            assert other.state is not None and other.state.shape == (table.rows, other.nc)
            torch.testing.assert_close(
                other.state, seg.state[:, other.c0 : other.c0 + other.nc], rtol=1e-5, atol=1e-7
            )
    # and back onto 1 rank: the 2-rank checkpoint's element-wise sums, joined
    raw = torch.load(step6 / "rank0.pt", weights_only=True)["config"]
    raw["run"]["nproc_per_node"] = 1
    raw["run"]["sharding"] = ["table_wise"]
    trainer = Trainer(parse_config(raw))
    load_checkpoint(trainer, step6)
    (mine,) = trainer.state_dict()["tables"]
    for name, state in zip(mine["names"], mine["states"], strict=True):
        table = split.tables[name]
        assert state.shape == (table.rows, table.dim)
        for seg in table.segments:
            torch.testing.assert_close(
                state[:, seg.c0 : seg.c0 + seg.nc], seg.state, rtol=0, atol=0
            )
