"""pooled_grad_to_rows against autograd through torch.nn.functional.embedding_bag."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dlrm_vrgd.embedding.capture import pooled_grad_to_rows

from .helpers import random_bags


def reference_row_grads(bags, feature_table, tables, pooling, upstream, groups):
    """Dense per-group, per-table gradients by autograd (``groups x rows x dim``)."""
    per_group = bags.batch // groups
    out = []
    for t, (rows, dim) in enumerate(tables):
        g_t = torch.zeros(groups, rows, dim, dtype=torch.float64)
        for g in range(groups):
            w = torch.zeros(rows, dim, dtype=torch.float64, requires_grad=True)
            col, total = 0, 0
            for f, tf in enumerate(feature_table):
                d = tables[tf][1]
                if tf == t:
                    lo, hi = g * per_group, (g + 1) * per_group
                    idx = [bags.ids[f][b] for b in range(lo, hi)]
                    offsets = torch.tensor([0] + [len(i) for i in idx]).cumsum(0)[:-1]
                    psw = None
                    if bags.weights is not None:
                        psw = torch.cat([bags.weights[f][b] for b in range(lo, hi)]).double()
                    pooled = F.embedding_bag(
                        torch.cat(idx), w, offsets, mode=pooling, per_sample_weights=psw
                    )
                    total = total + (pooled * upstream[lo:hi, col : col + d]).sum()
                col += d
            if isinstance(total, torch.Tensor):
                total.backward()
                g_t[g] = w.grad
        out.append(g_t)
    return out


@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("groups", [1, 4])
def test_row_grads_match_autograd(pooling: str, weighted: bool, groups: int) -> None:
    tables = [(30, 4), (12, 8), (5, 4)]  # mixed dims
    feature_table = [0, 1, 0, 2]  # feature 2 shares table 0 with feature 0
    bags = random_bags([tables[t][0] for t in feature_table], batch=16, weighted=weighted, seed=3)
    total_dim = sum(tables[t][1] for t in feature_table)
    upstream = torch.randn(
        16, total_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    kjt = bags.kjt()
    got = pooled_grad_to_rows(
        kjt.values(),
        kjt.offsets(),
        kjt.weights_or_none(),
        upstream,
        feature_table,
        [d for _, d in tables],
        pooling,
        groups,
    )
    ref = reference_row_grads(bags, feature_table, tables, pooling, upstream, groups)
    for t, rg in enumerate(got):
        dense = torch.zeros_like(ref[t])
        dense[rg.groups, rg.rows] = rg.grads
        torch.testing.assert_close(dense, ref[t])
        # exactly the (row, group) pairs some bag touched, each once, sorted
        keys = rg.rows * groups + rg.groups
        assert torch.equal(keys, torch.unique(keys))


def test_empty_call_and_empty_bags() -> None:
    grad = torch.randn(3, 4)
    offsets = torch.zeros(3 + 1, dtype=torch.int64)  # one feature, three empty bags
    out = pooled_grad_to_rows(torch.zeros(0, dtype=torch.int64), offsets, None, grad, [0], [4])
    assert out[0].rows.numel() == 0 and out[0].grads.shape == (0, 4)


def test_bad_layout_is_reported() -> None:
    with pytest.raises(ValueError, match="equal groups"):
        pooled_grad_to_rows(
            torch.arange(3), torch.arange(4), None, torch.randn(3, 2), [0], [2], num_groups=2
        )
    with pytest.raises(ValueError, match="columns"):
        pooled_grad_to_rows(torch.arange(3), torch.arange(4), None, torch.randn(3, 5), [0], [2])
