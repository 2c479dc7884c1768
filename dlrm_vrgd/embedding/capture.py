"""Capture of pooled-embedding gradients, reduced to per-(row, group) row gradients.

A table-batched lookup (an FBGEMM TBE, or the pure-PyTorch backend) computes, for ``F``
features and ``B`` bags each, a pooled output ``B x ΣD_f``. :class:`LookupCapture` hooks the
lookup module: in training it hands the model a *detached leaf* copy of the output instead, so
the lookup's own backward (FBGEMM's fused optimizer update) never runs. After the model's
backward the leaf's ``.grad`` holds ``∂L/∂pooled``; :func:`pooled_grad_to_rows` turns it into the
gradient of every touched row, separately for each *group* of bags::

    g[row, group] = Σ_{bags b of group, j in b with indices[j] == row} w_j · ∂L/∂pooled[b, cols(f)]

with ``w_j`` the per-sample weight (1 when unweighted), divided by the bag length for mean pooling.
Rows of all features mapped to the same table are summed before anything else. Each
``(row, group)`` also carries how many of the group's samples hold the row's id
(``RowGrads.counts``, CowClip's ``cnt_j``; an id twice in one sample's bag counts once), whatever
the per-sample weights or pooling: one ``bincount`` of the ids already sorted for the sum when
every bag holds one id, one more sort of the ``(row, sample)`` pairs for multi-hot bags.

The number of distinct ``(row, group)`` pairs depends on the ids, and a ``unique`` that sizes its
output by it waits for the device. With ``static_size`` (the route a GPU takes,
:class:`LookupCapture`'s flag) the reduction is a sort instead: the ids are sorted by
``(row, sample)``, run starts are marked, a ``cumsum`` numbers the runs, and the sums go into
buffers with one slot per looked-up id — a size known before the ids are. The first ``U`` slots
hold the ``U`` pairs, sorted; the others are padding (``RowGrads.valid`` false), copies of the last
pair with a zero gradient and a zero count, so that a merge, a gather or a write of them changes
nothing. ``U`` stays on the device; nothing is read back.

Tables that share an embedding dim are numbered into one *row space* (:class:`RowSpace`, like
the TBE's own ``hash_size_cumsum``), so one micro-batch costs one sort of its looked-up ids and
one ``index_add`` per distinct dim — not one per table.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

Pooling = Literal["sum", "mean"]


@dataclass(frozen=True)
class RowSpace:
    """The tables of one lookup with embedding dim ``dim``: row ``r`` of ``tables[i]`` is
    *global row* ``offsets[i] + r`` (``offsets`` has ``len(tables) + 1`` entries)."""

    dim: int
    tables: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.offsets[-1]

    def table_index(self, rows: torch.Tensor) -> torch.Tensor:
        """Position in :attr:`tables` of each global row."""
        bounds = torch.tensor(self.offsets[1:-1], dtype=rows.dtype, device=rows.device)
        return torch.bucketize(rows, bounds, right=True)


@dataclass(frozen=True)
class LookupLayout:
    """Which table each feature reads, and the tables' shapes (the TBE's feature_table_map)."""

    feature_table: tuple[int, ...]
    table_dims: tuple[int, ...]
    table_rows: tuple[int, ...]
    spaces: tuple[RowSpace, ...] = field(init=False)

    def __post_init__(self) -> None:
        spaces = []
        for dim in dict.fromkeys(self.table_dims):  # distinct dims, first-seen order
            tables = tuple(t for t, d in enumerate(self.table_dims) if d == dim)
            offsets = [0]
            for t in tables:
                offsets.append(offsets[-1] + self.table_rows[t])
            spaces.append(RowSpace(dim, tables, tuple(offsets)))
        object.__setattr__(self, "spaces", tuple(spaces))

    @staticmethod
    def of(feature_table: list[int], table_dims: list[int], table_rows: list[int]) -> LookupLayout:
        return LookupLayout(tuple(feature_table), tuple(table_dims), tuple(table_rows))

    def space_of_table(self, table: int) -> tuple[int, int]:
        """``(space index, position in that space)`` of ``table``."""
        for s, space in enumerate(self.spaces):
            if table in space.tables:
                return s, space.tables.index(table)
        raise KeyError(table)


@dataclass(frozen=True)
class RowGrads:
    """Per-(row, group) gradients in one row space, sorted by ``(row, group)``.

    ``rows`` U int64 global rows, ``groups`` U int64 (0..G-1 within the call), ``grads`` U x D,
    ``counts`` U int64: samples (bags of ``[0, B)``) of the group whose lookups hold the row's id
    (>= 1; an id twice in one sample counts once).

    ``valid`` (U bool) is set on padded results (``static_size``): the pairs are its true
    entries, all before its false ones; a padding entry repeats the last pair's row and group
    with a zero gradient and a zero count. None: every entry is a pair.
    """

    rows: torch.Tensor
    groups: torch.Tensor
    grads: torch.Tensor
    counts: torch.Tensor
    valid: torch.Tensor | None = None

    @staticmethod
    def empty(dim: int, device: torch.device | None = None) -> RowGrads:
        z = torch.zeros(0, dtype=torch.int64, device=device)
        return RowGrads(z, z.clone(), torch.zeros(0, dim, device=device), z.clone())


def pooled_grad_to_rows(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    grad: torch.Tensor,
    layout: LookupLayout,
    pooling: Pooling = "sum",
    num_groups: int = 1,
    *,
    count_ids: bool = True,
    one_hot: bool | None = None,
    static_size: bool = False,
) -> list[RowGrads]:
    """Reduce the pooled-output gradient ``grad`` (B x ΣD_f) to row gradients, one
    :class:`RowGrads` per row space of ``layout``.

    ``indices``/``offsets``/``per_sample_weights`` are the lookup's inputs in TBE layout
    (``offsets`` has ``F·B + 1`` entries, feature-major). Bags ``[g·B/G, (g+1)·B/G)`` form group
    ``g`` of ``G = num_groups`` (the owner of a sharded table receives the source ranks' bags in
    rank order). ``count_ids``: fill :attr:`RowGrads.counts` (else they are empty).
    ``one_hot``: whether every bag holds exactly one id — None reads the lengths to find out (a
    host sync on a GPU), True is the caller's word for it (the trainer's rows hold one id per
    table) and takes the one-hot path whenever there are ``F·B`` ids, with no read-back.
    ``static_size``: reduce by a sort into one slot per looked-up id, padded (see the module
    doc): no read-back on the one-hot path.
    """
    num_features = len(layout.feature_table)
    num_bags = (offsets.numel() - 1) // num_features
    if num_bags * num_features != offsets.numel() - 1:
        raise ValueError(f"offsets has {offsets.numel()} entries, not F*B+1 for F={num_features}")
    if num_bags % num_groups:
        raise ValueError(f"{num_bags} bags cannot be split into {num_groups} equal groups")
    dims = [layout.table_dims[t] for t in layout.feature_table]
    if sum(dims) != grad.shape[1]:
        raise ValueError(f"gradient has {grad.shape[1]} columns, features need {sum(dims)}")
    device = grad.device
    offsets = offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]  # F*B, feature-major
    cols = [0]
    for d in dims:
        cols.append(cols[-1] + d)

    out = []
    for space in layout.spaces:
        feats = [f for f, t in enumerate(layout.feature_table) if t in space.tables]
        ids = _space_items(
            indices,
            offsets,
            lengths,
            per_sample_weights,
            grad,
            layout,
            space,
            feats,
            cols,
            num_bags,
            pooling,
            one_hot,
        )
        if ids is None:
            out.append(RowGrads.empty(space.dim, device))
            continue
        rows, bag, contrib, shared = ids
        if static_size:
            out.append(_sorted_pairs(rows, bag, contrib, num_bags, num_groups, count_ids))
            continue
        if num_groups == 1:
            keys = rows
        else:
            keys = rows * num_groups + torch.div(bag, num_bags // num_groups, rounding_mode="floor")
        uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
        grads = torch.zeros(uniq.numel(), space.dim, dtype=grad.dtype, device=device)
        grads.index_add_(0, inverse, contrib)
        if count_ids:
            counts = _sample_counts(rows, bag, uniq, inverse, num_bags, num_groups, shared)
        else:
            counts = torch.zeros(0, dtype=torch.int64, device=device)
        if num_groups == 1:
            out.append(RowGrads(uniq, torch.zeros_like(uniq), grads, counts))
        else:
            out.append(RowGrads(uniq // num_groups, uniq % num_groups, grads, counts))
    return out


def _sorted_pairs(
    rows: torch.Tensor,
    bag: torch.Tensor,
    contrib: torch.Tensor,
    num_bags: int,
    num_groups: int,
    count_ids: bool,
) -> RowGrads:
    """:class:`RowGrads` of ``N`` looked-up ids (``rows``, ``bag`` N; ``contrib`` N x D) in ``N``
    slots, with no size read back: sort by ``(row, sample)`` (the ``(row, group)`` keys come out
    sorted too, groups being runs of samples), number the runs of equal keys by a ``cumsum`` of
    their starts, and sum into slot = run. Slots past the last run repeat it (``valid`` false,
    zero gradient and count). ``counts``: the runs of equal ``(row, sample)`` within each pair."""
    n = rows.numel()
    pair, order = torch.sort(rows * num_bags + bag, stable=True)
    key = torch.div(pair, num_bags, rounding_mode="floor")  # the row
    if num_groups > 1:
        group = torch.div(pair - key * num_bags, num_bags // num_groups, rounding_mode="floor")
        key = key * num_groups + group
    starts = torch.ones(n, dtype=torch.bool, device=rows.device)
    starts[1:] = key[1:] != key[:-1]
    run = torch.cumsum(starts, 0) - 1  # sorted id -> its pair's slot, 0..U-1
    inverse = torch.empty_like(run)
    inverse[order] = run  # id (as looked up) -> slot: a permutation, no read-back
    slots = torch.arange(n, device=rows.device)
    # the key of slot s: that of the first sorted id in run s (slots past U: the last id's)
    first = torch.searchsorted(run, slots).clamp_(max=n - 1)
    keys = key[first]
    valid = slots <= run[-1]
    grads = torch.zeros(n, contrib.shape[1], dtype=contrib.dtype, device=rows.device)
    grads.index_add_(0, inverse, contrib)
    counts = torch.zeros(n if count_ids else 0, dtype=torch.int64, device=rows.device)
    if count_ids:
        samples = torch.ones(n, dtype=torch.int64, device=rows.device)  # first of (row, sample)
        samples[1:] = pair[1:] != pair[:-1]
        counts.index_add_(0, run, samples)
    if num_groups == 1:
        return RowGrads(keys, torch.zeros_like(keys), grads, counts, valid)
    return RowGrads(keys // num_groups, keys % num_groups, grads, counts, valid)


def _sample_counts(
    rows: torch.Tensor,
    bag: torch.Tensor,
    uniq: torch.Tensor,
    inverse: torch.Tensor,
    num_bags: int,
    num_groups: int,
    repeats: bool,
) -> torch.Tensor:
    """Per unique ``(row, group)`` key ``uniq``, the number of samples (bags ``[0, B)``) whose
    lookups hold the row's id — CowClip's ``cnt_j`` (its authors' ``tf.unique_with_counts`` over
    a column). ``repeats``: whether an id may occur twice in one sample (multi-hot bags, or
    features sharing a table); when it cannot, that is the occurrence count (one ``bincount``)."""
    if not repeats:
        return torch.bincount(inverse, minlength=uniq.numel())
    pairs = torch.unique(rows * num_bags + bag)  # distinct (row, sample)
    pair_rows = torch.div(pairs, num_bags, rounding_mode="floor")
    keys = pair_rows
    if num_groups > 1:
        group = torch.div(pairs % num_bags, num_bags // num_groups, rounding_mode="floor")
        keys = pair_rows * num_groups + group
    return torch.bincount(torch.searchsorted(uniq, keys), minlength=uniq.numel())


_ROW_OFFSETS: dict[tuple[RowSpace, LookupLayout, tuple[int, ...], torch.device], torch.Tensor] = {}


def _row_offsets(
    space: RowSpace, layout: LookupLayout, feats: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """The global row offset of each of ``feats``'s tables, made once per device (a tensor
    made from a list on a GPU is a copy the host waits for)."""
    key = (space, layout, feats, device)
    if key not in _ROW_OFFSETS:
        _ROW_OFFSETS[key] = torch.tensor(
            [space.offsets[space.tables.index(layout.feature_table[f])] for f in feats],
            dtype=torch.int64,
            device=device,
        )
    return _ROW_OFFSETS[key]


_FEATURES: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _feature_index(feats: list[int], device: torch.device) -> torch.Tensor:
    """``feats`` as an int64 tensor on ``device``, made once (see :func:`_row_offsets`)."""
    key = (tuple(feats), device)
    if key not in _FEATURES:
        _FEATURES[key] = torch.tensor(feats, dtype=torch.int64, device=device)
    return _FEATURES[key]


def _space_items(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    grad: torch.Tensor,
    layout: LookupLayout,
    space: RowSpace,
    feats: list[int],
    cols: list[int],
    num_bags: int,
    pooling: Pooling,
    one_hot: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool] | None:
    """Every looked-up id of the space's features as ``(global row, bag in [0, B),
    contribution ∂L/∂pooled · weight, whether a (row, bag) pair may repeat)``; None when there
    is none (``one_hot``: see :func:`pooled_grad_to_rows`)."""
    device = grad.device
    num_features = len(layout.feature_table)
    if not feats or indices.numel() == 0:  # TBE inputs: offsets[-1] == indices.numel()
        return None
    row_offset = _row_offsets(space, layout, tuple(feats), device)
    if indices.numel() != num_features * num_bags:
        one_hot = False
    elif one_hot is None:
        one_hot = bool((lengths == 1).all())
    if one_hot:
        # One id per bag in every feature (Criteo): take the ids bag-major, so that item
        # b·F' + f lines up with row b, feature f of the gradient — with every feature a view,
        # no copy; with some (tables of other dims elsewhere) a gather of their ids and columns.
        def by_feature(x: torch.Tensor) -> torch.Tensor:  # F x B -> the space's F' x B
            x = x.view(num_features, num_bags)
            if len(feats) == num_features:
                return x
            if feats[-1] + 1 - feats[0] == len(feats):  # consecutive: a view
                return x[feats[0] : feats[-1] + 1]
            return x.index_select(0, _feature_index(feats, device))

        if len(feats) == num_features:
            contrib = grad.reshape(num_bags * num_features, space.dim)
        else:
            contrib = torch.stack([grad[:, cols[f] : cols[f] + space.dim] for f in feats], 1)
            contrib = contrib.reshape(num_bags * len(feats), space.dim)
        rows = by_feature(indices).t().reshape(-1).to(torch.int64)
        rows = rows + row_offset.repeat(num_bags)
        bag = torch.arange(num_bags, device=device).repeat_interleave(len(feats))
        if per_sample_weights is not None:
            w = by_feature(per_sample_weights).t().reshape(-1)
            contrib = contrib * w.to(grad.dtype)[:, None]
        # two features, one table
        shared = len({layout.feature_table[f] for f in feats}) < len(feats)
        return rows, bag, contrib, shared
    # General bags: ids feature-major, each feature's ids contiguous.
    if len(feats) == num_features:
        pooled = grad.view(num_bags, num_features, space.dim).transpose(0, 1)
        nnz: slice | torch.Tensor = slice(0, indices.numel())
        feat_lengths = lengths
    else:
        pooled = torch.stack([grad[:, cols[f] : cols[f] + space.dim] for f in feats])
        nnz = torch.cat(
            [
                torch.arange(
                    int(offsets[f * num_bags]), int(offsets[(f + 1) * num_bags]), device=device
                )
                for f in feats
            ]
        )
        feat_lengths = torch.cat([lengths[f * num_bags : (f + 1) * num_bags] for f in feats])
    pooled = pooled.reshape(len(feats) * num_bags, space.dim)
    item_bag = torch.repeat_interleave(
        torch.arange(len(feats) * num_bags, device=device),
        feat_lengths,
        output_size=indices.numel() if len(feats) == num_features else None,
    )
    if item_bag.numel() == 0:
        return None
    rows = indices[nnz].to(torch.int64) + row_offset[item_bag // num_bags]
    contrib = pooled[item_bag]
    scale = None
    if per_sample_weights is not None:
        scale = per_sample_weights[nnz].to(grad.dtype)
    if pooling == "mean":
        inv_len = 1.0 / feat_lengths[item_bag].to(grad.dtype)
        scale = inv_len if scale is None else scale * inv_len
    if scale is not None:
        contrib = contrib * scale[:, None]
    return rows, item_bag % num_bags, contrib, True


@dataclass
class _Call:
    indices: torch.Tensor
    offsets: torch.Tensor
    per_sample_weights: torch.Tensor | None
    leaf: torch.Tensor


class LookupCapture:
    """Forward hook that defers a lookup's backward: see the module docstring.

    ``layout`` maps features to tables; ``weighted``: whether the lookup takes per-sample
    weights (replays must pass ones). The hook is active only while the module is training,
    grad mode is on and the capture is not :meth:`paused`. Call :meth:`take` after the backward
    of every captured forward.
    """

    def __init__(
        self,
        module: nn.Module,
        layout: LookupLayout,
        pooling: Pooling = "sum",
        groups_per_call: int = 1,
        weighted: bool = False,
    ) -> None:
        self.layout = layout
        self.pooling: Pooling = pooling
        self.groups_per_call = groups_per_call
        self.weighted = weighted
        #: Fill :attr:`RowGrads.counts` (CowClip's sample counts: a bincount per call).
        self.count_ids = True
        #: The caller's word that every bag holds one id (see :func:`pooled_grad_to_rows`).
        self.one_hot: bool | None = None
        #: Reduce by a sort into padded buffers of a size known in advance (no read-back: see
        #: the module doc); the sparse optimizer sets it where it merges the groups at the step.
        self.static_size = False
        self._calls: list[_Call] = []
        self._paused = False
        self._handle = module.register_forward_hook(self._hook, with_kwargs=True)

    def remove(self) -> None:
        self._handle.remove()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Let the lookup run with its own autograd (used to replay the fused update)."""
        prev, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = prev

    @property
    def pending(self) -> int:
        return len(self._calls)

    def _hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        if self._paused or not module.training or not torch.is_grad_enabled():
            return None
        names = ("indices", "offsets", "per_sample_weights")
        bound = dict(zip(names, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        leaf = output.detach().requires_grad_(True)
        self._calls.append(
            _Call(bound["indices"], bound["offsets"], bound.get("per_sample_weights"), leaf)
        )
        return leaf

    def take(self) -> list[list[RowGrads]]:
        """Row gradients of every captured call since the last take (per call, per space)."""
        calls, self._calls = self._calls, []
        out = []
        for call in calls:
            grad = call.leaf.grad
            if grad is None:  # the output did not reach the loss: all-zero gradient
                grad = torch.zeros_like(call.leaf)
            out.append(
                pooled_grad_to_rows(
                    call.indices,
                    call.offsets,
                    call.per_sample_weights,
                    grad,
                    self.layout,
                    self.pooling,
                    self.groups_per_call,
                    count_ids=self.count_ids,
                    one_hot=self.one_hot,
                    static_size=self.static_size,
                )
            )
        return out
