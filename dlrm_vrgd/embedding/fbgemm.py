"""Embedding tables on FBGEMM's table-batched-embedding (TBE) kernels, updated once per global step.

:class:`FbgemmEmbeddingBagCollection` is a drop-in for torchrec's ``EmbeddingBagCollection``
(``forward(KeyedJaggedTensor) -> KeyedTensor``, ``embedding_bag_configs()``) backed by one
``SplitTableBatchedEmbeddingBagsCodegen`` with a fused optimizer (EXACT_ROWWISE_ADAGRAD,
EXACT_ADAGRAD or EXACT_SGD). Its lookups are captured
(:class:`~dlrm_vrgd.embedding.capture.LookupCapture`) so that ``A`` micro-batches make one
optimizer step, not ``A``: the row gradients are accumulated by the sparse optimizer and applied
by :func:`replay_rows`, which runs the TBE forward and backward once more on the touched rows
only — one row per bag, output gradient = the row gradient — so that FBGEMM's fused kernel
performs the update itself.

Because every row appears exactly once in the replay, EXACT_ROWWISE_ADAGRAD, EXACT_ADAGRAD and
EXACT_SGD produce exactly the update they would have made on the whole global batch at once.
EXACT_ADAGRAD (``adagrad``, MLPerf DLRMv2's table optimizer) keeps one Adagrad sum per weight
element: ``s += g⊙g``, ``w −= lr·g/(√s + ε)`` (ε outside the root, as FBGEMM's kernel).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from dlrm_vrgd.embedding.capture import LookupCapture, LookupLayout, Pooling, RowSpace
from dlrm_vrgd.embedding.init import table_init
from dlrm_vrgd.embedding.views import RowSpaceView
from dlrm_vrgd.malloc import released

logger = logging.getLogger(__name__)

#: ``model.embedding_precision`` -> FBGEMM's ``weights_precision``.
WEIGHTS_PRECISION: dict[str, SparseType] = {"fp32": SparseType.FP32, "fp16": SparseType.FP16}

FUSED_OPTIMIZERS: dict[str, EmbOptimType] = {
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "sgd": EmbOptimType.EXACT_SGD,
}

#: The fused optimizer's name (``FUSED_OPTIMIZERS``'s key) of each kernel.
KERNEL_NAMES: dict[EmbOptimType, str] = {v: k for k, v in FUSED_OPTIMIZERS.items()}


def kernel_name(tbe: SplitTableBatchedEmbeddingBagsCodegen) -> str:
    """``rowwise_adagrad``, ``adagrad`` or ``sgd``: the update ``tbe``'s fused kernel makes."""
    try:
        return KERNEL_NAMES[tbe.optimizer]
    except KeyError:
        raise ValueError(
            f"a TBE with optimizer {tbe.optimizer.name}: the sparse optimizer replays "
            f"{sorted(FUSED_OPTIMIZERS)} only"
        ) from None


