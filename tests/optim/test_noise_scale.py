"""The gradient noise scale (DESIGN.md 4.6) against closed-form truth and references written
here: linear regression with Gaussian inputs (where |G|² and tr Σ are known), per-group
``autograd.grad`` for the dense tensors, per-group embedding gradients for the tables, and two
ranks against one."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dlrm_vrgd.optim.dense import GroupAveraged
from dlrm_vrgd.optim.noise_scale import (
    SINGLE_GROUP_REASON,
    NoisePieces,
    NoiseScale,
    SmoothedEstimates,
    estimates,
)
from dlrm_vrgd.optim.vrgd import VRSGD

from ..dist_utils import run_ranks
from ..embedding.helpers import random_bags, reference_row_grads
from .test_sparse import FEATURE_TABLE, TABLES, deferred_step, make_ebc, upstream_for


def make_optimizer(kind: str, named, process_group=None, lr: float = 0.0):
    named = list(named)
    if kind == "sgd":
        inner = torch.optim.SGD([p for _, p in named], lr=lr)
        return GroupAveraged(inner, process_group, [n for n, _ in named])
    gamma = {"vrsgd": 0.2, "vrsgd_gamma1": 1.0}[kind]
    return VRSGD(named, lr=lr, gamma=gamma, process_group=process_group)


KINDS = ["sgd", "vrsgd", "vrsgd_gamma1"]


# ------------------------------------------------------------------ closed form (Gaussian)
D, B, K, SIGMA = 6, 16, 4, 0.5
DELTA = torch.tensor([0.8, -0.5, 0.3, 0.0, 1.1, -0.2])  # w − w*


def linear_draws(kind: str, draws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step ``(|G|²_est, S_est)`` of ``draws`` independent steps of ``K`` groups of ``B``
    rows, through the optimizer's group protocol, for ``ℓ = ½(xᵀw − y)²``, ``x ~ N(0, I)``,
    ``y = xᵀw* + σε``, at ``w − w* = δ`` (lr 0: the weights never move)."""
    gen = torch.Generator().manual_seed(7)
    model = nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(DELTA[None])  # w* = 0
    opt = make_optimizer(kind, model.named_parameters())
    g2, s = [], []
    for _ in range(draws):
        for _ in range(K):
            x = torch.randn(B, D, generator=gen)
            y = SIGMA * torch.randn(B, generator=gen)
            (0.5 * (model(x).squeeze(1) - y).square().mean()).backward()
            opt.collect()
        opt.step()
        pieces = opt.noise_pieces()
        est = estimates(pieces.sq_of_mean, pieces.mean_of_sq, pieces.k, B)
        g2.append(est[0].sum())
        s.append(est[1].sum())
    return torch.stack(g2), torch.stack(s)


@pytest.mark.parametrize("kind", ["sgd", "vrsgd"])
def test_mean_over_draws_matches_the_closed_form(kind: str) -> None:
    """``G = E[x xᵀ]δ = δ`` and ``Σ = E[ggᵀ] − GGᵀ = |δ|²I + δδᵀ + σ²I`` (Isserlis), so
    ``|G|² = |δ|²`` and ``tr Σ = (d + 1)|δ|² + dσ²``. The tolerance is 4.5 standard errors of
    the mean, from the estimates' own spread; it must be tight enough to see the bias of a
    dropped ``k/(k − 1)`` (a factor (k − 1)/k = 0.75 on S)."""
    draws = 1200
    g2, s = linear_draws(kind, draws)
    true_g2 = float(DELTA.square().sum())
    true_s = (D + 1) * true_g2 + D * SIGMA**2
    for est, truth in ((g2, true_g2), (s, true_s)):
        est = est.double()
        tol = 4.5 * float(est.std()) / math.sqrt(draws)
        assert tol < 0.08 * truth  # sharp enough to catch a 25% bias or a wrong b
        assert abs(float(est.mean()) - truth) < tol, (float(est.mean()), truth, tol)


def test_estimates_need_two_groups() -> None:
    one = torch.ones(3)
    with pytest.raises(ValueError, match="k >= 2"):
        estimates(one, one, 1, 8)


