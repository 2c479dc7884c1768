"""Deferred FBGEMM updates: A micro-batches + one replayed step == FBGEMM's fused update on the
whole global batch (weights and optimizer state)."""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from dlrm_vrgd.embedding import fbgemm
from dlrm_vrgd.embedding.fbgemm import FbgemmEmbeddingBagCollection, space_view
from dlrm_vrgd.optim.sparse import SparseRowwiseOptimizer
from dlrm_vrgd.train.loop import Trainer

from ..conftest import tiny_config
from .helpers import random_bags


def tables(pooling: PoolingType = PoolingType.SUM, dims=(4, 8, 4)) -> list[EmbeddingBagConfig]:
    spec = [
        ("t0", 40, dims[0], ["f0", "f3"]),
        ("t1", 25, dims[1], ["f1"]),
        ("t2", 6, dims[2], ["f2"]),
    ]
    return [
        EmbeddingBagConfig(
            name=n, num_embeddings=r, embedding_dim=d, feature_names=fs, pooling=pooling
        )
        for n, r, d, fs in spec
    ]


ROWS_PER_FEATURE = [40, 25, 6, 40]  # f0, f1, f2, f3 (f3 shares t0)


def make(
    optimizer: str, pooling: PoolingType, weighted: bool, dims=(4, 8, 4)
) -> FbgemmEmbeddingBagCollection:
    torch.manual_seed(0)
    return FbgemmEmbeddingBagCollection(
        tables(pooling, dims), optimizer, lr=0.3, is_weighted=weighted
    )


def run_deferred(ebc, bags, upstream, micro, chunk_rows=65_536, steps=1):
    opt = SparseRowwiseOptimizer(ebc.lookups(), lr=0.3, chunk_rows=chunk_rows)
    for _ in range(steps):
        for lo in range(0, bags.batch, micro):
            out = ebc(bags.kjt(lo, lo + micro)).values()
            (out * upstream[lo : lo + micro]).sum().div(micro).backward()
            opt.collect()
        opt.step()
    return opt


def run_fused(ebc, bags, upstream, steps=1):
    """FBGEMM's own fused optimizer inside the backward of the whole global batch."""
    ebc.capture.remove()
    for _ in range(steps):
        out = ebc(bags.kjt()).values()
        (out * upstream).sum().div(bags.batch).backward()


# (4, 8, 4): t1 alone in its row space (one-table view), t0 + t2 not adjacent (general replay);
# (4, 4, 4): all tables one row space, replayed through one one-table view.
@pytest.mark.parametrize("dims", [(4, 8, 4), (4, 4, 4)], ids=["mixed-dims", "one-dim"])
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "sgd"])
@pytest.mark.parametrize(
    "pooling,weighted",
    [(PoolingType.SUM, False), (PoolingType.SUM, True), (PoolingType.MEAN, False)],
)
def test_accumulated_step_equals_fused_whole_batch(optimizer, pooling, weighted, dims) -> None:
    bags = random_bags(ROWS_PER_FEATURE, batch=48, weighted=weighted, seed=7)
    width = 2 * dims[0] + dims[1] + dims[2]
    upstream = torch.randn(48, width, generator=torch.Generator().manual_seed(2))
    ours = make(optimizer, pooling, weighted, dims)
    ref = make(optimizer, pooling, weighted, dims)
    before = [w.clone() for w in ours.table_weights()]
    run_deferred(ours, bags, upstream, micro=12, steps=3)
    run_fused(ref, bags, upstream, steps=3)
    for a, b, w0 in zip(ours.table_weights(), ref.table_weights(), before, strict=True):
        torch.testing.assert_close(a, b)
        assert not torch.equal(a, w0)  # something was trained
    for a, b in zip(ours.row_states(), ref.row_states(), strict=True):
        torch.testing.assert_close(a, b)


def test_untouched_rows_and_their_state_are_unchanged() -> None:
    bags = random_bags(ROWS_PER_FEATURE, batch=8, max_len=1, seed=1)
    ebc = make("rowwise_adagrad", PoolingType.SUM, False)
    before = [w.clone() for w in ebc.table_weights()]
    run_deferred(ebc, bags, torch.randn(8, 20), micro=4)
    touched = [set(), set(), set()]
    for f, t in enumerate([0, 1, 2, 0]):
        for ids in bags.ids[f]:
            touched[t].update(ids.tolist())
    for t, (w, w0, s) in enumerate(zip(ebc.table_weights(), before, ebc.row_states(), strict=True)):
        untouched = [r for r in range(w.shape[0]) if r not in touched[t]]
        assert untouched, "the test needs untouched rows"
        torch.testing.assert_close(w[untouched], w0[untouched], rtol=0, atol=0)
        assert torch.all(s[untouched] == 0)
        assert torch.all(s[sorted(touched[t])] > 0)