def replay_rows(
    tbe: SplitTableBatchedEmbeddingBagsCodegen,
    capture: LookupCapture,
    rows: list[torch.Tensor],
    grads: list[torch.Tensor],
    lr: float,
    chunk_rows: int = 65_536,
) -> None:
    """Apply ``grads[t]`` (U_t x D_t) to rows ``rows[t]`` (U_t, unique) of every table through
    the TBE's fused optimizer at learning rate ``lr`` — the general route.

    Each table's rows go through the first feature that maps to it, one row per bag; the other
    features get empty bags, so the call's output is ``max_t U_t x ΣD`` (padded). Calls carry
    at most ``chunk_rows`` bags.
    """
    feature_table = capture.layout.feature_table
    num_features = len(feature_table)
    first_feature = {t: feature_table.index(t) for t in set(feature_table)}
    col = [0]
    for t in feature_table:
        col.append(col[-1] + capture.layout.table_dims[t])
    most = max((r.numel() for r in rows), default=0)
    if most == 0:
        return
    tbe.set_learning_rate(lr)
    device = rows[0].device
    bags = min(chunk_rows, most)
    for start in released(range(0, most, bags)):
        lengths = torch.zeros(num_features, bags, dtype=torch.int64, device=device)
        per_feature: list[torch.Tensor | None] = [None] * num_features
        grad_out = torch.zeros(bags, col[-1], dtype=torch.float32, device=device)
        for t, f in first_feature.items():
            part = rows[t][start : start + bags]
            if part.numel() == 0:
                continue
            n = part.numel()
            lengths[f, :n] = 1
            per_feature[f] = part
            grad_out[:n, col[f] : col[f + 1]] = grads[t][start : start + n]
        indices = torch.cat([p for p in per_feature if p is not None])
        offsets = torch.zeros(num_features * bags + 1, dtype=torch.int64, device=device)
        torch.cumsum(lengths.view(-1), 0, out=offsets[1:])
        weights = torch.ones(indices.numel(), device=device) if capture.weighted else None
        with capture.paused():
            out = tbe(indices, offsets, per_sample_weights=weights)
            out.backward(grad_out)
        del out, grad_out, indices, offsets, weights, per_feature, lengths  # see released()


def _placements(
    tbe: SplitTableBatchedEmbeddingBagsCodegen, prefix: str, layout: LookupLayout
) -> tuple[list[int], list[int]]:
    """``(placement, start element)`` of every table in the ``prefix`` buffers (``weights``,
    ``momentum1``), as ``split_embedding_weights`` reads them (older FBGEMM: per feature)."""
    placements = getattr(tbe, f"{prefix}_physical_placements", None)
    offsets = getattr(tbe, f"{prefix}_physical_offsets", None)
    if placements is None or offsets is None:
        first = [layout.feature_table.index(t) for t in range(len(layout.table_dims))]
        per_feature_p = getattr(tbe, f"{prefix}_placements")
        per_feature_o = getattr(tbe, f"{prefix}_offsets")
        placements = [per_feature_p[f] for f in first]
        offsets = [per_feature_o[f] for f in first]
    return [int(p) for p in placements], [int(o) for o in offsets]


def _buffer(
    tbe: SplitTableBatchedEmbeddingBagsCodegen, prefix: str, placement: int
) -> torch.Tensor:
    if placement == EmbeddingLocation.DEVICE:
        return getattr(tbe, f"{prefix}_dev")
    if placement == EmbeddingLocation.HOST:
        return getattr(tbe, f"{prefix}_host")
    if placement == EmbeddingLocation.MANAGED:
        return getattr(tbe, f"{prefix}_uvm")
    raise ValueError(
        f"tables in {EmbeddingLocation(placement).name} memory: its cache holds rows its buffer "
        "does not, and a row-wise GSNR or CowClip step reads and writes the rows themselves; "
        "place the tables in DEVICE, HOST or MANAGED memory (torchrec's `fused` kernel)"
    )


def row_space_view(
    tbe: SplitTableBatchedEmbeddingBagsCodegen, layout: LookupLayout, space: RowSpace
) -> RowSpaceView | None:
    """The :class:`~dlrm_vrgd.embedding.views.RowSpaceView` of ``space`` over ``tbe``'s own
    buffers, whatever their placement; None where its tables are not all in one buffer."""
    w_place, w_start = _placements(tbe, "weights", layout)
    places = {w_place[t] for t in space.tables}
    states = None
    s_start: list[int] | None = None
    if tbe.optimizer != EmbOptimType.EXACT_SGD:
        m_place, m_off = _placements(tbe, "momentum1", layout)
        places |= {m_place[t] for t in space.tables}
        s_start = [m_off[t] for t in space.tables]
    if EmbeddingLocation.MANAGED_CACHING in places:
        _buffer(tbe, "weights", EmbeddingLocation.MANAGED_CACHING)  # raises: says why
    if len(places) != 1:
        return None
    weights = _buffer(tbe, "weights", w_place[space.tables[0]])
    if s_start is not None:
        states = _buffer(tbe, "momentum1", m_place[space.tables[0]])
    return RowSpaceView(
        space,
        weights,
        [w_start[t] for t in space.tables],
        states,
        s_start,
        elementwise=tbe.optimizer == EmbOptimType.EXACT_ADAGRAD,
    )