def test_one_group_gives_no_estimate_and_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    ns = NoiseScale(rows_per_group=256)
    pieces = NoisePieces(["w"], torch.ones(1, dtype=torch.float64), torch.ones(1), k=1)
    with caplog.at_level(logging.WARNING, logger="dlrm_vrgd.optim.noise_scale"):
        for _ in range(3):
            ns.update(pieces, None)
    assert [r.getMessage() for r in caplog.records] == [
        f"gradient noise scale: no estimate, {SINGLE_GROUP_REASON}"
    ]
    record = ns.record(256, ns.dense_rows(), [])
    assert record["k"] == 1 and record["reason"] == SINGLE_GROUP_REASON
    assert "dense" not in record and "per_tensor" not in record


def test_ema_window_and_bias_correction() -> None:
    ema = SmoothedEstimates(beta=0.5)
    for x in (1.0, 3.0):
        ema.update(torch.tensor([x]), torch.tensor([2 * x]))
    # (0.5·0.5·1 + 0.5·3) / (1 − 0.25) = 1.75 / 0.75
    g2, s = ema.smoothed()
    assert float(g2) == pytest.approx(1.75 / 0.75) and float(s) == pytest.approx(3.5 / 0.75)
    w = torch.tensor([0.25, 0.5]) / 0.75  # the weights of the two steps
    assert ema.window == pytest.approx(float(w.sum() ** 2 / w.square().sum()))


# ------------------------------------------------------------ dense: per-group autograd.grad
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 1))


def group_batch(step: int, group: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + group)
    x = torch.randn(rows, 5, generator=g)
    return x, x[:, :1] - 0.5 * x[:, 1:2] + 0.7 * torch.randn(rows, 1, generator=g)


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()


@pytest.mark.parametrize("kind", KINDS)
def test_dense_record_equals_per_group_autograd_reference(kind: str) -> None:
    """Three steps that move the weights (lr 0.05); the reference takes each group's gradient
    with its own ``autograd.grad``, forms ``|ḡ|²`` and ``mean_d|g_d|²`` per tensor, the two
    estimates, their bias-corrected EMAs (β = 0.5) and the ratios, per tensor and summed."""
    model = mlp()
    names = [n for n, _ in model.named_parameters()]
    opt = make_optimizer(kind, model.named_parameters(), lr=0.05)
    ns = NoiseScale(rows_per_group=8, beta=0.5)
    beta, ema = 0.5, torch.zeros(2, len(names), dtype=torch.float64)
    for step in range(3):
        params = list(model.parameters())
        ref = [
            [g.double() for g in torch.autograd.grad(mse(model, *group_batch(step, d)), params)]
            for d in range(K)
        ]
        for d in range(K):
            mse(model, *group_batch(step, d)).backward()
            opt.collect()
        opt.step()
        ns.update(opt.noise_pieces(), None)
        g2 = torch.zeros(len(names), dtype=torch.float64)
        s = torch.zeros_like(g2)
        for i in range(len(names)):
            groups = torch.stack([ref[d][i] for d in range(K)])
            sq_of_mean = groups.mean(0).square().sum()
            mean_of_sq = groups.square().sum(dim=tuple(range(1, groups.ndim))).mean()
            g2[i] = (K * sq_of_mean - mean_of_sq) / (K - 1)
            s[i] = 8 * K / (K - 1) * (mean_of_sq - sq_of_mean)
        ema = beta * ema + (1 - beta) * torch.stack([g2, s])
    smooth = ema / (1 - beta**3)
    record = ns.record(32, ns.dense_rows(), [])
    assert [e["name"] for e in record["per_tensor"]] == names
    for i, e in enumerate(record["per_tensor"]):
        assert e["g2_raw"] == pytest.approx(float(g2[i]), rel=1e-4, abs=1e-9)
        assert e["s_raw"] == pytest.approx(float(s[i]), rel=1e-4)
        assert e["g2"] == pytest.approx(float(smooth[0, i]), rel=1e-4, abs=1e-9)
        assert e["s"] == pytest.approx(float(smooth[1, i]), rel=1e-4)
    total = smooth.sum(dim=1)
    dense = record["dense"]
    assert dense["g2"] == pytest.approx(float(total[0]), rel=1e-4)
    assert dense["b_simple"] == pytest.approx(float(total[1] / total[0]), rel=1e-4)
    assert dense["b_simple_raw"] == pytest.approx(float(s.sum() / g2.sum()), rel=1e-4)
    assert record["k"] == K and record["rows_per_group"] == 8 and record["ema_steps"] == 3


