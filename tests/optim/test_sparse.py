"""GSNR-aware row-wise embedding optimizer (DESIGN.md 4.3) against references."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from dlrm_vrgd.embedding.fbgemm import FbgemmEmbeddingBagCollection
from dlrm_vrgd.optim.sparse import SparseRowwiseOptimizer

from ..embedding.helpers import Bags, random_bags, reference_row_grads

TABLES = [(50, 4), (30, 8), (7, 4)]  # (rows, dim): mixed dims
FEATURE_TABLE = [0, 1, 2]
LR = 0.2


def make_ebc(kernel: str, weighted: bool = False) -> FbgemmEmbeddingBagCollection:
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=r, embedding_dim=d, feature_names=[f"f{i}"])
        for i, (r, d) in enumerate(TABLES)
    ]
    return FbgemmEmbeddingBagCollection(configs, kernel, lr=LR, is_weighted=weighted)


def upstream_for(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 16, generator=torch.Generator().manual_seed(seed))


def deferred_step(ebc, bags: Bags, upstream, k: int, **opt_kw) -> SparseRowwiseOptimizer:
    opt = SparseRowwiseOptimizer(ebc.lookups(), lr=LR, **opt_kw)
    opt.record_rows = True
    micro = bags.batch // k
    for g in range(k):
        lo = g * micro
        out = ebc(bags.kjt(lo, lo + micro)).values()
        (out * upstream[lo : lo + micro]).sum().div(micro).backward()
        opt.collect()
    opt.step()
    return opt


def touched_rows(bags: Bags) -> list[set[int]]:
    touched: list[set[int]] = [set() for _ in TABLES]
    for f, t in enumerate(FEATURE_TABLE):
        for ids in bags.ids[f]:
            touched[t].update(ids.tolist())
    return touched


@pytest.mark.parametrize("kernel", ["rowwise_adagrad", "sgd"])
def test_gamma_one_equals_fbgemm_fused_on_the_global_batch(kernel: str) -> None:
    bags = random_bags([r for r, _ in TABLES], batch=64, seed=5)
    upstream = upstream_for(64)
    ours, ref = make_ebc(kernel), make_ebc(kernel)
    opt = deferred_step(ours, bags, upstream, k=8, gsnr=True, gamma=1.0)
    assert opt.summary()[0]["ratio"] == 1.0 and opt.summary()[0]["raw_gsnr"] > 0  # measured
    ref.capture.remove()
    (ref(bags.kjt()).values() * upstream).sum().div(64).backward()  # FBGEMM's own fused update
    for a, b in zip(ours.table_weights(), ref.table_weights(), strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(ours.row_states(), ref.row_states(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("accumulate", ["slot", "merge"])
@pytest.mark.parametrize("placement", ["update", "gradient"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("k", [2, 4, 8])
def test_row_statistics_match_embedding_bag_reference(
    weighted: bool, k: int, placement: str, accumulate: str
) -> None:
    """Row statistics by reference; EXACT_SGD moves every row by lr · r · ḡ under either
    placement (the step of ḡ is scaled, or the rule gets r · ḡ), whichever way the groups'
    sums are formed (folded in as they come, or merged at the step)."""
    bags = random_bags([r for r, _ in TABLES], batch=8 * k, weighted=weighted, seed=k)
    upstream = upstream_for(8 * k, seed=1)
    ebc = make_ebc("sgd", weighted)
    before = [w.detach().clone().double() for w in ebc.table_weights()]
    gamma = 0.25
    opt = deferred_step(
        ebc, bags, upstream, k=k, gsnr=True, gamma=gamma, placement=placement, accumulate=accumulate
    )

    # each group's loss is the mean over its own 8 bags: ∂L_g/∂pooled = upstream / 8
    group_grads = reference_row_grads(bags, FEATURE_TABLE, TABLES, "sum", upstream.double() / 8, k)
    for t, (rows_t, _) in enumerate(TABLES):
        rec = opt.last_rows[0][t]
        rows = sorted(touched_rows(bags)[t])
        assert sorted(rec.rows.tolist()) == rows
        order = torch.argsort(rec.rows)
        g = group_grads[t][:, rows]  # k x U x D
        mean = g.mean(0)
        signal = mean.square().sum(1)
        second = g.square().sum(2).mean(0)
        var = second - signal
        degenerate = var <= 1e-5 * second + 1e-30
        raw = torch.where(degenerate, torch.ones_like(var), signal / var)
        ratio = (raw / raw[~degenerate].mean()).clamp(gamma, 1.0)
        ratio[degenerate] = 1.0
        kernel_input = mean if placement == "update" else ratio[:, None] * mean
        torch.testing.assert_close(rec.update[order].double(), kernel_input, rtol=1e-3, atol=1e-7)
        torch.testing.assert_close(rec.raw[order].double(), raw, rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(rec.ratio[order].double(), ratio, rtol=1e-3, atol=1e-6)
        # EXACT_SGD then moved each touched row by lr · r · ḡ, and no other row
        expected = before[t].clone()
        expected[rows] -= LR * ratio[:, None] * mean
        torch.testing.assert_close(ebc.table_weights()[t].double(), expected, rtol=1e-5, atol=1e-6)
        if t == 0:
            assert rows_t > len(rows)  # untouched rows exist and were checked unchanged above


def test_single_group_rows_have_raw_ratio_one_over_k_minus_one() -> None:
    k = 4
    bags = random_bags([r for r, _ in TABLES], batch=8 * k, max_len=1, seed=2)
    opt = deferred_step(make_ebc("sgd"), bags, upstream_for(8 * k), k=k, gsnr=True)
    per_group = [[set() for _ in TABLES] for _ in range(k)]
    for f, t in enumerate(FEATURE_TABLE):
        for b, ids in enumerate(bags.ids[f]):
            per_group[b // 8][t].update(ids.tolist())
    checked = 0
    for t in range(len(TABLES)):
        rec = opt.last_rows[0][t]
        for row, raw in zip(rec.rows.tolist(), rec.raw.tolist(), strict=True):
            if sum(row in per_group[g][t] for g in range(k)) == 1:
                assert raw == pytest.approx(1 / (k - 1), rel=1e-5)
                checked += 1
    assert checked >= 5
    entry = opt.summary()[0]
    assert entry["multi_group_rows"] < entry["touched_rows"]


def test_untouched_rows_and_state_unchanged_with_gsnr() -> None:
    bags = random_bags([r for r, _ in TABLES], batch=16, max_len=1, seed=9)
    ebc = make_ebc("rowwise_adagrad")
    before = [w.detach().clone() for w in ebc.table_weights()]
    deferred_step(ebc, bags, upstream_for(16), k=4, gsnr=True, gamma=0.1, estimator="ema")
    for t, rows in enumerate(touched_rows(bags)):
        untouched = [r for r in range(TABLES[t][0]) if r not in rows]
        assert torch.equal(ebc.table_weights()[t][untouched], before[t][untouched])
        assert torch.all(ebc.row_states()[t][untouched] == 0)


@pytest.mark.parametrize("estimator", ["step", "ema"])
def test_no_nan_with_empty_bags_zero_grads_or_one_group(estimator: str) -> None:
    bags = random_bags([r for r, _ in TABLES], batch=8, max_len=2, seed=4)
    for f in range(3):  # first half of the bags empty: a whole group with no ids
        for b in range(4):
            bags.ids[f][b] = torch.zeros(0, dtype=torch.int64)
    for upstream, k in ((upstream_for(8), 2), (torch.zeros(8, 16), 2), (upstream_for(8), 1)):
        ebc = make_ebc("rowwise_adagrad")
        opt = deferred_step(ebc, bags, upstream, k=k, gsnr=True, estimator=estimator)
        assert all(torch.isfinite(w).all() for w in ebc.table_weights())
        for rec in opt.last_rows[0]:
            assert torch.isfinite(rec.ratio).all() and torch.isfinite(rec.raw).all()
        for entry in opt.summary():
            assert all(v is None or v == v for v in entry.values())


def test_ema_estimator_smooths_across_steps() -> None:
    """Two steps; the second step's raw ratio uses β-averaged row scalars."""
    beta, k = 0.5, 2
    ebc = make_ebc("sgd")
    opt = SparseRowwiseOptimizer(ebc.lookups(), lr=LR, gsnr=True, estimator="ema", ema_beta=beta)
    opt.record_rows = True
    bags = random_bags([r for r, _ in TABLES], batch=8, max_len=1, seed=11)
    history = []
    for step in range(2):
        upstream = upstream_for(8, seed=step)
        for g in range(k):
            out = ebc(bags.kjt(4 * g, 4 * g + 4)).values()
            (out * upstream[4 * g : 4 * g + 4]).sum().div(4).backward()
            opt.collect()
        # the statistics the step will see, by reference
        ref = reference_row_grads(bags, FEATURE_TABLE, TABLES, "sum", upstream.double() / 4, k)[0]
        history.append(ref)
        opt.step()
    rec = opt.last_rows[0][0]
    rows = rec.rows
    s = [h[:, rows].mean(0).square().sum(1) for h in history]
    q = [h[:, rows].square().sum(2).mean(0) for h in history]
    # rows are the same in both steps (same ids); first observation initializes the EMA
    sig, sec = beta * s[0] + (1 - beta) * s[1], beta * q[0] + (1 - beta) * q[1]
    var = sec - sig
    live = var > 1e-5 * sec
    expected = sig[live] / var[live]
    torch.testing.assert_close(rec.raw[live].double(), expected, rtol=1e-3, atol=1e-6)
    state = opt.state_dict()
    # two floats per row: tables 0 and 2 (dim 4) share one row space of 50 + 7 rows
    assert state["estimator"] == "ema"
    assert [s.shape for s in state["ema"][0][0]] == [(57,), (57,)]


def test_bad_arguments_are_named() -> None:
    ebc = make_ebc("sgd")
    for kwargs, match in (
        ({"gamma": 0.0}, "gamma"),
        ({"estimator": "median"}, "estimator"),
        ({"ema_beta": 1.0}, "ema_beta"),
    ):
        with pytest.raises(ValueError, match=match):
            SparseRowwiseOptimizer(ebc.lookups(), lr=0.1, gsnr=True, **kwargs)