def test_chunked_replay_equals_single_call() -> None:
    bags = random_bags(ROWS_PER_FEATURE, batch=32, seed=4)
    upstream = torch.randn(32, 20)
    a = make("rowwise_adagrad", PoolingType.SUM, False)
    b = make("rowwise_adagrad", PoolingType.SUM, False)
    run_deferred(a, bags, upstream, micro=8, chunk_rows=3)
    run_deferred(b, bags, upstream, micro=8)
    for x, y in zip(a.table_weights(), b.table_weights(), strict=True):
        torch.testing.assert_close(x, y)


def test_forward_is_the_pooled_lookup() -> None:
    ebc = make("sgd", PoolingType.SUM, weighted=True)
    bags = random_bags(ROWS_PER_FEATURE, batch=5, weighted=True, seed=2)
    out = ebc(bags.kjt())
    weights = ebc.table_weights()
    for f, t in enumerate([0, 1, 2, 0]):
        ids = bags.ids[f]
        offsets = torch.tensor([0] + [len(i) for i in ids]).cumsum(0)[:-1]
        ref = F.embedding_bag(
            torch.cat(ids),
            weights[t],
            offsets,
            mode="sum",
            per_sample_weights=torch.cat(bags.weights[f]),
        )
        torch.testing.assert_close(out[f"f{f}"], ref)


def test_eval_mode_and_no_grad_do_not_capture() -> None:
    ebc = make("sgd", PoolingType.SUM, False)
    kjt = random_bags(ROWS_PER_FEATURE, batch=4, seed=0).kjt()
    with torch.no_grad():
        ebc(kjt)
    ebc.eval()
    ebc(kjt)
    assert ebc.capture.pending == 0
    ebc.train()
    out = ebc(kjt).values()
    assert out.requires_grad and out.is_leaf and ebc.capture.pending == 1


def test_model_state_dict_carries_weights_and_adagrad_state() -> None:
    a = make("rowwise_adagrad", PoolingType.SUM, False)
    run_deferred(a, random_bags(ROWS_PER_FEATURE, batch=8, seed=3), torch.randn(8, 20), micro=8)
    b = make("rowwise_adagrad", PoolingType.SUM, False)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for x, y in zip(a.row_states(), b.row_states(), strict=True):
        torch.testing.assert_close(x, y)
    for x, y in zip(a.table_weights(), b.table_weights(), strict=True):
        torch.testing.assert_close(x, y)


def test_space_view_shares_the_tbe_buffers() -> None:
    ebc = make("rowwise_adagrad", PoolingType.SUM, False, dims=(4, 4, 4))
    layout = ebc.capture.layout
    (space,) = layout.spaces
    view = space_view(ebc.tbe, layout, space)
    assert view is not None
    assert view.weights_host.data_ptr() == ebc.tbe.weights_host.data_ptr()
    assert view.momentum1_host.data_ptr() == ebc.tbe.momentum1_host.data_ptr()
    # row 3 of table 2 is global row 40 + 25 + 3 of the space
    assert torch.equal(view.split_embedding_weights()[0][68], ebc.table_weights()[2][3])
    mixed = make("rowwise_adagrad", PoolingType.SUM, False)
    spaces = mixed.capture.layout.spaces
    assert space_view(mixed.tbe, mixed.capture.layout, spaces[0]) is None  # t0, t2 apart
    assert space_view(mixed.tbe, mixed.capture.layout, spaces[1]) is not None


# -- FBGEMM 1.6.0: no `preallocated_host_buffers` (it arrived in 1.7.0) -------------------------
_REAL_TBE = fbgemm.SplitTableBatchedEmbeddingBagsCodegen


def _signature_without_host_buffers() -> inspect.Signature:
    sig = inspect.signature(_REAL_TBE.__init__)
    params = [p for n, p in sig.parameters.items() if n != fbgemm.HOST_BUFFERS_KEYWORD]
    return sig.replace(parameters=params)