# --------------------------------------------------------------------- tables: per-group rows
@pytest.mark.parametrize("gsnr", [False, True])
def test_table_pieces_equal_per_group_row_gradient_reference(gsnr: bool) -> None:
    k, batch = 8, 64
    bags = random_bags([r for r, _ in TABLES], batch=batch, seed=5)
    upstream = upstream_for(batch)
    opt = deferred_step(make_ebc("rowwise_adagrad"), bags, upstream, k=k, gsnr=gsnr, gamma=0.3)
    pieces = opt.noise_pieces()
    assert pieces is not None and pieces.names == ["t0", "t1", "t2"] and pieces.k == k
    # the reference's group g is ∂(Σ pooled·upstream)/∂W over its bags; the optimizer's groups
    # are that divided by the group's rows (the mean loss)
    micro = batch // k
    ref = reference_row_grads(bags, FEATURE_TABLE, TABLES, "sum", upstream, k)
    for t, g in enumerate(ref):
        g = g / micro
        sq_of_mean = g.mean(0).square().sum()
        mean_of_sq = g.square().sum(dim=(1, 2)).mean()
        assert float(pieces.sq_of_mean[t]) == pytest.approx(float(sq_of_mean), rel=1e-5)
        assert float(pieces.mean_of_sq[t]) == pytest.approx(float(mean_of_sq), rel=1e-5)
        assert float(sq_of_mean) < float(mean_of_sq)  # groups differ: a spread to measure


def test_tables_aggregate_sums_column_shards_by_name() -> None:
    ns = NoiseScale(rows_per_group=4, beta=0.0)
    ns.k = 2
    rows = [("a", 1.0, 4.0, 1.0, 4.0), ("b", 2.0, 2.0, 2.0, 2.0), ("a", 1.0, 2.0, 1.0, 2.0)]
    record = ns.record(8, [], rows)
    assert [e["table"] for e in record["per_table"]] == ["a", "b"]
    assert record["per_table"][0]["b_simple"] == pytest.approx(6.0 / 2.0)
    assert record["tables"]["b_simple"] == pytest.approx(8.0 / 4.0)
    assert record["dense"] is None


# ----------------------------------------------------------------------- two ranks = one
def _pieces_on_ranks(rank: int, world: int) -> dict[str, tuple[list[float], list[float], int]]:
    out = {}
    for kind in ("sgd", "vrsgd"):
        model = mlp()
        opt = make_optimizer(kind, model.named_parameters(), process_group=dist.group.WORLD)
        per_rank = K // world
        for d in range(rank * per_rank, (rank + 1) * per_rank):
            mse(model, *group_batch(0, d)).backward()
            opt.collect()
        opt.step()
        p = opt.noise_pieces()
        out[kind] = (p.sq_of_mean.tolist(), p.mean_of_sq.tolist(), p.k)
    return out


def test_two_ranks_equal_one_rank_with_the_same_groups(tmp_path: Path) -> None:
    """Each of two gloo ranks collects two of the four groups: the all-reduced sums give the
    pieces one rank gets from all four (plain SGD and VR-SGD)."""
    ranks = run_ranks(_pieces_on_ranks, 2, tmp_path)
    for kind in ("sgd", "vrsgd"):
        model = mlp()
        opt = make_optimizer(kind, model.named_parameters())
        for d in range(K):
            mse(model, *group_batch(0, d)).backward()
            opt.collect()
        opt.step()
        one = opt.noise_pieces()
        for result in ranks:
            sq_of_mean, mean_of_sq, k = result[kind]
            assert k == K
            assert sq_of_mean == pytest.approx(one.sq_of_mean.tolist(), rel=1e-5)
            assert mean_of_sq == pytest.approx(one.mean_of_sq.tolist(), rel=1e-5)


def test_resumed_estimates_follow_the_step_onto_its_device() -> None:
    """A checkpoint is read onto the CPU; a GPU run's pieces then arrive on the GPU (here the
    meta device stands in): the EMAs move to them instead of failing on a device mismatch."""
    from dlrm_vrgd.optim.noise_scale import SmoothedEstimates

    store = SmoothedEstimates(0.5)
    store.load_state_dict({"t": 3, "g2": torch.ones(2), "s": torch.ones(2)})
    store.update(torch.zeros(2, device="meta"), torch.zeros(2, device="meta"))
    g2, s = store.smoothed()
    assert g2.device.type == "meta" and s.device.type == "meta" and store.t == 4
