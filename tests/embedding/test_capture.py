"""pooled_grad_to_rows against autograd through torch.nn.functional.embedding_bag."""

from __future__ import annotations

import pytest
import torch

from dlrm_vrgd.embedding.capture import LookupLayout, pooled_grad_to_rows

from .helpers import random_bags, reference_row_grads


def per_table(got, layout: LookupLayout, tables, groups: int) -> list[torch.Tensor]:
    """Scatter per-space RowGrads back into dense groups x rows x dim tensors per table."""
    out = [torch.zeros(groups, rows, dim, dtype=torch.float64) for rows, dim in tables]
    for space, rg in zip(layout.spaces, got, strict=True):
        ix = space.table_index(rg.rows)
        for i, t in enumerate(space.tables):
            sel = ix == i
            out[t][rg.groups[sel], rg.rows[sel] - space.offsets[i]] = rg.grads[sel]
        keys = rg.rows * groups + rg.groups  # each (row, group) once, sorted
        assert torch.equal(keys, torch.unique(keys))
    return out


@pytest.mark.parametrize("one_hot", [False, True], ids=["multi-hot", "one-hot"])
@pytest.mark.parametrize("dims", [(4, 8, 4), (4, 4, 4)], ids=["mixed-dims", "one-dim"])
@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("groups", [1, 4])
def test_row_grads_match_autograd(one_hot, dims, pooling: str, weighted: bool, groups: int) -> None:
    tables = list(zip((30, 12, 5), dims, strict=True))
    feature_table = [0, 1, 0, 2]  # feature 2 shares table 0 with feature 0
    layout = LookupLayout.of(feature_table, list(dims), [r for r, _ in tables])
    bags = random_bags(
        [tables[t][0] for t in feature_table],
        batch=16,
        weighted=weighted,
        seed=3,
        min_len=int(one_hot),
        max_len=1 if one_hot else 3,
    )
    total_dim = sum(tables[t][1] for t in feature_table)
    gen = torch.Generator().manual_seed(1)
    upstream = torch.randn(16, total_dim, dtype=torch.float64, generator=gen)
    kjt = bags.kjt()
    got = pooled_grad_to_rows(
        kjt.values(), kjt.offsets(), kjt.weights_or_none(), upstream, layout, pooling, groups
    )
    assert len(got) == len(set(dims))
    ref = reference_row_grads(bags, feature_table, tables, pooling, upstream, groups)
    for mine, theirs in zip(per_table(got, layout, tables, groups), ref, strict=True):
        torch.testing.assert_close(mine, theirs)
    # samples holding each id per (row, group), counted here sample by sample (an id twice in
    # one sample, in one bag or in two features of one table, counts once; weights and pooling
    # do not change a count)
    holders: list[dict[tuple[int, int], set[int]]] = [{} for _ in layout.spaces]
    for f, t in enumerate(feature_table):
        s, pos = layout.space_of_table(t)
        for b, ids in enumerate(bags.ids[f]):
            for i in ids.tolist():
                key = (layout.spaces[s].offsets[pos] + i, b // (16 // groups))
                holders[s].setdefault(key, set()).add(b)
    counts = [{k: len(v) for k, v in h.items()} for h in holders]
    for rg, expected in zip(got, counts, strict=True):
        pairs = zip(rg.rows.tolist(), rg.groups.tolist(), rg.counts.tolist(), strict=True)
        assert {(r, g): c for r, g, c in pairs} == expected


def test_row_spaces_number_tables_like_tbe() -> None:
    layout = LookupLayout.of([0, 1, 2, 2], [4, 8, 4], [10, 20, 30])
    (four, eight) = layout.spaces
    assert (four.dim, four.tables, four.offsets) == (4, (0, 2), (0, 10, 40))
    assert (eight.dim, eight.tables, eight.offsets) == (8, (1,), (0, 20))
    assert four.table_index(torch.tensor([0, 9, 10, 39])).tolist() == [0, 0, 1, 1]
    assert layout.space_of_table(2) == (0, 1)


def test_empty_call_and_empty_bags() -> None:
    grad = torch.randn(3, 4)
    offsets = torch.zeros(3 + 1, dtype=torch.int64)  # one feature, three empty bags
    layout = LookupLayout.of([0], [4], [10])
    out = pooled_grad_to_rows(torch.zeros(0, dtype=torch.int64), offsets, None, grad, layout)
    assert out[0].rows.numel() == 0 and out[0].grads.shape == (0, 4)
    assert out[0].counts.numel() == 0


def test_bad_layout_is_reported() -> None:
    layout = LookupLayout.of([0], [2], [10])
    with pytest.raises(ValueError, match="equal groups"):
        pooled_grad_to_rows(
            torch.arange(3), torch.arange(4), None, torch.randn(3, 2), layout, num_groups=2
        )
    with pytest.raises(ValueError, match="columns"):
        pooled_grad_to_rows(torch.arange(3), torch.arange(4), None, torch.randn(3, 5), layout)
