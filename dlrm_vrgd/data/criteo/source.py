"""Preprocessed Criteo day files as training input: memory-mapped, any row range in O(range).

``dlrm-vrgd preprocess`` (:mod:`dlrm_vrgd.data.criteo.preprocess`) writes ``day_{i}_dense.npy``
(N x 13 float32, transformed), ``day_{i}_sparse.npy`` (N x 26 int64 ids) and
``day_{i}_labels.npy`` (N x 1 int32) plus ``manifest.json``. A directory without the manifest,
or whose files differ from it in size, shape or dtype (or in SHA-256, with
``data.verify_checksums``), is refused: an interrupted or altered conversion is never read.
``dlrm-vrgd generate`` writes the same layout from synthetic data (:mod:`dlrm_vrgd.data.export`),
with the manifest's ``num_dense`` / ``num_sparse`` for its widths and a ``day_{i}_probs.npy``
(N float32 true click probabilities) per day: rows read from days that all have one carry their
probabilities, so evaluations report the oracle AUC as on live synthetic data.

Splits (``data`` section, :class:`~dlrm_vrgd.config.CriteoData`):

* ``train_days``: default every labeled day but the last (a directory preprocessed with
  ``--split``: its train day, and val / test its val and test days);
* ``val_days`` / ``test_days``: default the last labeled day. Where val and test are the same
  days, their rows are divided: the first ``val_fraction`` go to val, the rest to test
  (torchrec's halving of day 23). ``max_val_rows`` / ``max_test_rows`` keep the first rows only.
* ``split: mlperf``: MLPerf DLRMv2's split, whatever the manifest says: train on every labeled
  day but the last; the last is halved, its first ``ceil(N / 2)`` rows validate and the other
  ``floor(N / 2)`` test (``data/multi_hot_criteo.py`` of mlcommons/training's
  ``recommendation_v2``: ``second_half_start_index = len_d0 // 2 + len_d0 % 2``).
* ``max_rows_per_table``: ids become ``id % cap`` when read (torchrec's ``num_embeddings``).

Multi-hot (``data.multi_hot_sizes``; :mod:`dlrm_vrgd.data.multihot`): a day holds either one-hot
ids (``day_{i}_sparse.npy``), made multi-hot as they are read by MLPerf DLRMv2's synthesis, or
MLPerf's materialized ``day_{i}_sparse_multi_hot.npz`` (:mod:`dlrm_vrgd.data.criteo.npz`),
read as it is. Rows then have ``L = Σ s_k`` ids (``sparse`` N x L). A directory without a
manifest that holds MLPerf's files (``day_{i}_dense.npy``, ``day_{i}_labels.npy`` and the npz
or ``day_{i}_sparse.npy`` of each day ``i``) is read as MLPerf's preprocessed set: it records no
table sizes, so ``data.max_rows_per_table`` (MLPerf's ``num_embeddings_per_feature``) must give
them.

A split is the concatenation of its day ranges; :meth:`CriteoSource.read` slices the memory
maps of only the days a range touches. Shuffling (by blocks of ``shuffle_block_rows``) and
rank sharding come from :class:`~dlrm_vrgd.data.batch.TrainStream`, which reads any
``[start, stop)`` of the train source.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dlrm_vrgd.config import NUM_SPARSE, CriteoData
from dlrm_vrgd.data import DataSplits
from dlrm_vrgd.data.criteo.format import NUM_CAT, NUM_INT
from dlrm_vrgd.data.criteo.output import (
    KINDS,
    MANIFEST,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    sha256_file,
)
from dlrm_vrgd.data.multihot import BagLayout, MultiHotSource, MultiHotTables
from dlrm_vrgd.data.rows import Rows, RowSource

logger = logging.getLogger(__name__)

#: Tables must be addressable by int32 row ids.
MAX_TABLE_ROWS = 2**31 - 1


class CriteoDataError(ValueError):
    """A preprocessed directory that cannot be used, or a data config that does not fit it."""


@dataclass(frozen=True)
class Day:
    """One day: memory maps ``dense`` N x 13 float32, ``sparse`` N x 26 int64 (None for a
    multi-hot day), ``labels`` N x 1 int32."""

    index: int
    rows: int
    labeled: bool
    dense: np.ndarray
    sparse: np.ndarray | None
    labels: np.ndarray
    #: N float32 true click probabilities (generated synthetic days only)
    probs: np.ndarray | None = None
    #: a multi-hot day: one N x s_k int32 memory map per table (MLPerf's npz members)
    multi_hot: list[np.ndarray] | None = None

    @property
    def bag_sizes(self) -> tuple[int, ...] | None:
        return None if self.multi_hot is None else tuple(m.shape[1] for m in self.multi_hot)


class CriteoDays:
    """An opened, checked preprocessed directory."""

    def __init__(self, path: str | Path, verify_checksums: bool = False) -> None:
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        #: MLPerf's preprocessed set (no manifest of ours; see the module docstring)
        self.mlperf = not manifest_path.is_file() and (self.path / "day_0_labels.npy").is_file()
        if self.mlperf:
            self.manifest: dict[str, Any] = mlperf_manifest(self.path)
        elif not manifest_path.is_file():
            raise CriteoDataError(
                f"{self.path}: no {MANIFEST}; not the complete output of `dlrm-vrgd preprocess` "
                "(an interrupted run leaves none), nor MLPerf's preprocessed days "
                "(day_0_labels.npy, ...)"
            )
        else:
            try:
                self.manifest = json.loads(manifest_path.read_text())
            except json.JSONDecodeError as err:
                raise CriteoDataError(f"{manifest_path}: not valid JSON: {err}") from None
        m = self.manifest
        if m.get("format") != MANIFEST_FORMAT or m.get("version") != MANIFEST_VERSION:
            raise CriteoDataError(
                f"{manifest_path}: format {m.get('format')!r} version {m.get('version')!r}; "
                f"expected {MANIFEST_FORMAT!r} version {MANIFEST_VERSION}"
            )
        cards = m["sparse"]["cardinalities"]
        #: rows of each table (None: MLPerf's set, which records none)
        self.cardinalities: list[int] | None = None if cards is None else [int(c) for c in cards]
        #: widths of a row: Criteo's 13 and 26 (the manifest's, for generated data)
        self.num_dense = _width(m, "num_dense", NUM_INT, manifest_path)
        self.num_sparse = _width(m, "num_sparse", NUM_CAT, manifest_path)
        if self.cardinalities is not None and len(self.cardinalities) != self.num_sparse:
            raise CriteoDataError(
                f"{manifest_path}: {len(self.cardinalities)} cardinalities for "
                f"{self.num_sparse} tables"
            )
        self.days: list[Day] = [self._open_day(rec, verify_checksums) for rec in m["days"]]

    def _open_day(self, rec: dict[str, Any], verify: bool) -> Day:
        maps = {}
        optional = ("probs", "sparse_multi_hot")
        kinds = [k for k in KINDS if k != "sparse" or "sparse_multi_hot" not in rec["files"]]
        kinds += [k for k in optional if k in rec["files"]]
        for kind in kinds:
            spec = rec["files"][kind]
            path = self.path / spec["file"]
            if not path.is_file():
                raise CriteoDataError(f"{path}: missing (listed in {MANIFEST})")
            size = path.stat().st_size
            if size != spec["bytes"]:
                raise CriteoDataError(
                    f"{path}: {size:,} bytes, the manifest says {spec['bytes']:,} (truncated or "
                    "replaced?)"
                )
            if verify and spec.get("sha256") is not None and sha256_file(path) != spec["sha256"]:
                raise CriteoDataError(f"{path}: SHA-256 differs from the manifest (altered?)")
            if kind == "sparse_multi_hot":
                maps[kind] = self._open_multi_hot(path, spec)
                continue
            try:
                arr = np.load(path, mmap_mode="r")
            except ValueError as err:
                raise CriteoDataError(f"{path}: not a valid npy file: {err}") from None
            if list(arr.shape) != spec["shape"] or arr.dtype.str != spec["dtype"]:
                raise CriteoDataError(
                    f"{path}: {arr.dtype.str} {list(arr.shape)}, the manifest says "
                    f"{spec['dtype']} {spec['shape']}"
                )
            maps[kind] = arr
        rows = int(rec["rows"])
        multi_hot = maps.pop("sparse_multi_hot", None)
        widths = {"dense": self.num_dense, "sparse": self.num_sparse, "labels": 1}
        if multi_hot is not None:
            del widths["sparse"]
            if {m.shape[0] for m in multi_hot} != {rows}:
                raise CriteoDataError(
                    f"{self.path / rec['files']['sparse_multi_hot']['file']}: rows "
                    f"{multi_hot[0].shape[0]}, the day has {rows}"
                )
        for kind, cols in widths.items():
            if maps[kind].shape != (rows, cols):
                raise CriteoDataError(
                    f"{self.path / rec['files'][kind]['file']}: shape {list(maps[kind].shape)}, "
                    f"a day of {rows} rows needs [{rows}, {cols}]"
                )
        probs = maps.get("probs")
        if probs is not None and (probs.shape != (rows,) or probs.dtype != np.float32):
            raise CriteoDataError(
                f"{self.path / rec['files']['probs']['file']}: {probs.dtype} "
                f"{list(probs.shape)}, expected float32 [{rows}]"
            )
        return Day(
            index=int(rec["day"]),
            rows=rows,
            labeled=bool(rec["labeled"]),
            dense=maps["dense"],
            sparse=maps.get("sparse"),
            labels=maps["labels"],
            probs=probs,
            multi_hot=multi_hot,
        )

    def _open_multi_hot(self, path: Path, spec: dict[str, Any]) -> list[np.ndarray]:
        from dlrm_vrgd.data.criteo.npz import NpzError, open_multi_hot

        try:
            maps = open_multi_hot(path, self.num_sparse)
        except NpzError as err:
            raise CriteoDataError(str(err)) from None
        sizes = [m.shape[1] for m in maps]
        if spec.get("sizes") is not None and sizes != spec["sizes"]:
            raise CriteoDataError(f"{path}: bag sizes {sizes}, the manifest says {spec['sizes']}")
        return maps


def mlperf_manifest(path: Path) -> dict[str, Any]:
    """A manifest of ours for MLPerf's preprocessed days (``day_{i}_dense.npy``,
    ``day_{i}_labels.npy`` and ``day_{i}_sparse_multi_hot.npz`` or ``day_{i}_sparse.npy``,
    days ``0, 1, ..`` while they exist), read from the files: every day labeled, no table
    sizes, no checksums."""
    from dlrm_vrgd.data.criteo.npz import multi_hot_file

    days: list[dict[str, Any]] = []
    widths: dict[str, int] = {}
    while (path / f"day_{len(days)}_labels.npy").is_file():
        i = len(days)
        files: dict[str, Any] = {}
        names = {"dense": f"day_{i}_dense.npy", "labels": f"day_{i}_labels.npy"}
        if (path / multi_hot_file(i)).is_file():
            names["sparse_multi_hot"] = multi_hot_file(i)
        else:
            names["sparse"] = f"day_{i}_sparse.npy"
        for kind, name in names.items():
            f = path / name
            if not f.is_file():
                raise CriteoDataError(f"{f}: missing (MLPerf's day {i} has {sorted(names)})")
            spec: dict[str, Any] = {"file": name, "bytes": f.stat().st_size, "sha256": None}
            if kind != "sparse_multi_hot":
                try:
                    arr = np.load(f, mmap_mode="r")
                except ValueError as err:
                    raise CriteoDataError(f"{f}: not a valid npy file: {err}") from None
                spec.update(dtype=arr.dtype.str, shape=list(arr.shape))
                if arr.ndim == 2 and kind in ("dense", "sparse"):
                    widths.setdefault(f"num_{kind}", arr.shape[1])
            files[kind] = spec
        days.append(
            {"day": i, "rows": files["labels"]["shape"][0], "labeled": True, "files": files}
        )
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "num_dense": widths.get("num_dense", NUM_INT),
        "num_sparse": widths.get("num_sparse", NUM_CAT),
        "sparse": {"cardinalities": None},
        "days": days,
    }


def _width(manifest: dict[str, Any], key: str, default: int, path: Path) -> int:
    value = manifest.get(key, default)
    if type(value) is not int or not 1 <= value <= 1024:
        raise CriteoDataError(f"{path}: {key} is {value!r}, not a count of columns")
    return value


class CriteoSource:
    """Rows of several day ranges, concatenated, as a :class:`~dlrm_vrgd.data.rows.RowSource`.

    ``segments``: ``(day, start, stop)`` row ranges; ``caps``: one read-time cap per table or
    None.
    """

    def __init__(
        self,
        days: list[Day],
        segments: list[tuple[int, int, int]],
        cardinalities: list[int],
        block_rows: int,
        caps: np.ndarray | None = None,
        name: str = "criteo",
    ) -> None:
        self.days = {d.index: d for d in days}
        self.segments = [s for s in segments if s[2] > s[1]]
        self.cardinalities = list(cardinalities)
        self.block_rows = block_rows
        self.caps = caps
        self.name = name
        first = next(iter(self.days.values()), None)
        self.num_dense = NUM_INT if first is None else int(first.dense.shape[1])
        used = [self.days[d] for d, _, _ in self.segments]
        #: every day read has true click probabilities (generated data): rows carry them
        self.has_probs = bool(used) and all(d.probs is not None for d in used)
        bag_sizes = {d.bag_sizes for d in used}
        if len(bag_sizes) > 1:
            raise CriteoDataError(
                f"data: the {name} split mixes days of bag sizes {sorted(map(str, bag_sizes))}"
            )
        sizes_of_days = bag_sizes.pop() if bag_sizes else None
        #: multi-hot days (MLPerf's npz): the bags of a row (None: one id a table)
        self.bags = None if sizes_of_days is None else BagLayout(sizes_of_days)
        if self.bags is not None:
            cols = self.bags.columns
            self._bag_caps = None if caps is None else np.repeat(caps, np.diff(cols))
        sizes = [stop - start for _, start, stop in self.segments]
        self._offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.num_rows = int(self._offsets[-1])

    def read(self, start: int, stop: int) -> Rows:
        """Rows ``[start, stop)``: dense (n x 13 float32), sparse (n x 26 int64), labels (n
        float32), probs (n float32, generated days only); copies of the slices of the days the
        range touches."""
        if not 0 <= start <= stop <= self.num_rows:
            raise IndexError(f"rows [{start}, {stop}) outside the {self.name} split")
        n = stop - start
        dense = np.empty((n, self.num_dense), dtype=np.float32)
        width = len(self.cardinalities) if self.bags is None else self.bags.width
        sparse = np.empty((n, width), dtype=np.int64)
        labels = np.empty(n, dtype=np.float32)
        probs = np.empty(n, dtype=np.float32) if self.has_probs else None
        i = int(np.searchsorted(self._offsets, start, side="right")) - 1
        pos = start
        while pos < stop:
            day_index, day_start, _ = self.segments[i]
            day = self.days[day_index]
            a = day_start + pos - int(self._offsets[i])
            take = min(stop, int(self._offsets[i + 1])) - pos
            o = pos - start
            dense[o : o + take] = day.dense[a : a + take]
            if day.multi_hot is not None:
                cols = self.bags.columns  # type: ignore[union-attr]
                for k, ids in enumerate(day.multi_hot):
                    sparse[o : o + take, cols[k] : cols[k + 1]] = ids[a : a + take]
            else:
                sparse[o : o + take] = day.sparse[a : a + take]  # type: ignore[index]
            labels[o : o + take] = day.labels[a : a + take, 0]
            if probs is not None:
                probs[o : o + take] = day.probs[a : a + take]  # type: ignore[index]
            pos += take
            i += 1
        if self.caps is not None:
            caps = self.caps if self.bags is None else self._bag_caps
            np.remainder(sparse, caps, out=sparse)
        return Rows(dense=dense, sparse=sparse, labels=labels, probs=probs, bags=self.bags)


# ---------------------------------------------------------------------------------- splits
def _check_days(days: list[int], by_index: dict[int, Day], field_name: str, path: Path) -> None:
    for d in days:
        if d not in by_index:
            raise CriteoDataError(
                f"data.{field_name}: day {d} is not in {path} (days {sorted(by_index)})"
            )
        if not by_index[d].labeled:
            raise CriteoDataError(
                f"data.{field_name}: day {d} has no labels (e.g. Kaggle test.txt); it cannot be "
                "used for training or evaluation"
            )


def read_caps(cfg: CriteoData, tables: int = NUM_SPARSE) -> np.ndarray | None:
    """``data.max_rows_per_table`` as one cap per table (``tables`` of them)."""
    cap = cfg.max_rows_per_table
    if cap is None:
        return None
    values = [cap] * tables if isinstance(cap, int) else list(cap)
    if len(values) != tables:
        raise CriteoDataError(
            f"data.max_rows_per_table: {len(values)} caps, {cfg.path} has {tables} tables"
        )
    return np.asarray(values, dtype=np.int64)


def _bag_sizes(cfg: CriteoData, store: CriteoDays, days: list[int]) -> tuple[int, ...] | None:
    """The bag sizes of the days read: their own (multi-hot days; ``data.multi_hot_sizes``
    must match), ``data.multi_hot_sizes`` (one-hot days, made multi-hot), or None."""
    by_index = {d.index: d for d in store.days}
    found = {by_index[d].bag_sizes for d in days}
    want = None if cfg.multi_hot_sizes is None else tuple(cfg.multi_hot_sizes)
    if want is not None and len(want) != store.num_sparse:
        raise CriteoDataError(
            f"data.multi_hot_sizes: {len(want)} bag sizes, {cfg.path} has {store.num_sparse} tables"
        )
    if found == {None}:
        return want
    if None in found:
        raise CriteoDataError(f"{cfg.path}: the days read mix one-hot and multi-hot ids")
    if len(found) > 1:
        raise CriteoDataError(f"{cfg.path}: the days read have different bag sizes")
    (own,) = found
    if want is not None and own != want:
        raise CriteoDataError(
            f"data.multi_hot_sizes: {list(want)}, but the multi-hot days of {cfg.path} have "
            f"bags of {list(own)} (leave multi_hot_sizes out to take theirs)"
        )
    return own


def criteo_splits(cfg: CriteoData) -> DataSplits:
    """The train / val / test sources of a preprocessed directory (module docstring)."""
    store = CriteoDays(cfg.path, verify_checksums=cfg.verify_checksums)
    by_index = {d.index: d for d in store.days}
    labeled = [d.index for d in store.days if d.labeled]
    if not labeled:
        raise CriteoDataError(f"{cfg.path}: no labeled day")
    last = labeled[-1]
    made = store.manifest.get("splits") or {}  # preprocess --split
    if not isinstance(made, dict) or not all(
        isinstance(v, list) and all(type(d) is int for d in v)
        for k, v in made.items()
        if k.endswith("_days")
    ):
        raise CriteoDataError(f"{cfg.path}: the manifest's splits are not lists of day numbers")
    if cfg.split == "mlperf":  # MLPerf DLRMv2's: the manifest's splits do not apply
        made = {}
    defaults = {
        "train_days": made.get("train_days", labeled[:-1]),
        "val_days": made.get("val_days", [last]),
        "test_days": made.get("test_days", [last]),
    }
    train_days, val_days, test_days = (
        value if (value := getattr(cfg, name)) is not None else list(defaults[name])
        for name in ("train_days", "val_days", "test_days")
    )
    chosen = {"train_days": train_days, "val_days": val_days, "test_days": test_days}
    for name, days in chosen.items():
        _check_days(days, by_index, name, cfg.path)
    if not train_days:
        raise CriteoDataError(
            f"data.train_days: {cfg.path} has a single labeled day; set train_days / val_days / "
            "test_days, or preprocess with --rows-per-day to cut the input into several days"
        )
    for name, days in (("val_days", val_days), ("test_days", test_days)):
        if set(days) & set(train_days):
            both = sorted(set(days) & set(train_days))
            raise CriteoDataError(f"data.{name}: days {both} are also train days")

    caps = read_caps(cfg, store.num_sparse)
    if store.cardinalities is None:  # MLPerf's set: the caps are the table sizes
        if caps is None or not isinstance(cfg.max_rows_per_table, list):
            raise CriteoDataError(
                f"{cfg.path}: MLPerf's preprocessed days record no table sizes; set "
                f"data.max_rows_per_table to its {store.num_sparse} num_embeddings_per_feature"
            )
        cards = [int(k) for k in caps]
    else:
        cards = list(store.cardinalities)
    if caps is not None:
        cards = [min(int(c), int(k)) for c, k in zip(cards, caps, strict=True)]
    bags = _bag_sizes(cfg, store, train_days + val_days + test_days)
    synthesize = bags is not None and all(
        by_index[d].multi_hot is None for d in train_days + val_days + test_days
    )
    if synthesize:
        # MLPerf's tables have num_embeddings_per_feature rows (the caps), whatever ids occur
        if caps is not None:
            cards = [int(k) for k in caps]
        assert bags is not None
        tables = MultiHotTables(cards, bags, cfg.multi_hot_cache)
    big = [(j, c) for j, c in enumerate(cards) if c > MAX_TABLE_ROWS]
    if big:
        j, c = big[0]
        raise CriteoDataError(
            f"{cfg.path}: table C{j + 1} would have {c:,} rows (ids were not capped when "
            "preprocessing); set data.max_rows_per_table, e.g. 10000000"
        )

    def segments(days: list[int]) -> list[tuple[int, int, int]]:
        return [(d, 0, by_index[d].rows) for d in days]

    val_segs, test_segs = segments(val_days), segments(test_days)
    if set(val_days) == set(test_days):
        val_segs, test_segs = [], []
        for d in val_days:
            n = by_index[d].rows
            # MLPerf's reader: val is the first ceil(n / 2) rows (len_d0 // 2 + len_d0 % 2)
            cut = (n + 1) // 2 if cfg.split == "mlperf" else int(n * cfg.val_fraction)
            val_segs.append((d, 0, cut))
            test_segs.append((d, cut, n))
    elif set(val_days) & set(test_days):
        raise CriteoDataError("data.test_days: overlaps val_days without being the same days")

    def source(segs: list[tuple[int, int, int]], limit: int | None, name: str) -> RowSource:
        if limit is not None:
            kept, left = [], limit
            for d, a, b in segs:
                take = min(b - a, left)
                kept.append((d, a, a + take))
                left -= take
            segs = kept
        src = CriteoSource(store.days, segs, cards, cfg.shuffle_block_rows, caps, name)
        if src.num_rows == 0:
            raise CriteoDataError(f"data: the {name} split of {cfg.path} is empty")
        return MultiHotSource(src, tables) if synthesize else src

    splits = DataSplits(
        train=source(segments(train_days), None, "train"),
        val=source(val_segs, cfg.max_val_rows, "val"),
        test=source(test_segs, cfg.max_test_rows, "test"),
    )
    logger.info(
        "criteo %s: train days %s (%d rows), val %d rows, test %d rows",
        cfg.path,
        train_days,
        splits.train.num_rows,
        splits.val.num_rows,
        splits.test.num_rows,
    )
    oracle = (store.manifest.get("generated") or {}).get("oracle")
    if isinstance(oracle, dict):  # dlrm-vrgd generate: the ceiling a model can reach
        logger.info(
            "generated synthetic data; oracle AUC of its splits (manifest): %s",
            ", ".join(
                f"{k} {v['auc']:.4f}"
                for k, v in oracle.items()
                if isinstance(v, dict) and isinstance(v.get("auc"), float)
            ),
        )
    return splits
