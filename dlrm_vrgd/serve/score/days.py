"""Preprocessed day files for ``dlrm-vrgd score``: found, restricted to days or a split, scored.

A directory holding a ``dlrm-vrgd preprocess`` ``manifest.json`` is a set of day files (made
with the same rules as the model's training data; checked against its manifest). Every day is
scored, or only ``days``, or the rows of ``split`` as the model's training config cut them; a
row is numbered by its 1-based row in its day.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from dlrm_vrgd import safejson
from dlrm_vrgd.data.criteo.format import CriteoFormatError, check_in_root, open_input
from dlrm_vrgd.data.criteo.output import MANIFEST as DATA_MANIFEST
from dlrm_vrgd.data.criteo.output import MANIFEST_FORMAT as DATA_FORMAT
from dlrm_vrgd.serve.features import FeatureError, FeatureMapper
from dlrm_vrgd.serve.score.engine import Predict
from dlrm_vrgd.serve.score.progress import Progress
from dlrm_vrgd.serve.score.sinks import ScoredBlock, Sink

if TYPE_CHECKING:
    from dlrm_vrgd.data.criteo.source import CriteoDays

#: The splits of a preprocessed directory as the model's training config cut it.
Split = Literal["train", "val", "test"]
#: Largest preprocessed ``manifest.json`` read.
_MAX_MANIFEST_BYTES = 64 << 20
#: bytes of one preprocessed row (13 float32 + 26 int64 + int32), for the progress bar
DAY_ROW_BYTES = 13 * 4 + 26 * 8 + 4

#: What to do instead of scoring synthetic day files (``dlrm-vrgd generate``'s output).
GENERATED_DAYS = (
    "synthetic day files written by `dlrm-vrgd generate` (their dense columns are log1p of the "
    "generator's counts, not the transform score applies to Criteo's raw counts); score reads "
    "raw Criteo text (TSV/CSV, gzip) or directories written by `dlrm-vrgd preprocess`. A model "
    "trained on these days was scored on their val and test rows at the end of its run: its "
    "figures are in the run's result.json (`dlrm-vrgd jobs status ID` for a job)"
)


@dataclass
class DaysInput:
    """A preprocessed directory, its manifest and the rows of it to score."""

    path: Path
    manifest: dict[str, Any]
    #: ``(day, start, stop)`` row ranges to score (None: every day whole).
    segments: list[tuple[int, int, int]] | None = None

    has_id = False

    @property
    def labeled(self) -> bool:
        return any(d["labeled"] for d in self.manifest["days"])

    @property
    def nbytes(self) -> int:
        """The rows to score as bytes on disk (for the progress bar)."""
        if self.segments is not None:
            return sum(b - a for _, a, b in self.segments) * DAY_ROW_BYTES
        return sum(d["rows"] for d in self.manifest["days"]) * DAY_ROW_BYTES


def open_days(path: Path, root: Path | None = None) -> DaysInput | None:
    """``path`` as a directory of day files, or None when it is not one (no manifest, or one
    that is not JSON or not ``preprocess``'s). With ``root``, every file the days may open must
    lie inside it. Synthetic days (``dlrm-vrgd generate``'s) are refused."""
    manifest = path / DATA_MANIFEST
    if not (path.is_dir() and manifest.is_file()):
        return None
    for entry in path.iterdir() if root is not None else ():  # every file the days may open
        check_in_root(entry, root)
    try:
        with open_input(manifest, root) as f:
            data = f.read(_MAX_MANIFEST_BYTES + 1)
    except OSError:
        return None
    if len(data) > _MAX_MANIFEST_BYTES:
        raise CriteoFormatError(f"{manifest}: over {_MAX_MANIFEST_BYTES >> 20} MiB, not a manifest")
    try:
        found = safejson.loads(data)
    except safejson.JsonLimitError as err:
        raise CriteoFormatError(f"{manifest}: not a data manifest ({err})") from None
    except ValueError:  # not JSON at all: not a directory of day files
        return None
    if not (isinstance(found, dict) and found.get("format") == DATA_FORMAT):
        return None
    if "generated" in found:
        raise CriteoFormatError(f"{path}: {GENERATED_DAYS}")
    return DaysInput(path, found)


def _open_store(src: DaysInput) -> CriteoDays:
    """The day files of ``src``, opened and checked against its manifest."""
    from dlrm_vrgd.data.criteo.source import CriteoDataError, CriteoDays

    try:
        return CriteoDays(src.path)
    except CriteoDataError as err:
        raise FeatureError(str(err)) from None


def _model_splits(src: DaysInput, config: dict[str, Any]) -> Any:
    """The train / val / test sources of ``src`` as the model's training config cuts its
    days (:func:`dlrm_vrgd.data.criteo.source.criteo_splits`)."""
    from dlrm_vrgd.config import ConfigError, parse_config
    from dlrm_vrgd.data.criteo.source import CriteoDataError, criteo_splits

    try:
        data = parse_config(config, "the model's config.json").data
    except ConfigError as err:
        raise FeatureError(str(err)) from None
    if data.source != "criteo":
        raise FeatureError(f"{src.path}: the model was trained on synthetic data, not Criteo days")
    try:
        return criteo_splits(data.model_copy(update={"path": src.path}))
    except CriteoDataError as err:
        raise FeatureError(f"{src.path}: the model's days do not fit it: {err}") from None


def _split_segments(source: Any) -> list[tuple[int, int, int]]:
    """The ``(day, start, stop)`` segments of a split's source; a multi-hot model's splits
    are its one-hot days wrapped in the synthesis (``MultiHotSource.base``)."""
    return list(getattr(source, "base", source).segments)


def select_rows(
    src: DaysInput, config: dict[str, Any], days: Sequence[int] | None, split: Split | None
) -> list[int]:
    """Restrict ``src`` to ``days`` or to the model's ``split`` of it; the training days of
    the model among the days it will score (for a warning), when ``src`` is the model's
    training data."""
    held = {d.index: d.rows for d in _open_store(src).days}
    if days is not None:
        unknown = sorted(set(days) - set(held))
        if unknown:
            raise FeatureError(
                f"{src.path}: --days {','.join(map(str, unknown))}: no such day "
                f"(it holds {', '.join(map(str, sorted(held)))})"
            )
        src.segments = [(d, 0, held[d]) for d in days]
    elif split is not None:
        src.segments = _split_segments(getattr(_model_splits(src, config), split))
    if not _is_training_data(src, config):
        return []
    try:
        train = {d for d, _, _ in _split_segments(_model_splits(src, config).train)}
    except FeatureError:
        return []
    scored = src.segments or [(d, 0, n) for d, n in held.items()]
    return sorted({d for d, a, b in scored if d in train and b > a})


def _is_training_data(src: DaysInput, config: dict[str, Any]) -> bool:
    """Whether ``src`` is the directory the model trained on: the same path, or a manifest
    byte for byte the same as that directory's."""
    data = config.get("data")
    trained = data.get("path") if isinstance(data, dict) else None
    if not isinstance(trained, str):
        return False
    try:
        if Path(trained).resolve() == src.path.resolve():
            return True
        theirs = (Path(trained) / DATA_MANIFEST).read_bytes()
        return theirs == (src.path / DATA_MANIFEST).read_bytes()
    except OSError:
        return False


def _segments(src: DaysInput) -> Iterator[tuple[str, Any, int, int]]:
    """``(name, day, start, stop)`` of each row range of ``src`` to score."""
    store = _open_store(src)
    by_index = {d.index: d for d in store.days}
    segments = src.segments or [(d.index, 0, d.rows) for d in store.days]
    for index, start, stop in segments:
        yield f"{src.path}/day_{index}", by_index[index], start, stop


def check_bags(src: DaysInput, mapper: FeatureMapper) -> None:
    """Refuse days whose ids the model cannot take: multi-hot days of other bag sizes than
    the model's (or for a one-hot model), one-hot days for a multi-hot model that does not
    carry its synthesis. Each error names the file."""
    want = mapper.bags
    for day in _open_store(src).days:
        if src.segments is not None and day.index not in {d for d, _, _ in src.segments}:
            continue
        if day.multi_hot is not None:
            path = src.path / _day_file(src, day.index, "sparse_multi_hot")
            got = list(day.bag_sizes or ())
            if want is None:
                raise FeatureError(
                    f"{path}: multi-hot ids (bag sizes {got}); the model takes one id a table"
                )
            if got != list(want):
                raise FeatureError(
                    f"{path}: bag sizes {got}, the model's (features.json multi_hot_sizes) are "
                    f"{list(want)}"
                )
        elif want is not None and not mapper.layout.one_hot_rows:
            mapper.synthesis()  # raises: the model cannot make bags of one-hot ids


def _day_file(src: DaysInput, day: int, kind: str) -> str:
    for rec in src.manifest["days"]:
        if rec["day"] == day:
            return str(rec["files"][kind]["file"])
    return f"day_{day}"


def _day_sparse(name: str, day: Any, a: int, b: int, mapper: FeatureMapper) -> np.ndarray:
    """The model's ids of rows ``[a, b)`` of a day: one-hot ids capped (and made multi-hot
    by the model's synthesis), or a multi-hot day's bags side by side, capped per column."""
    if day.multi_hot is None:
        return mapper.model_ids(mapper.day_ids(np.array(day.sparse[a:b], dtype=np.int64)))
    ids = np.concatenate([np.asarray(m[a:b], dtype=np.int64) for m in day.multi_hot], axis=1)
    return mapper.day_ids(ids)


def score_days(
    src: DaysInput,
    mapper: FeatureMapper,
    predict: Predict,
    sink: Sink,
    state: Progress,
    batch_rows: int,
) -> None:
    """The chosen rows of ``src`` scored into ``sink`` in order, at least 65,536 at a time."""
    step = max(batch_rows, 65_536)
    for name, day, start, stop in _segments(src):
        for a in range(start, stop, step):
            b = min(a + step, stop)
            sparse = _day_sparse(name, day, a, b, mapper)
            probs = predict(np.array(day.dense[a:b]), sparse)
            labels = np.asarray(day.labels[a:b, 0], dtype=np.int32) if day.labeled else None
            rows = np.arange(a + 1, b + 1, dtype=np.int64)  # 1-based rows of the day
            sink.put(ScoredBlock(name, rows, None, labels, probs))
            state.advance((b - a) * DAY_ROW_BYTES, b - a)
