"""How a raw Criteo row becomes the model's inputs: the feature layout of an exported model.

The layout is read from the manifest of the preprocessed data the model was trained on
(``dlrm-vrgd preprocess``, :mod:`dlrm_vrgd.data.criteo.preprocess`) and the run's data config:

1. parse the line exactly as ``preprocess`` does (:func:`~dlrm_vrgd.data.criteo.parse.parse_block`):
   dense ``log(max(x, floor) - floor + 2)``, categorical hex ``v`` -> ``v % cap`` with the
   preprocessing's table caps (``max_rows_per_table``);
2. with a frequency threshold, ids kept by preprocessing map to ``1 + rank`` among the kept ids
   of their table (``vocab.npy``), every other id to row 0 — the remap ``preprocess`` applied;
3. the read-time caps of the run's config (``data.max_rows_per_table``): ``id % cap``.

Preprocessed day files already hold step 1-2's ids; only step 3 applies to them. An id that still
falls outside its table (possible only when neither preprocessing nor the run capped the ids: a
value never seen in training) is hashed into the table (``id % rows``) and counted.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dlrm_vrgd import safejson
from dlrm_vrgd.config import CriteoData, TrainConfig
from dlrm_vrgd.data.criteo.output import MANIFEST as DATA_MANIFEST
from dlrm_vrgd.data.criteo.parse import DEFAULT_DENSE_FLOOR, ParseOptions

logger = logging.getLogger(__name__)


class FeatureError(ValueError):
    """Inputs that cannot be mapped onto a model's features."""


#: keys of ``features.json`` that only a multi-hot model has
MULTI_HOT_KEYS = ("multi_hot_sizes", "multi_hot_synthesis", "multi_hot_seed")
#: :attr:`FeatureLayout.multi_hot_synthesis` of MLPerf DLRMv2's synthesis
SYNTHESIS = "mlperf-uniform"


@dataclass(frozen=True)
class FeatureLayout:
    """``source``: ``criteo`` (raw rows can be scored) or ``synthetic`` (no raw mapping)."""

    source: str
    num_dense: int
    table_rows: list[int]
    dense_floor: int = DEFAULT_DENSE_FLOOR
    preprocess_caps: list[int] | None = None
    frequency_threshold: int = 0
    #: the per-table row counts of the preprocessed data (ids of its day files are below them)
    data_cardinalities: list[int] | None = None
    read_caps: list[int] | None = None
    #: whether the model directory holds the kept ids of a frequency threshold (vocab.npy)
    vocab: bool = False
    #: multi-hot models: the bag size of each table (None: one id a table)
    multi_hot_sizes: list[int] | None = None
    #: how training made its multi-hot ids from one-hot ids: ``mlperf-uniform`` (MLPerf
    #: DLRMv2's lookup tables, :class:`~dlrm_vrgd.data.multihot.MultiHotTables`, drawn over
    #: ``table_rows`` with ``multi_hot_seed``), applied to one-hot ids (raw rows, one-hot days)
    #: after steps 1-3; None: the model read materialized multi-hot ids (npz days) and scores
    #: those only
    multi_hot_synthesis: str | None = None
    multi_hot_seed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """As ``features.json`` holds it (the multi-hot keys only for a multi-hot model)."""
        out = asdict(self)
        if self.multi_hot_sizes is None:
            for key in MULTI_HOT_KEYS:
                del out[key]
        return out

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> FeatureLayout:
        return FeatureLayout(**raw)

    @property
    def raw_rows(self) -> bool:
        """Whether raw Criteo text can be mapped (else only preprocessed day files)."""
        return (
            self.source == "criteo"
            and (self.frequency_threshold == 0 or self.vocab)
            and (self.multi_hot_sizes is None or self.multi_hot_synthesis is not None)
        )

    @property
    def raw_graph(self) -> bool:
        """Whether the input transform can be a graph of its own (``model_raw.pt2`` /
        ``model_raw.onnx``): raw rows of a one-hot model (a multi-hot model's synthesis is
        applied in Python, by :class:`FeatureMapper`)."""
        return self.raw_rows and self.multi_hot_sizes is None

    @property
    def one_hot_rows(self) -> bool:
        """Whether rows of one id a table can be scored (one-hot models, and multi-hot models
        that carry their synthesis)."""
        return self.multi_hot_sizes is None or self.multi_hot_synthesis is not None

    def parse_options(self, skip_bad_rows: bool) -> ParseOptions:
        caps = None if self.preprocess_caps is None else np.asarray(self.preprocess_caps, np.uint64)
        return ParseOptions(caps=caps, dense_floor=self.dense_floor, skip_bad_rows=skip_bad_rows)


