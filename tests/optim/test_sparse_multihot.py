"""The GSNR and CowClip table steps on multi-hot bags with repeated ids (issue 46), against
references written here from DESIGN.md 4.3 and 4.5 in float64, occurrence by occurrence.

A step of ``k`` groups of ``B`` samples; each group's loss is the mean over its own samples
(``∂L_d/∂pooled_b = u_b / B``). With fixed bag sizes (MLPerf's: one table read by two features,
ids repeated in one bag, in several samples of a group and in several groups):

    g_{d,j} = Σ_{samples b of d} Σ_{occurrences of j in b's bags} w_occ · u_b[cols(f)] / B
    ḡ_j = (1/k) Σ_d g_{d,j}        Q_j = (1/k) Σ_d ‖g_{d,j}‖²   (summed in the group, then squared)
    n_groups_j = groups holding j  (not occurrences)
    cnt_j = samples of the step holding j (an id twice in one sample, in one bag or in two
            features of its table, counts once)

Both routes: the CPU's (``accumulate="slot"``: :class:`RowAccumulator`, the replay view) and a
GPU's run on the CPU (``accumulate="merge"``: the capture's ``static_size`` sort, no host replay
view, and the trainer's word ``one_hot=True``, which multi-hot bags must not be taken on).
Each test also checks that its case separates the right formula from the wrong one (squares per
occurrence; occurrences counted), so that a defect of that kind cannot pass it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

import dlrm_vrgd.embedding.fbgemm as fbgemm
from dlrm_vrgd.config import parse_config
from dlrm_vrgd.optim.sparse import CowClip, SparseRowwiseOptimizer

from ..embedding.helpers import Bags

#: (rows, dim) of each table; the last rows of each are never looked up.
TABLES = [(10, 4), (7, 4), (6, 8)]
#: (feature, table, bag size): table 0 read by two features, fixed sizes as MLPerf's.
FEATURES = [("a0", 0, 3), ("a1", 0, 2), ("b", 1, 2), ("c", 2, 1)]
B, K = 2, 4  # samples a group, groups a step
#: ids[f][sample]: repeats in one bag (a0 s0, s2, s6; b s0, s2, s4, ...), in one sample across
#: the two features of table 0 (s0: id 1 in a0 and a1; s4: ids 1 and 5), in several samples of a
#: group and in several groups.
IDS = [
    [[1, 1, 2], [1, 3, 3], [2, 2, 2], [4, 1, 0], [5, 5, 1], [6, 7, 1], [1, 1, 1], [3, 2, 5]],
    [[1, 4], [3, 0], [2, 7], [6, 6], [1, 5], [0, 0], [7, 2], [4, 4]],
    [[0, 0], [0, 1], [2, 2], [5, 3], [1, 1], [4, 4], [0, 5], [3, 3]],
    [[0], [0], [1], [4], [0], [2], [2], [3]],
]
LR, EPS, GAMMA = 0.3, 1e-8, 0.25
COLS = [0]
for _, _t, _ in FEATURES:
    COLS.append(COLS[-1] + TABLES[_t][1])


def bags(weighted: bool) -> Bags:
    g = torch.Generator().manual_seed(7)
    ids = [[torch.tensor(b, dtype=torch.int64) for b in f] for f in IDS]
    ws = [[torch.rand(len(b), generator=g) + 0.5 for b in f] for f in IDS] if weighted else None
    return Bags([name for name, _, _ in FEATURES], ids, ws)


def upstream() -> torch.Tensor:
    return torch.randn(B * K, COLS[-1], generator=torch.Generator().manual_seed(11))


def make_ebc(kernel: str, weighted: bool = False) -> fbgemm.FbgemmEmbeddingBagCollection:
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(
            name=f"t{t}",
            num_embeddings=rows,
            embedding_dim=dim,
            feature_names=[name for name, ft, _ in FEATURES if ft == t],
        )
        for t, (rows, dim) in enumerate(TABLES)
    ]
    ebc = fbgemm.FbgemmEmbeddingBagCollection(configs, kernel, lr=LR, eps=EPS, is_weighted=weighted)
    with torch.no_grad():  # weights of a spread of norms, so that CowClip's bound varies
        for t, w in enumerate(ebc.table_weights()):
            w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(t)) * 0.05)
            w[1] *= 20.0
    return ebc


def group_row_grads(data: Bags, u: torch.Tensor) -> list[torch.Tensor]:
    """``g[t]``: K x rows x dim (float64), every occurrence added into its group's row."""
    g = [torch.zeros(K, rows, dim, dtype=torch.float64) for rows, dim in TABLES]
    for f, (_, t, _) in enumerate(FEATURES):
        for b in range(B * K):
            ids = data.ids[f][b].tolist()
            for i, j in enumerate(ids):
                w = 1.0 if data.weights is None else float(data.weights[f][b][i])
                g[t][b // B, j] += w * u[b, COLS[f] : COLS[f + 1]].double() / B
    return g


def occurrence_sq(data: Bags, u: torch.Tensor) -> list[torch.Tensor]:
    """The wrong second moment: ``(1/k) Σ_occurrences ‖contribution‖²`` per row (rows x 1)."""
    q = [torch.zeros(rows, dtype=torch.float64) for rows, _ in TABLES]
    for f, (_, t, _) in enumerate(FEATURES):
        for b in range(B * K):
            for i, j in enumerate(data.ids[f][b].tolist()):
                w = 1.0 if data.weights is None else float(data.weights[f][b][i])
                q[t][j] += (w * u[b, COLS[f] : COLS[f + 1]].double() / B).square().sum() / K
    return q


def holders(data: Bags) -> list[dict[int, tuple[set[int], set[int], int]]]:
    """Per table, per touched row: (samples holding it, groups holding it, occurrences)."""
    out: list[dict[int, tuple[set[int], set[int], int]]] = [{} for _ in TABLES]
    for f, (_, t, _) in enumerate(FEATURES):
        for b in range(B * K):
            for j in data.ids[f][b].tolist():
                samples, groups, n = out[t].get(j, (set(), set(), 0))
                out[t][j] = (samples | {b}, groups | {b // B}, n + 1)
    return out


def gsnr_ratio(mean: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, ratio) of a table's touched rows (DESIGN.md 4.3, step estimator)."""
    signal = mean.square().sum(1)
    var = (second - signal).clamp_min(0)
    degenerate = var <= 1e-5 * second + 1e-30
    raw = torch.where(degenerate, torch.ones_like(var), signal / var)
    ratio = (raw / raw[~degenerate].mean()).clamp(GAMMA, 1.0)
    ratio[degenerate] = 1.0
    return raw, ratio


def one_step(route: str, kernel: str, weighted: bool, monkeypatch, **opt_kw):
    if route == "merge":
        monkeypatch.setattr(fbgemm, "space_view", lambda *a, **k: None)  # a GPU has none
    ebc = make_ebc(kernel, weighted)
    if route == "merge":
        ebc.capture.one_hot = True  # the trainer's word: must not be taken on multi-hot bags
    before = [w.detach().clone().double() for w in ebc.table_weights()]
    opt = SparseRowwiseOptimizer(ebc.lookups(), lr=LR, accumulate=route, **opt_kw)
    opt.record_rows = True
    data, u = bags(weighted), upstream()
    for d in range(K):
        lo, hi = d * B, (d + 1) * B
        (ebc(data.kjt(lo, hi)).values() * u[lo:hi]).sum().div(B).backward()
        opt.collect()
    opt.step()
    return ebc, opt, before, data, u


@pytest.mark.parametrize("route", ["slot", "merge"])
@pytest.mark.parametrize("weighted", [False, True])
def test_gsnr_step_on_repeated_ids_equals_the_reference(route, weighted, monkeypatch) -> None:
    """Weights, row states, raw GSNR, ratio and n_groups after one GSNR step (row-wise Adagrad,
    update placement) equal the float64 reference's."""
    ebc, opt, before, data, u = one_step(
        route, "rowwise_adagrad", weighted, monkeypatch, gsnr=True, gamma=GAMMA
    )
    g = group_row_grads(data, u)
    wrong_q = occurrence_sq(data, u)
    held = holders(data)
    summary = opt.summary()
    separated = 0
    for t, (rows_t, _) in enumerate(TABLES):
        rows = sorted(held[t])
        assert rows_t > len(rows)  # untouched rows exist (checked unchanged below)
        mean = g[t][:, rows].mean(0)
        second = g[t][:, rows].square().sum(2).mean(0)
        raw, ratio = gsnr_ratio(mean, second)
        wrong_raw, _ = gsnr_ratio(mean, wrong_q[t][rows])
        separated += int(not torch.allclose(wrong_raw, raw, rtol=1e-2))
        rec = opt.last_rows[0][t]
        order = torch.argsort(rec.rows)
        assert rec.rows[order].tolist() == rows
        torch.testing.assert_close(rec.update[order].double(), mean, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(rec.raw[order].double(), raw, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(rec.ratio[order].double(), ratio, rtol=1e-4, atol=1e-6)
        assert summary[t]["touched_rows"] == len(rows)
        assert summary[t]["multi_group_rows"] == sum(len(held[t][j][1]) >= 2 for j in rows)
        # row-wise Adagrad from a zero state; the row moves by r times its plain step
        state = mean.square().mean(1)
        expected = before[t].clone()
        expected[rows] -= LR * ratio[:, None] * mean / (state.sqrt()[:, None] + EPS)
        torch.testing.assert_close(ebc.table_weights()[t].double(), expected, rtol=1e-5, atol=1e-6)
        states = ebc.row_states()[t].reshape(-1).double()
        torch.testing.assert_close(states[rows], state, rtol=1e-5, atol=1e-9)
        assert not states[[r for r in range(rows_t) if r not in held[t]]].any()
    # the case tells a second moment squared per occurrence from one squared per group
    assert separated >= 2
    # and n_groups from an occurrence count: rows held twice or more in one group only
    assert any(len(grp) == 1 and n >= 2 for tab in held for _, grp, n in tab.values())


def cowclip_reference(
    kernel: str, before: list[torch.Tensor], data: Bags, u: torch.Tensor, count: str
):
    """CowClip (DESIGN.md 4.5) then the kernel, from the formula: per table the weights after the
    step and each touched row's clipped gradient, with ``count`` "samples" (the design) or
    "occurrences" (the wrong count)."""
    cc = {"r": 0.5, "zeta": 0.05, "decay": 0.1}
    g = group_row_grads(data, u)
    out, clipped, factors = [], [], []
    for t, (_, dim) in enumerate(TABLES):
        w = before[t].clone()
        mean = g[t].mean(0)
        c_t, f_t = {}, {}
        for j, (samples, _, n) in sorted(holders(data)[t].items()):
            cnt = len(samples) if count == "samples" else n
            grad = mean[j] + 2 * cc["decay"] * w[j]
            floor = cc["r"] * math.sqrt(dim) * cc["zeta"]
            bound = cc["r"] * cnt * max(float(w[j].norm()), floor)
            f_t[j] = min(1.0, bound / float(grad.norm()))
            c_t[j] = grad * f_t[j]
            if kernel == "sgd":
                w[j] -= LR * c_t[j]
            else:  # from a zero state: s = mean(g²)
                w[j] -= LR * c_t[j] / (c_t[j].square().mean().sqrt() + EPS)
        out.append(w)
        clipped.append(c_t)
        factors.append(f_t)
    return out, clipped, factors


@pytest.mark.parametrize("route", ["slot", "merge"])
@pytest.mark.parametrize("kernel", ["sgd", "rowwise_adagrad"])
def test_cowclip_counts_samples_on_repeated_ids(route, kernel, monkeypatch) -> None:
    """CowClip's bound takes the samples holding the id (an id twice in one bag, or in both
    features of its table, counts once): each row's clipped gradient and the weights after one
    step equal the reference's, and the case separates them from an occurrence count's."""
    clip = CowClip(clip_ratio=0.5, zeta=0.05, weight_decay=0.1)
    ebc, opt, before, data, u = one_step(route, kernel, False, monkeypatch, cowclip=clip)
    want, grads, factors = cowclip_reference(kernel, before, data, u, "samples")
    _, wrong, _ = cowclip_reference(kernel, before, data, u, "occurrences")
    separated = 0
    for t in range(len(TABLES)):
        rec = opt.last_rows[0][t]
        assert rec.rows.tolist() == sorted(grads[t])
        for j, got in zip(rec.rows.tolist(), rec.update, strict=True):
            torch.testing.assert_close(got.double(), grads[t][j], rtol=1e-5, atol=1e-7)
            separated += int(not torch.allclose(grads[t][j], wrong[t][j], rtol=1e-3))
        torch.testing.assert_close(ebc.table_weights()[t].double(), want[t], rtol=1e-5, atol=1e-6)
    assert separated >= 2  # rows clipped whose sample and occurrence counts differ
    for t, summary in enumerate(opt.summary()):
        assert summary["touched_rows"] == len(grads[t])
        clipped = sum(f < 1.0 for f in factors[t].values()) / len(factors[t])
        assert summary["cowclip_clipped"] == pytest.approx(clipped)
    assert any(f < 1.0 for f_t in factors for f in f_t.values())


def _multi_hot_config(sparse: str) -> dict:
    return {
        "data": {
            "source": "synthetic", "train_rows": 2048, "val_rows": 256, "test_rows": 256,
            "cardinalities": [50, 60, 70], "chunk_rows": 256, "multi_hot_sizes": [3, 1, 2],
        },
        "optim": {"sparse": {"name": sparse, "lr": 0.05}},
        "run": {"global_batch": 512, "micro_batch": 128, "steps": 3, "eval_every": 0},
    }  # fmt: skip


@pytest.mark.parametrize(
    "sparse", ["gsnr_rowwise_adagrad", "gsnr_sgd", "cowclip_rowwise_adagrad", "cowclip_sgd"]
)
def test_multi_hot_trains_with_gsnr_and_cowclip(sparse: str) -> None:
    """A tiny multi-hot config trains 3 steps with the GSNR and CowClip table steps: finite
    losses, and the tables' figures are the multi-hot step's (ids repeat across groups)."""
    from dlrm_vrgd.train.loop import Trainer

    trainer = Trainer(parse_config(_multi_hot_config(sparse)))
    try:
        losses = [trainer.train_step()["loss"] for _ in range(3)]
        summary = trainer.sparse_opt.summary()
    finally:
        trainer.close_input()
    assert np.isfinite(losses).all()
    assert len(summary) == 3 and all(s["multi_group_rows"] > 0 for s in summary)
    if sparse.startswith("gsnr_"):
        assert all(0.0 < s["ratio"] <= 1.0 for s in summary)
