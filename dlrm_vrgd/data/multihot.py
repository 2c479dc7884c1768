"""Multi-hot categorical features: fixed bag sizes per table, MLPerf DLRMv2's synthesis of
multi-hot ids from one-hot ids, and the static KeyedJaggedTensor layout of a multi-hot batch.

**Rows.** With ``data.multi_hot_sizes`` = ``(s_0, .., s_{T-1})`` a row holds ``L = Σ s_k`` ids:
a source's ``sparse`` is ``N x L``, the ``s_0`` ids of table 0's bag first, then table 1's, and
so on (:class:`BagLayout`). Rows made by the synthesis stay one-hot (``N x T``, with
:attr:`~dlrm_vrgd.data.rows.Rows.hot` set) while :class:`~dlrm_vrgd.data.batch.TrainStream`
slices, joins and shards them for the input pipeline, and become multi-hot where the
micro-batch is filled.

**Batches.** A multi-hot micro-batch's ids are in the KJT's order (table-major): table 0's
``B x s_0`` bags row by row, then table 1's, ..., one flat ``B·L`` array (the pinned int32 slot,
the copy to the GPU, :attr:`~dlrm_vrgd.data.batch.Batch.sparse`). :func:`batch_ids` writes
them there: the synthesis one ``take`` a table straight into its block, stored ``N x L`` rows
one block copy a table. The bag sizes do not change from batch to batch, so the
KeyedJaggedTensor's lengths, offsets and per-key lengths are made once per micro-batch size and
device (:meth:`BagLayout.parts`), and :meth:`BagLayout.kjt` takes the ids as they are (no
reorder, no host sync).

**Synthesis** (MLPerf's ``Multihot`` and ``materialize_synthetic_multihot_dataset.py``,
``mlcommons/training`` ``recommendation_v2/torchrec_dlrm``, uniform distribution): with numpy's
legacy generator seeded 0, table ``k`` of ``n_k`` rows draws ``randint(0, n_k, (n_k, s_k - 1))``
in table order; the bag of one-hot id ``x`` is ``[x, draws[x]]``. The same ids come out here,
row for row (``tests/data/test_multihot_mlperf.py`` runs MLPerf's own code beside this).
:class:`MultiHotTables` draws the same stream in chunks straight into int32 (the values are
identical to MLPerf's int64 draws cast to int32) and stores the ``s_k - 1`` drawn columns only.
At MLPerf's caps that is 5.8e9 ids (23 GB); ``cache_dir`` keeps them in ``.npy`` files that
every rank and worker of a host memory-maps (made once, by whichever process comes first).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.lib.format import open_memmap

from dlrm_vrgd.data.rows import Rows, RowSource

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

logger = logging.getLogger(__name__)

#: MLPerf DLRMv2's bag sizes (``--multi_hot_sizes``): 214 ids a row.
MLPERF_MULTI_HOT_SIZES = tuple(
    int(s) for s in "3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1".split(",")
)
#: MLPerf DLRMv2's table sizes (``--num_embeddings_per_feature``).
MLPERF_NUM_EMBEDDINGS = tuple(
    int(s)
    for s in (
        "40000000,39060,17295,7424,20265,3,7122,1543,63,40000000,3067956,405282,10,2209,"
        "11938,155,4,976,14,40000000,40000000,40000000,590152,12973,108,36"
    ).split(",")
)
#: MLPerf seeds its lookup tables with ``np.random.seed(0)``.
MLPERF_SEED = 0
#: Rows of a lookup table drawn at a time (bounds the transient memory of a draw).
DRAW_ROWS = 1 << 20


# ------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class BagLayout:
    """Fixed bag sizes ``sizes`` (one per table, each ≥ 1) of a multi-hot row ``N x L``."""

    sizes: tuple[int, ...]
    _cache: dict[tuple[int, str], BagParts] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )
    _lock: threading.Lock = field(
        default_factory=threading.Lock, compare=False, hash=False, repr=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"bag sizes must be at least 1, got {list(self.sizes)}")

    @property
    def num_tables(self) -> int:
        return len(self.sizes)

    @property
    def width(self) -> int:
        """``L``: ids a row."""
        return sum(self.sizes)

    @property
    def columns(self) -> np.ndarray:
        """``T + 1`` column offsets: table ``k``'s bag is columns ``[c_k, c_{k+1})``."""
        return np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    def parts(self, rows: int, device: torch.device | str = "cpu") -> BagParts:
        """The static KJT parts of a ``rows``-row batch on ``device`` (made once, then
        reused)."""
        key = (rows, str(torch.device(device)))
        with self._lock:
            got = self._cache.get(key)
            if got is None:
                got = self._cache[key] = BagParts.make(self.sizes, rows, torch.device(device))
            return got

    def rows_of(self, sparse: torch.Tensor) -> int:
        """``B`` of a batch's ids: ``B·L`` table-major (1-d) or ``B x L`` rows (2-d)."""
        if sparse.dim() == 1 and sparse.numel() % self.width == 0:
            return sparse.numel() // self.width
        if sparse.dim() == 2 and sparse.shape[1] == self.width:
            return sparse.shape[0]
        raise ValueError(
            f"a multi-hot batch has {self.width} ids a row (bag sizes {list(self.sizes)}), "
            f"got sparse of shape {tuple(sparse.shape)}"
        )

    def values(self, sparse: torch.Tensor) -> torch.Tensor:
        """A batch's ids as KJT values (table by table, row by row): ``B·L`` table-major ids
        (what the input pipeline builds) as they are; ``B x L`` rows reordered (on a GPU one
        gather by the static order, on a CPU one strided block copy a table)."""
        rows = self.rows_of(sparse)
        if sparse.dim() == 1:
            return sparse
        if sparse.device.type != "cpu":
            order = self.parts(rows, sparse.device).order
            return sparse.reshape(-1).index_select(0, order)
        out = torch.empty(rows * self.width, dtype=sparse.dtype)
        self.table_order(sparse.numpy(), out.numpy())
        return out

    def table_order(self, sparse: np.ndarray, out: np.ndarray) -> None:
        """``N x L`` rows ``sparse`` into ``out`` (``N·L``) in table order: one strided block
        copy a table (ids cast to ``out``'s dtype unchecked)."""
        rows = sparse.shape[0]
        cols = self.columns.tolist()
        for k, size in enumerate(self.sizes):
            a = rows * cols[k]
            np.copyto(
                out[a : a + rows * size].reshape(rows, size),
                sparse[:, cols[k] : cols[k + 1]],
                casting="unsafe",
            )

    def kjt(self, sparse: torch.Tensor, keys: list[str]) -> KeyedJaggedTensor:
        """``sparse`` (``B·L`` table-major, or ``B x L`` rows: :meth:`values`) as a
        KeyedJaggedTensor ``[T x B x s_k]`` whose lengths, offsets and per-key figures are the
        static :meth:`parts` (no host sync)."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        if len(keys) != self.num_tables:
            raise ValueError(f"{len(keys)} keys for {self.num_tables} tables")
        rows = self.rows_of(sparse)
        p = self.parts(rows, sparse.device)
        return KeyedJaggedTensor(
            keys=keys,
            values=self.values(sparse),
            lengths=p.lengths,
            offsets=p.offsets,
            stride=rows,
            length_per_key=p.length_per_key,
            offset_per_key=p.offset_per_key,
        )


@dataclass(frozen=True)
class BagParts:
    """What every ``B``-row multi-hot batch shares: ``lengths`` (T·B int64, ``s_k`` for each
    row of table ``k``), ``offsets`` (T·B + 1), ``order`` (B·L int64: KJT value ``i`` is flat
    id ``order[i]`` of the ``B x L`` batch), ``length_per_key`` / ``offset_per_key``."""

    lengths: torch.Tensor
    offsets: torch.Tensor
    order: torch.Tensor
    length_per_key: list[int]
    offset_per_key: list[int]

    @staticmethod
    def make(sizes: Sequence[int], rows: int, device: torch.device) -> BagParts:
        s = np.asarray(sizes, dtype=np.int64)
        width = int(s.sum())
        columns = np.concatenate([[0], np.cumsum(s)[:-1]])
        lengths = np.repeat(s, rows)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        # table k, row r, slot j  ->  r·L + c_k + j
        order = np.concatenate(
            [
                (np.arange(rows)[:, None] * width + c + np.arange(n)[None, :]).reshape(-1)
                for c, n in zip(columns.tolist(), s.tolist(), strict=True)
            ]
        )
        per_key = (s * rows).tolist()
        return BagParts(
            lengths=torch.from_numpy(lengths).to(device),
            offsets=torch.from_numpy(offsets).to(device),
            order=torch.from_numpy(order).to(device),
            length_per_key=per_key,
            offset_per_key=[0, *np.cumsum(per_key).tolist()],
        )


# --------------------------------------------------------------------------- synthesis
def _digest(rows: Sequence[int], sizes: Sequence[int]) -> str:
    text = f"mlperf-uniform seed={MLPERF_SEED} rows={list(rows)} sizes={list(sizes)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class MultiHotTables:
    """MLPerf's one-hot → multi-hot lookup tables (module docstring) for tables of
    ``rows_per_table`` rows and bags of ``sizes``.

    ``draws[k]`` is ``n_k x (s_k - 1)`` int32 (None where ``s_k = 1``); :meth:`expand` maps
    one-hot ids to bags. ``cache_dir``: keep the draws in ``.npy`` files there and memory-map
    them (a second process, or run, maps what the first drew)."""

    def __init__(
        self,
        rows_per_table: Sequence[int],
        sizes: Sequence[int],
        cache_dir: str | Path | None = None,
    ) -> None:
        self.rows = [int(n) for n in rows_per_table]
        self.layout = BagLayout(tuple(sizes))
        if len(self.rows) != self.layout.num_tables:
            raise ValueError(
                f"{len(self.layout.sizes)} bag sizes for {len(self.rows)} tables; give one a table"
            )
        if min(self.rows) < 1 or max(self.rows) > 2**31 - 1:
            raise ValueError("tables must have 1 to 2^31 - 1 rows (ids are drawn as int32)")
        self.draws = self._load(Path(cache_dir)) if cache_dir is not None else self._draw(None)

    def _draw(self, folder: Path | None) -> list[np.ndarray | None]:
        """The legacy ``RandomState(0)`` stream, table by table, chunk by chunk."""
        rng = np.random.RandomState(MLPERF_SEED)
        out: list[np.ndarray | None] = []
        for k, (n, s) in enumerate(zip(self.rows, self.layout.sizes, strict=True)):
            if s == 1:
                rng.randint(0, n, size=(n, 0))  # what MLPerf's call draws: nothing
                out.append(None)
                continue
            if folder is None:
                arr = np.empty((n, s - 1), dtype=np.int32)
            else:
                arr = open_memmap(folder / f"table_{k}.npy", "w+", np.int32, (n, s - 1))
            for a in range(0, n, DRAW_ROWS):
                b = min(n, a + DRAW_ROWS)
                arr[a:b] = rng.randint(0, n, size=(b - a, s - 1), dtype=np.int32)
            out.append(arr)
        return out

    def _load(self, cache: Path) -> list[np.ndarray | None]:
        folder = cache / f"multi_hot-{_digest(self.rows, self.layout.sizes)}"
        if not (folder / "complete").is_file():
            cache.mkdir(parents=True, exist_ok=True)
            staging = cache / f".{folder.name}.partial-{os.getpid()}"
            staging.mkdir()
            try:
                logger.info("multi-hot: drawing MLPerf's lookup tables into %s", folder)
                for arr in self._draw(staging):
                    if arr is not None:
                        arr.flush()  # type: ignore[attr-defined]
                (staging / "complete").write_text("")
                try:
                    staging.rename(folder)
                except OSError:  # another process finished first: use its tables
                    pass
            finally:
                if staging.exists():
                    import shutil

                    shutil.rmtree(staging, ignore_errors=True)
        out: list[np.ndarray | None] = []
        for k, (n, s) in enumerate(zip(self.rows, self.layout.sizes, strict=True)):
            if s == 1:
                out.append(None)
                continue
            arr = np.load(folder / f"table_{k}.npy", mmap_mode="r")
            if arr.shape != (n, s - 1) or arr.dtype != np.int32:
                raise ValueError(f"{folder}/table_{k}.npy: {arr.dtype} {arr.shape}, not the cache")
            out.append(arr)
        return out

    def table(self, k: int) -> np.ndarray:
        """MLPerf's whole lookup table ``k``: ``n_k x s_k`` int32, column 0 the id itself."""
        ids = np.arange(self.rows[k], dtype=np.int32)[:, None]
        d = self.draws[k]
        return ids if d is None else np.concatenate([ids, d], axis=1)

    def bag(self, k: int, ids: np.ndarray) -> np.ndarray:
        """The bags of table ``k`` of one-hot ``ids`` (``N``): ``N x s_k`` int32."""
        out = np.empty((len(ids), self.layout.sizes[k]), dtype=np.int32)
        out[:, 0] = ids
        d = self.draws[k]
        if d is not None:
            out[:, 1:] = d.take(ids, axis=0)
        return out

    def expand(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """One-hot ``ids`` (``N x T``, each in ``[0, n_k)``) to multi-hot rows ``N x L``
        (``out``: int64 by default, or an int32 / int64 array to fill). One gather per table,
        no loop over rows."""
        n, t = ids.shape
        if t != self.layout.num_tables:
            raise ValueError(f"one-hot rows with {t} ids, tables {self.layout.num_tables}")
        if out is None:
            out = np.empty((n, self.layout.width), dtype=np.int64)
        if out.shape != (n, self.layout.width):
            raise ValueError(f"out is {out.shape}, rows need {(n, self.layout.width)}")
        cols = self.layout.columns
        for k in range(t):
            c = int(cols[k])
            x = ids[:, k]
            out[:, c] = x
            d = self.draws[k]
            if d is not None:
                out[:, c + 1 : int(cols[k + 1])] = d.take(x, axis=0)
        return out

    def expand_tables(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """One-hot ``ids`` (``N x T``, each in ``[0, n_k)``) to their bags in table order,
        written into ``out`` (``N·L`` int32 or int64): table ``k``'s ``N x s_k`` block holds
        row ``r``'s bag in row ``r``, the one-hot id first. One ``take`` a table and one copy
        into the block; the ids per (row, table, position) are :meth:`expand`'s."""
        n, t = ids.shape
        if t != self.layout.num_tables:
            raise ValueError(f"one-hot rows with {t} ids, tables {self.layout.num_tables}")
        if out.shape != (n * self.layout.width,):
            raise ValueError(f"out is {out.shape}, rows need {(n * self.layout.width,)}")
        cols = self.layout.columns.tolist()
        for k in range(t):
            block = out[n * cols[k] : n * cols[k + 1]]
            x = ids[:, k]
            d = self.draws[k]
            if d is None:
                np.copyto(block, x, casting="unsafe")
                continue
            bags = block.reshape(n, cols[k + 1] - cols[k])
            np.copyto(bags[:, 0], x, casting="unsafe")
            bags[:, 1:] = d.take(x, axis=0)
        return out


def batch_ids(rows: Rows, out: np.ndarray) -> None:
    """The multi-hot ids of ``rows`` (``rows.bags`` set) into a micro-batch's ``out``
    (``N·L`` int32 or int64) in table order: made by ``rows.hot`` from one-hot ids, or moved
    from stored ``N x L`` rows. A ValueError for an id outside ``[0, 2^31)`` (int32 wraps)."""
    bags = rows.bags
    assert bags is not None
    ids = rows.sparse
    n = len(rows)
    if ids.shape != (n, bags.num_tables if rows.hot is not None else bags.width):
        raise ValueError(f"multi-hot rows of {bags.width} ids with sparse of shape {ids.shape}")
    if ids.size and (out.dtype == np.int32 or rows.hot is not None):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high > 2**31 - 1:
            raise ValueError(f"ids {low}..{high} do not fit int32 (a table has at most 2^31 rows)")
    if rows.hot is not None:
        rows.hot.expand_tables(ids, out)
    else:
        bags.table_order(ids, out)


# ------------------------------------------------------------------------------- source
class MultiHotSource:
    """A one-hot :class:`~dlrm_vrgd.data.rows.RowSource` whose rows come out multi-hot
    (``sparse`` ``N x L`` int64), made on the fly by :meth:`MultiHotTables.expand`;
    :meth:`read_one_hot` leaves them one-hot for the input pipeline (module docstring)."""

    def __init__(self, base: RowSource, tables: MultiHotTables) -> None:
        if len(base.cardinalities) != tables.layout.num_tables:
            raise ValueError(
                f"{len(tables.layout.sizes)} bag sizes for {len(base.cardinalities)} tables"
            )
        self.base = base
        self.tables = tables
        self.bags = tables.layout
        self.num_rows = base.num_rows
        self.block_rows = base.block_rows
        self.num_dense = base.num_dense
        self.cardinalities = list(tables.rows)

    def read(self, start: int, stop: int) -> Rows:
        return self.read_one_hot(start, stop).materialized()

    def read_one_hot(self, start: int, stop: int) -> Rows:
        """Rows ``[start, stop)`` with their one-hot ids and ``hot`` set: made multi-hot where
        a micro-batch is filled (:func:`batch_ids`)."""
        rows = self.base.read(start, stop)
        bags, hot = self.bags, self.tables
        return Rows(rows.dense, rows.sparse, rows.labels, rows.probs, bags=bags, hot=hot)


def bags_of(source: object) -> BagLayout | None:
    """The bag layout of a row source's rows (None: one-hot)."""
    return getattr(source, "bags", None)