def layout_of_run(cfg: TrainConfig, table_rows: list[int], num_dense: int) -> tuple[
    FeatureLayout, np.ndarray | None
]:  # fmt: skip
    """The feature layout of a run's config, and the vocab (kept ids, concatenated) if any."""
    data = cfg.data
    if not isinstance(data, CriteoData):
        bags = _multi_hot(data.multi_hot_sizes, synthesized=data.multi_hot_sizes is not None)
        return FeatureLayout("synthetic", num_dense, table_rows, **bags), None
    path = Path(data.path) / DATA_MANIFEST
    try:
        manifest = safejson.loads(path.read_bytes())
    except FileNotFoundError:
        raise FeatureError(
            f"{path}: missing; the feature layout (hashing, caps, dense transform) of the "
            "model is read from the manifest of the data it was trained on"
        ) from None
    except (OSError, ValueError) as err:
        raise FeatureError(f"{path}: cannot be read as a manifest ({err})") from None
    try:
        return _layout_of_manifest(manifest, data, table_rows, num_dense)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise FeatureError(
            f"{path}: not a manifest `dlrm-vrgd preprocess` wrote ({type(err).__name__}: {err})"
        ) from None


def _layout_of_manifest(
    manifest: Any, data: CriteoData, table_rows: list[int], num_dense: int
) -> tuple[FeatureLayout, np.ndarray | None]:
    bags = _multi_hot_of_days(manifest, data)
    if isinstance(manifest, dict) and manifest.get("generated"):
        # synthetic rows written as day files (dlrm-vrgd generate): no raw Criteo layout
        return FeatureLayout("synthetic", num_dense, table_rows, **bags), None
    sparse = manifest["sparse"]
    caps = sparse.get("max_rows_per_table")
    threshold = int(sparse.get("frequency_threshold") or 0)
    read_caps = data.max_rows_per_table
    if isinstance(read_caps, int):
        read_caps = [read_caps] * len(table_rows)
    vocab = None
    if threshold:
        spec = sparse.get("vocab")
        if spec is None:
            logger.warning(
                "%s was preprocessed with --frequency-threshold by an older version that did not "
                "keep the kept ids: the model will score preprocessed day files only",
                data.path,
            )
        else:
            name = str(spec["file"])
            if Path(name).name != name or name in ("", ".", ".."):
                raise ValueError(f"the vocabulary file {name!r} is not a name in the directory")
            vocab = np.load(Path(data.path) / name, allow_pickle=False)
    layout = FeatureLayout(
        source="criteo",
        num_dense=num_dense,
        table_rows=list(table_rows),
        dense_floor=int(manifest["dense_transform"]["floor"]),
        preprocess_caps=list(caps) if caps else None,
        frequency_threshold=threshold,
        data_cardinalities=[int(c) for c in sparse["cardinalities"]],
        read_caps=list(read_caps) if read_caps else None,
        vocab=vocab is not None,
        **bags,
    )
    return layout, vocab


def _multi_hot(sizes: list[int] | None, synthesized: bool) -> dict[str, Any]:
    """The multi-hot fields of a layout: none (one-hot), or the bag sizes and whether (and
    with which seed) training synthesized them from one-hot ids."""
    from dlrm_vrgd.data.multihot import MLPERF_SEED

    if sizes is None:
        return {}
    return {
        "multi_hot_sizes": [int(s) for s in sizes],
        "multi_hot_synthesis": SYNTHESIS if synthesized else None,
        "multi_hot_seed": MLPERF_SEED if synthesized else None,
    }


def _multi_hot_of_days(manifest: Any, data: CriteoData) -> dict[str, Any]:
    """The multi-hot fields of a model trained on preprocessed days: the days' own bags
    (materialized ``*_sparse_multi_hot.npz``: read as they are), or ``data.multi_hot_sizes``
    over one-hot days (synthesized as they were read; :func:`~dlrm_vrgd.data.criteo.source.
    criteo_splits`)."""
    found = {
        tuple(f["sparse_multi_hot"].get("sizes") or ()) if "sparse_multi_hot" in f else None
        for d in manifest.get("days", []) if isinstance(manifest, dict)
        for f in [d["files"]]
    }  # fmt: skip
    materialized = [s for s in found if s is not None]
    if materialized:
        if len(materialized) > 1 or not materialized[0]:
            raise ValueError("its multi-hot days do not record one set of bag sizes")
        return _multi_hot(list(materialized[0]), synthesized=False)
    return _multi_hot(data.multi_hot_sizes, synthesized=data.multi_hot_sizes is not None)


