"""``static_size``: the sort-based reduction of :func:`pooled_grad_to_rows` (no read-back on a
GPU), against autograd and against the ``unique`` route it replaces."""

from __future__ import annotations

import pytest
import torch

from dlrm_vrgd.embedding.capture import LookupLayout, RowGrads, pooled_grad_to_rows
from dlrm_vrgd.optim.sparse.accumulate import GroupRows

from ..optim.syncs import SyncCounter
from .helpers import random_bags, reference_row_grads
from .test_capture import per_table


@pytest.mark.parametrize("one_hot", [False, True], ids=["multi-hot", "one-hot"])
@pytest.mark.parametrize("dims", [(4, 8, 4), (4, 4, 4)], ids=["mixed-dims", "one-dim"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("groups", [1, 4])
def test_padded_pairs_are_the_row_gradients(one_hot, dims, weighted: bool, groups: int) -> None:
    """The first ``U`` slots are the ``U`` distinct (row, group) pairs, sorted, with autograd's
    row gradients and the unique route's sample counts; the other slots repeat the last pair
    with a zero gradient and count; the result has one slot per looked-up id."""
    tables = list(zip((30, 12, 5), dims, strict=True))
    feature_table = [0, 1, 0, 2]  # feature 2 shares table 0 with feature 0
    layout = LookupLayout.of(feature_table, list(dims), [r for r, _ in tables])
    bags = random_bags(
        [tables[t][0] for t in feature_table],
        batch=16,
        weighted=weighted,
        seed=5,
        min_len=int(one_hot),
        max_len=1 if one_hot else 3,
    )
    upstream = torch.randn(16, sum(tables[t][1] for t in feature_table), dtype=torch.float64)
    kjt = bags.kjt()
    args = (kjt.values(), kjt.offsets(), kjt.weights_or_none(), upstream, layout, "sum", groups)
    padded = pooled_grad_to_rows(*args, static_size=True, one_hot=one_hot or None)
    compact = pooled_grad_to_rows(*args)
    ref = reference_row_grads(bags, feature_table, tables, "sum", upstream, groups)
    pairs = [
        RowGrads(p.rows[p.valid], p.groups[p.valid], p.grads[p.valid], p.counts[p.valid])
        for p in padded
    ]
    for mine, theirs in zip(per_table(pairs, layout, tables, groups), ref, strict=True):
        torch.testing.assert_close(mine, theirs)
    for space, p, c in zip(layout.spaces, padded, compact, strict=True):
        feats = [f for f, t in enumerate(feature_table) if t in space.tables]
        n_ids = sum(sum(len(b) for b in bags.ids[f]) for f in feats)
        assert p.rows.numel() == p.valid.numel() == p.grads.shape[0] == n_ids
        u = c.rows.numel()
        assert p.valid.tolist() == [True] * u + [False] * (n_ids - u)
        assert torch.equal(p.rows[:u], c.rows) and torch.equal(p.groups[:u], c.groups)
        torch.testing.assert_close(p.grads[:u], c.grads, rtol=0, atol=0)
        assert torch.equal(p.counts[:u], c.counts)
        assert (p.rows[u:] == c.rows[-1]).all() and (p.groups[u:] == c.groups[-1]).all()
        assert not p.grads[u:].any() and not p.counts[u:].any()


@pytest.mark.parametrize("count_ids", [False, True])
@pytest.mark.parametrize(
    ("n_groups", "settle"),
    [(3, False), (3, True), (11, False)],
    ids=["settled-at-the-step", "settled-each-collect", "staging-buffer-grows"],
)
def test_padded_groups_merge_as_the_compact_ones(count_ids: bool, n_groups, settle) -> None:
    """The step's merge (:class:`GroupRows`, a GPU's) cuts each group's padding off: its sums
    are the unique route's, bit for bit, and its one read-back is the staged pair counts, of
    every group not settled yet (``settle``: each group settled at the next collect, as the
    optimizer does; 11 groups unsettled: more than the staging buffer's first 8 slots)."""
    tables = [(30, 4), (12, 4)]
    feature_table = [0, 1, 0]
    layout = LookupLayout.of(feature_table, [4, 4], [r for r, _ in tables])
    merged = {True: GroupRows(4, count_ids=count_ids), False: GroupRows(4, count_ids=count_ids)}
    padding = 0
    for seed in range(n_groups):  # groups of one call each
        if settle:
            merged[True].settle()  # the collect's first act
        bags = random_bags([tables[t][0] for t in feature_table], batch=8, seed=seed, min_len=1)
        upstream = torch.randn(8, 12, generator=torch.Generator().manual_seed(seed))
        kjt = bags.kjt()
        for static, acc in merged.items():
            (rg,) = pooled_grad_to_rows(
                kjt.values(), kjt.offsets(), None, upstream, layout, "sum", 1,
                count_ids=count_ids, one_hot=True, static_size=static,
            )  # fmt: skip
            assert (rg.valid is not None) == static
            if static:
                padding += int((~rg.valid).sum())
            acc.add(rg)
    with SyncCounter() as syncs:
        padded = merged[True].drain()
    compact = merged[False].drain()
    assert padding > 0  # ids repeat within a group: there was padding to cut off
    assert dict(syncs.kinds) == {"tolist": 1, "unique": 1}
    for name in ("rows", "grad_sum", "sq_sum", "n_groups", "counts"):
        mine, theirs = getattr(padded, name), getattr(compact, name)
        if theirs is None:
            assert mine is None
        else:
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