class Tbe16(_REAL_TBE):
    """The TBE as FBGEMM 1.6.0 has it: its signature lacks the keyword, and passing it raises
    the TypeError Python raises for an unknown keyword."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if fbgemm.HOST_BUFFERS_KEYWORD in kwargs:
            raise TypeError(
                "SplitTableBatchedEmbeddingBagsCodegen.__init__() got an unexpected keyword "
                f"argument '{fbgemm.HOST_BUFFERS_KEYWORD}'"
            )
        super().__init__(*args, **kwargs)

    __init__.__signature__ = _signature_without_host_buffers()  # type: ignore[attr-defined]


@pytest.fixture
def fbgemm_1_6(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every TBE this project builds is 1.6.0's (ours and the views)."""
    monkeypatch.setattr(fbgemm, "SplitTableBatchedEmbeddingBagsCodegen", Tbe16)


def test_the_keyword_is_read_from_the_signature() -> None:
    class CatchAll(_REAL_TBE):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

    assert fbgemm.takes_host_buffers(_REAL_TBE)  # this machine's FBGEMM 1.8
    assert not fbgemm.takes_host_buffers(Tbe16)
    assert not fbgemm.takes_host_buffers(CatchAll)  # **kwargs may drop it: not trusted
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        Tbe16([(4, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], preallocated_host_buffers={})


@pytest.mark.usefixtures("fbgemm_1_6")
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "sgd"])
def test_without_the_keyword_the_general_replay_equals_fused_whole_batch(optimizer) -> None:
    bags = random_bags(ROWS_PER_FEATURE, batch=48, seed=7)
    upstream = torch.randn(48, 16, generator=torch.Generator().manual_seed(2))  # 4 features x 4
    ours = make(optimizer, PoolingType.SUM, False, dims=(4, 4, 4))  # one row space
    ref = make(optimizer, PoolingType.SUM, False, dims=(4, 4, 4))
    assert isinstance(ours.tbe, Tbe16)
    (space,) = ours.capture.layout.spaces
    assert space_view(ours.tbe, ours.capture.layout, space) is None
    before = [w.clone() for w in ours.table_weights()]
    run_deferred(ours, bags, upstream, micro=12, steps=3)
    run_fused(ref, bags, upstream, steps=3)
    for a, b, w0 in zip(ours.table_weights(), ref.table_weights(), before, strict=True):
        torch.testing.assert_close(a, b)
        assert not torch.equal(a, w0)
    for a, b in zip(ours.row_states(), ref.row_states(), strict=True):
        torch.testing.assert_close(a, b)


def _train(*overrides: str, steps: int = 3) -> tuple[list[float], list[torch.Tensor], Trainer]:
    cfg = tiny_config("model.embedding_backend=fbgemm", f"run.steps={steps}", *overrides)
    t = Trainer(cfg)
    losses = [t.train_step()["loss"] for _ in range(steps)]
    t.close_input()
    return losses, [w.detach().clone() for w in t.lookups[0].table_weights()], t


# GSNR (γ < 1: its own row-wise pass, and every step measured through the fused kernel at
# γ = 1) and plain row-wise Adagrad (every row through the replay)
@pytest.mark.parametrize(
    "sparse",
    [
        ["optim.sparse.name=gsnr_rowwise_adagrad", "optim.sparse.gamma=0.2"],
        ["optim.sparse.name=gsnr_rowwise_adagrad", "optim.sparse.gamma=1.0"],
        ["optim.sparse.name=rowwise_adagrad"],
    ],
    ids=["gsnr", "gsnr-gamma1", "plain"],
)
def test_a_trainer_trains_on_fbgemm_1_6_as_on_1_8(
    monkeypatch: pytest.MonkeyPatch, sparse: list[str]
) -> None:
    fast_losses, fast, t = _train(*sparse)
    assert all(r is not None for r in t.lookups[0]._replays)  # 1.8: one view per row space
    init = Trainer(tiny_config("model.embedding_backend=fbgemm", *sparse))
    init.close_input()
    w0 = [w.detach().clone() for w in init.lookups[0].table_weights()]
    monkeypatch.setattr(fbgemm, "SplitTableBatchedEmbeddingBagsCodegen", Tbe16)
    losses, weights, t = _train(*sparse)
    assert isinstance(t.lookups[0].tbe, Tbe16)
    assert all(r is None for r in t.lookups[0]._replays)  # 1.6: the general replay
    assert all(math.isfinite(x) for x in losses)
    assert any(not torch.equal(w, w_0) for w, w_0 in zip(weights, w0, strict=True))
    assert losses == pytest.approx(fast_losses, rel=1e-5)
    for a, b in zip(weights, fast, strict=True):
        torch.testing.assert_close(a, b)