class FeatureMapper:
    """Applies a :class:`FeatureLayout` to parsed ids (module docstring, steps 2-3)."""

    def __init__(self, layout: FeatureLayout, vocab: np.ndarray | None = None) -> None:
        self.layout = layout
        self.rows = np.asarray(layout.table_rows, dtype=np.int64)
        self.read_caps = (
            None if layout.read_caps is None else np.asarray(layout.read_caps, dtype=np.int64)
        )
        self.kept: list[np.ndarray] | None = None
        if layout.frequency_threshold and vocab is not None:
            cards = layout.data_cardinalities or []
            ends = np.cumsum([c - 1 for c in cards])
            self.kept = np.split(np.asarray(vocab, dtype=np.int64), ends[:-1])
        self.outside = 0  # ids hashed into their table because they fell outside it
        self._lock = threading.Lock()  # parsing threads map blocks at the same time
        #: multi-hot models: each id column's table (``L`` of them)
        self.bags = layout.multi_hot_sizes
        self.column_table = (
            None if self.bags is None else np.repeat(np.arange(len(self.bags)), self.bags)
        )
        self._tables: Any = None  # MLPerf's lookup tables, drawn when first needed

    def synthesis(self) -> Any:
        """The model's :class:`~dlrm_vrgd.data.multihot.MultiHotTables` (the synthesis its
        training applied to one-hot ids), drawn once; FeatureError for a model that read
        materialized multi-hot ids."""
        lay = self.layout
        if lay.multi_hot_sizes is None or lay.multi_hot_synthesis is None:
            raise FeatureError(
                f"the model was trained on materialized multi-hot ids (bag sizes "
                f"{lay.multi_hot_sizes}) and does not record how they were made from one-hot "
                "ids: score multi-hot day files (day_N_sparse_multi_hot.npz) with those sizes"
            )
        with self._lock:
            if self._tables is None:
                from dlrm_vrgd.data.multihot import MLPERF_SEED, MultiHotTables

                if lay.multi_hot_synthesis != SYNTHESIS or lay.multi_hot_seed != MLPERF_SEED:
                    raise FeatureError(
                        f"features.json: multi-hot synthesis {lay.multi_hot_synthesis!r} seed "
                        f"{lay.multi_hot_seed}; this version makes {SYNTHESIS!r} seed "
                        f"{MLPERF_SEED} only"
                    )
                self._tables = MultiHotTables(lay.table_rows, lay.multi_hot_sizes)
            return self._tables

    def model_ids(self, sparse: np.ndarray) -> np.ndarray:
        """Table rows of one id a table (``N x T``, after :meth:`raw_ids` / :meth:`day_ids`)
        -> the model's ids: themselves (one-hot model), or their multi-hot bags ``N x L`` by
        the model's synthesis (as training made them)."""
        if self.bags is None:
            return sparse
        return self.synthesis().expand(sparse)

    def check_days(self, manifest: dict[str, Any], where: str) -> None:
        """Refuse preprocessed days whose ids were made by other rules than the model's."""
        lay = self.layout
        if lay.source != "criteo":
            raise FeatureError(f"{where}: the model was trained on synthetic data, not Criteo days")
        try:
            sparse = manifest["sparse"]
            floor = int(manifest["dense_transform"]["floor"])
            caps = sparse.get("max_rows_per_table") or None
            threshold = int(sparse.get("frequency_threshold") or 0)
            cards = [int(c) for c in sparse["cardinalities"]] if threshold else None
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise FeatureError(
                f"{where}: not a manifest `dlrm-vrgd preprocess` wrote ({type(err).__name__}: "
                f"{err})"
            ) from None
        if floor != lay.dense_floor:
            raise FeatureError(
                f"{where}: dense floor {floor}, the model was trained with {lay.dense_floor}"
            )
        if caps != lay.preprocess_caps or threshold != lay.frequency_threshold:
            raise FeatureError(
                f"{where}: preprocessed with max_rows_per_table={caps}, frequency_threshold="
                f"{threshold}; the model's data used {lay.preprocess_caps}, "
                f"{lay.frequency_threshold}: preprocess the raw files the same way, or score "
                "them raw"
            )
        if threshold and cards != lay.data_cardinalities:
            raise FeatureError(
                f"{where}: its frequency-threshold vocabulary differs from the model's data "
                "(other inputs were counted): score the raw files instead"
            )

    def raw_ids(self, sparse: np.ndarray) -> np.ndarray:
        """Ids as parsed from raw text (capped) -> table rows (in place where possible)."""
        if self.layout.frequency_threshold:
            if self.kept is None:
                raise FeatureError(
                    "the model's data was preprocessed with a frequency threshold whose kept ids "
                    "were not saved (an older preprocess): score its preprocessed day files"
                )
            out = np.empty_like(sparse)
            for j, kept in enumerate(self.kept):
                col = sparse[:, j]
                pos = np.searchsorted(kept, col)
                hit = pos < len(kept)
                hit[hit] = kept[pos[hit]] == col[hit]
                out[:, j] = np.where(hit, pos + 1, 0)
            sparse = out
        return self.day_ids(sparse)

    def day_ids(self, sparse: np.ndarray) -> np.ndarray:
        """Ids of preprocessed days -> table rows (the run's read-time caps). Multi-hot ids
        (``N x L``, a multi-hot model's bags) are capped column by column, each by its table's
        cap, as training reads them."""
        caps, rows = self.read_caps, self.rows
        if self.column_table is not None and sparse.shape[1] == len(self.column_table):
            caps = None if caps is None else caps[self.column_table]
            rows = rows[self.column_table]
        elif sparse.shape[1] != len(rows):
            raise FeatureError(
                f"ids of {sparse.shape[1]} columns: the model takes {len(rows)} (one a table)"
                + ("" if self.bags is None else f" or {len(self.column_table)} (its bags)")
            )
        if caps is not None:
            sparse = np.remainder(sparse, caps)
        outside = sparse >= rows
        if outside.any():
            with self._lock:
                self.outside += int(outside.sum())
            sparse = np.where(outside, sparse % rows, sparse)
        return sparse