class TableLoopView(RowSpaceView):
    """The interface of :class:`~dlrm_vrgd.embedding.views.RowSpaceView` over a row space whose
    tables are in several buffers (e.g. some on the GPU, some in managed memory): every op loops
    over the tables (a mask and a host sync each). Correct everywhere; slow, and logged once."""

    def __init__(self, space: RowSpace, lookup: TBELookup) -> None:  # noqa: D107
        self.space = space
        self.dim = space.dim
        self.device = lookup.device
        self.weights = None
        self.states = None
        self.salt = 0
        self._lookup = lookup
        self._bounds = torch.tensor(space.offsets[1:-1], dtype=torch.int64, device=self.device)
        logger.warning(
            "tables %s share dim %d but not one buffer: their row-wise steps loop over them",
            [lookup.table_names[t] for t in space.tables],
            space.dim,
        )

    @property
    def has_states(self) -> bool:
        return self._lookup.kernel != "sgd"

    def _parts(self, rows: torch.Tensor, tensors: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        ix = self.table_index(rows)
        for i, t in enumerate(self.space.tables):
            sel = (ix == i).nonzero().squeeze(1)
            yield sel, rows[sel] - self.space.offsets[i], tensors[t]

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.numel(), self.dim, device=rows.device)
        for sel, local, w in self._parts(rows, self._lookup.table_weights()):
            out[sel] = w.index_select(0, local).float()
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self._lookup.table_weights()[self.space.tables[0]].dtype

    def add_(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.put_(rows, self.gather(rows) + values)

    def put_(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        values = self._stored(rows, values)
        for sel, local, w in self._parts(rows, self._lookup.table_weights()):
            w.index_copy_(0, local, values[sel])

    @property
    def elementwise(self) -> bool:  # type: ignore[override]
        return self._lookup.kernel == "adagrad"

    def _state_tables(self) -> list[torch.Tensor]:
        """Per table: ``rows`` (row-wise) or ``rows x dim`` (element-wise) states."""
        states = self._lookup.row_states()
        return states if self.elementwise else [s.reshape(-1) for s in states]

    def gather_states(self, rows: torch.Tensor) -> torch.Tensor | None:
        if not self.has_states:
            return None
        shape = (rows.numel(), self.dim) if self.elementwise else (rows.numel(),)
        out = torch.empty(shape, device=rows.device)
        for sel, local, st in self._parts(rows, self._state_tables()):
            out[sel] = st.index_select(0, local).float()
        return out

    def put_states_(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        for sel, local, st in self._parts(rows, self._state_tables()):
            st.index_copy_(0, local, values[sel].to(st.dtype))


def space_buffers(
    tbe: SplitTableBatchedEmbeddingBagsCodegen, layout: LookupLayout, space: RowSpace
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Views ``(weights: size x dim, states: size, size x dim for EXACT_ADAGRAD, or None for
    SGD)`` of ``space``'s
    consecutive tables in ``tbe``'s host memory, indexed by global row of the space; None
    where the tables are not consecutive or the weights live on the device."""
    if tbe.weights_host.numel() == 0:
        return None
    view = row_space_view(tbe, layout, space)
    if view is None or view.weights is None:
        return None
    if tbe.optimizer == EmbOptimType.EXACT_SGD:
        return view.weights, None
    if view.states is None:
        return None
    return view.weights, view.states


#: The TBE's keyword that lets a new TBE share existing host buffers (FBGEMM 1.7.0 and later).
HOST_BUFFERS_KEYWORD = "preallocated_host_buffers"


@functools.cache
def takes_host_buffers(tbe_class: type) -> bool:
    """Whether ``tbe_class``'s constructor has FBGEMM's ``preallocated_host_buffers`` keyword
    (it arrived in FBGEMM 1.7.0; 1.6.0 raises TypeError on it). Read from the signature, once
    per class: no version string is parsed. A ``**kwargs`` catch-all does not count."""
    try:
        params = inspect.signature(tbe_class.__init__).parameters
    except (TypeError, ValueError):  # no readable signature: assume the older API
        params = {}
    found = HOST_BUFFERS_KEYWORD in params
    if not found:
        logger.warning(
            "this FBGEMM's TBE (%s.%s) has no %s (FBGEMM < 1.7.0): CPU tables are updated "
            "through the general replay, not one view per row space",
            tbe_class.__module__,
            tbe_class.__qualname__,
            HOST_BUFFERS_KEYWORD,
        )
    return found


def space_view(
    tbe: SplitTableBatchedEmbeddingBagsCodegen, layout: LookupLayout, space: RowSpace
) -> SplitTableBatchedEmbeddingBagsCodegen | None:
    """A one-table TBE over the weights and optimizer state of ``space``'s tables,
    sharing ``tbe``'s host buffers (FBGEMM's ``preallocated_host_buffers``): an update through
    it *is* an update of ``tbe``. Its single table is the row space, so global row ``i`` of the
    space is its row ``i``. None where the tables are not consecutive in host memory, or where
    the installed FBGEMM lacks the keyword (:func:`takes_host_buffers`; before 1.7.0): the
    general :func:`replay_rows` then applies."""
    views = space_buffers(tbe, layout, space)
    if views is None or not takes_host_buffers(SplitTableBatchedEmbeddingBagsCodegen):
        return None
    weights, states = views
    buffers = {"weights": weights.view(-1)}
    if states is not None:
        buffers["momentum1"] = states.view(-1)
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(space.size, space.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=tbe.optimizer,
        learning_rate=tbe.get_learning_rate(),
        eps=tbe.optimizer_args.eps,
        pooling_mode=PoolingMode.SUM,
        weights_precision=tbe.weights_precision,
        preallocated_host_buffers=buffers,
    )


def replay_space(
    view: SplitTableBatchedEmbeddingBagsCodegen,
    rows: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    chunk_rows: int = 65_536,
) -> None:
    """Apply ``grads`` (U x D) to global rows ``rows`` (U, unique) of a :func:`space_view`:
    one feature, one row per bag, output ``U x D`` — no padding."""
    view.set_learning_rate(lr)
    for start in released(range(0, rows.numel(), chunk_rows)):
        part = rows[start : start + chunk_rows]
        offsets = torch.arange(part.numel() + 1, dtype=torch.int64, device=part.device)
        view(part, offsets).backward(grads[start : start + chunk_rows])


class TBELookup:
    """One FBGEMM TBE as a row-wise lookup of the sparse optimizer
    (:class:`~dlrm_vrgd.optim.sparse.SparseRowwiseOptimizer`): its lookups are captured (so its
    fused backward never runs during training) and its rows are updated once per step by replay
    through its own fused kernel.

    Works on any TBE — ours, or a shard that torchrec's DistributedModelParallel built — whose
    tables are described by ``tbe.feature_table_map`` and ``tbe.embedding_specs``. A sharded
    table's owner receives the bags of every rank, rank after rank: ``groups_per_call`` is then
    the number of source ranks.
    """

    def __init__(
        self,
        tbe: SplitTableBatchedEmbeddingBagsCodegen,
        table_names: list[str],
        *,
        weighted: bool = False,
        groups_per_call: int = 1,
    ) -> None:
        specs = list(tbe.embedding_specs)
        if len(table_names) != len(specs):
            raise ValueError(f"{len(table_names)} names for {len(specs)} tables")
        self.tbe = tbe
        self.table_names = list(table_names)
        self.table_rows = [int(spec[0]) for spec in specs]
        layout = LookupLayout.of(
            list(tbe.feature_table_map), [int(spec[1]) for spec in specs], self.table_rows
        )
        pooling: Pooling = "mean" if tbe.pooling_mode == PoolingMode.MEAN else "sum"
        self.capture = LookupCapture(tbe, layout, pooling, groups_per_call, weighted)
        self._replays: list[SplitTableBatchedEmbeddingBagsCodegen | None] = []
        self._spaces: list[RowSpaceView] = []
        self._key: tuple[int, ...] = ()

    @property
    def device(self) -> torch.device:
        return self.tbe.current_device

    @property
    def kernel(self) -> str:
        """``rowwise_adagrad``, ``adagrad`` (element-wise) or ``sgd`` (:func:`kernel_name`)."""
        return kernel_name(self.tbe)

    @property
    def eps(self) -> float:
        return float(self.tbe.optimizer_args.eps)

    def _buffers_key(self) -> tuple[int, ...]:
        """Where the TBE's buffers are now (views are rebuilt when they move)."""
        names = ("weights_dev", "weights_host", "weights_uvm")
        if self.kernel != "sgd":
            names += ("momentum1_dev", "momentum1_host", "momentum1_uvm")
        return tuple(getattr(self.tbe, n).data_ptr() for n in names)

    def _refresh(self) -> None:
        key = self._buffers_key()
        if key == self._key:
            return
        layout = self.capture.layout
        self._spaces = [
            row_space_view(self.tbe, layout, sp) or TableLoopView(sp, self) for sp in layout.spaces
        ]
        self._replays = [space_view(self.tbe, layout, sp) for sp in layout.spaces]
        self._key = key

    def space_views(self) -> list[RowSpaceView]:
        """One view per row space over the TBE's own buffers (:func:`row_space_view`; a
        per-table loop, :class:`TableLoopView`, where a space's tables are in several)."""
        self._refresh()
        return self._spaces

    def apply_rows(
        self, rows: list[torch.Tensor], grads: list[torch.Tensor], lr: float, chunk_rows: int
    ) -> None:
        """Update global rows ``rows[s]`` of row space ``s`` by ``grads[s]`` through the fused
        kernel (see :func:`space_view`; :func:`replay_rows` where no view applies)."""
        self._refresh()
        layout = self.capture.layout
        general_rows = [torch.zeros(0, dtype=torch.int64, device=self.device)] * len(
            layout.table_dims
        )
        general_grads = [torch.zeros(0, d, device=self.device) for d in layout.table_dims]
        general = False
        for space, view, replay, r, g in zip(
            layout.spaces, self._spaces, self._replays, rows, grads, strict=True
        ):
            if replay is not None:
                replay_space(replay, r, g, lr, chunk_rows)
                continue
            if r.numel() == 0:
                continue
            general = True
            # the space's rows by table: one sort, and one read-back of the tables' counts
            ix = view.table_index(r)
            order = torch.argsort(ix, stable=True)
            counts = torch.bincount(ix, minlength=len(space.tables)).tolist()
            local = r[order] - torch.tensor(space.offsets[:-1], device=r.device)[ix[order]]
            for t, part, grad in zip(
                space.tables, local.split(counts), g[order].split(counts), strict=True
            ):
                general_rows[t], general_grads[t] = part, grad
        if general:
            replay_rows(self.tbe, self.capture, general_rows, general_grads, lr, chunk_rows)

    def table_weights(self) -> list[torch.Tensor]:
        """Views of the weights, one ``rows x dim`` tensor per table."""
        return list(self.tbe.split_embedding_weights())

    def row_states(self) -> list[torch.Tensor]:
        """The Adagrad sums of squares per table: ``rows`` (row-wise), ``rows x dim``
        (EXACT_ADAGRAD: element-wise) or empty tensors (SGD)."""
        if self.tbe.optimizer == EmbOptimType.EXACT_SGD:
            return [torch.zeros(0) for _ in self.table_names]
        return [s[0] for s in self.tbe.split_optimizer_states()]


class FbgemmEmbeddingBagCollection(nn.Module):
    """A torchrec-compatible embedding-bag collection on one FBGEMM TBE (see module doc).

    Args:
        tables: torchrec table configs; all features of the input KJT, in this order.
        optimizer: ``"rowwise_adagrad"`` (EXACT_ROWWISE_ADAGRAD), ``"adagrad"`` (EXACT_ADAGRAD:
            one sum per weight element) or ``"sgd"`` (EXACT_SGD).
        lr, eps: fused optimizer hyper-parameters (the LR is reset at every step).
        is_weighted: whether the input KJT carries per-id weights.
        device: ``cpu`` or ``cuda``.
        seed: weights are drawn by :func:`table_init` (``None``: from the global RNG).
        precision: how the weights are stored: ``"fp32"`` or ``"fp16"`` (FBGEMM's
            ``weights_precision``; the Adagrad sums stay float32, the lookups' output
            and its gradients float32, and the fused kernels round their writes
            stochastically).
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        optimizer: str = "rowwise_adagrad",
        lr: float = 0.01,
        eps: float = 1e-8,
        is_weighted: bool = False,
        device: torch.device | str = "cpu",
        seed: int | None = None,
        precision: str = "fp32",
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("at least one embedding table is required")
        if precision not in WEIGHTS_PRECISION:
            raise ValueError(f"precision must be one of {sorted(WEIGHTS_PRECISION)}: {precision!r}")
        if optimizer not in FUSED_OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(FUSED_OPTIMIZERS)}: {optimizer!r}")
        poolings = {t.pooling for t in tables}
        if len(poolings) != 1 or not poolings <= {PoolingType.SUM, PoolingType.MEAN}:
            raise ValueError("all tables must share SUM or MEAN pooling")
        pooling = PoolingMode.SUM if tables[0].pooling == PoolingType.SUM else PoolingMode.MEAN
        device = torch.device(device)
        self._configs = list(tables)
        self._is_weighted = is_weighted
        self.feature_names = [f for t in tables for f in t.feature_names]
        on_gpu = device.type == "cuda"
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [
                (
                    t.num_embeddings,
                    t.embedding_dim,
                    EmbeddingLocation.DEVICE if on_gpu else EmbeddingLocation.HOST,
                    ComputeDevice.CUDA if on_gpu else ComputeDevice.CPU,
                )
                for t in tables
            ],
            feature_table_map=[i for i, t in enumerate(tables) for _ in t.feature_names],
            optimizer=FUSED_OPTIMIZERS[optimizer],
            learning_rate=lr,
            eps=eps,
            pooling_mode=pooling,
            device=device,
            weights_precision=WEIGHTS_PRECISION[precision],
        )
        with torch.no_grad():
            for i, (t, w) in enumerate(
                zip(tables, self.tbe.split_embedding_weights(), strict=True)
            ):
                if seed is None:
                    bound = math.sqrt(1.0 / t.num_embeddings)
                    w.uniform_(-bound, bound)
                else:
                    w.copy_(table_init(seed, i, t.num_embeddings, t.embedding_dim))
        self.lookup = TBELookup(self.tbe, [t.name for t in tables], weighted=is_weighted)
        self._length_per_key = [t.embedding_dim for t in tables for _ in t.feature_names]

    # -- torchrec EmbeddingBagCollection interface --------------------------------------
    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """``features``: KJT ``[F x B x L]`` → KeyedTensor ``B x ΣD`` (pooled per feature)."""
        if features.keys() != self.feature_names:
            features = features.permute([features.keys().index(k) for k in self.feature_names])
        weights = features.weights() if self._is_weighted else None
        pooled = self.tbe(features.values(), features.offsets(), per_sample_weights=weights)
        return KeyedTensor(
            keys=self.feature_names, length_per_key=self._length_per_key, values=pooled
        )

    # -- for the sparse optimizer and for tests -----------------------------------------
    def lookups(self) -> list[TBELookup]:
        return [self.lookup]

    @property
    def capture(self) -> LookupCapture:
        return self.lookup.capture

    def table_weights(self) -> list[torch.Tensor]:
        return self.lookup.table_weights()

    def row_states(self) -> list[torch.Tensor]:
        return self.lookup.row_states()
