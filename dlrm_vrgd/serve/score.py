"""``dlrm-vrgd score``: click probabilities of raw Criteo rows (or preprocessed days).

Inputs, in the order given (a directory holding a preprocessed ``manifest.json`` is a set of
day files; any other directory stands for its files in natural order):

* raw Criteo text exactly as ``preprocess`` reads it (:mod:`dlrm_vrgd.data.criteo.format`): TSV
  or CSV, labelled (40 fields) or not (39: Kaggle ``test.txt``), Kaggle CSV with a header and an
  ``Id`` column, plain or gzip, LF or CRLF. The same parser (:func:`parse_block`) and the same
  bad-row rules: the first malformed row stops the run with ``FILE:LINE: reason``, or with
  ``skip_bad_rows`` is left out and counted;
* preprocessed day files (``dlrm-vrgd preprocess`` output made with the same rules as the model's
  training data; checked against its manifest).

Raw text is read in blocks of ``block_bytes`` by a reader thread into a bounded queue
(:func:`~dlrm_vrgd.serve.pipeline.prefetch`), parsed and mapped onto the model's tables
(:mod:`dlrm_vrgd.serve.features`) by ``workers`` threads (at most ``workers + 2`` blocks in
flight), and scored ``batch_rows`` rows at a time by ONNX Runtime on ``model.onnx`` or
the torch module (``engine``, :func:`predictor`); a writer thread (:class:`_Sink`, two blocks
behind at most) appends the predictions to the output and the metrics. Reading, parsing, the
model and writing overlap, and memory is bounded by the block size, not the input length.
With ONNX Runtime, ``weights.pt`` is verified as the torch engine verifies it (its SHA-256,
its exact tensors, all finite), memory-mapped and let go: the whole model directory is checked
whichever engine scores. Gzip input is decompressed at most a block ahead
(:func:`dlrm_vrgd.data.criteo.format.gzip_pieces`, as for preprocess): a line too long after
decompression stops the run with ``FILE:LINE`` as it does uncompressed. A file given twice
is refused.

Output (CSV, or Parquet when the name ends in ``.parquet``/``.pq`` or ``fmt="parquet"``): one
row per scored input row, in input order, with columns ``file``, ``line`` (the line in the raw
file, header included, 1-based; for day files the 1-based row of the day), ``Id`` (when any
input has one), ``label`` (when any input has labels) and ``probability``. It is written under a
temporary name and renamed when complete. With labels, the metrics (AUC, logloss, NE,
calibration) are computed on the fly (:class:`StreamingMetrics`) and written next to the output
(``OUT.metrics.json``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import torch

from dlrm_vrgd import safejson
from dlrm_vrgd.data.criteo.format import (
    BlockReader,
    CriteoFormatError,
    Format,
    LabelsMode,
    Layout,
    MalformedRowError,
    check_in_root,
    detect_layout,
    expand_inputs,
    open_input,
)
from dlrm_vrgd.data.criteo.output import MANIFEST as DATA_MANIFEST
from dlrm_vrgd.data.criteo.output import MANIFEST_FORMAT as DATA_FORMAT
from dlrm_vrgd.data.criteo.parse import ParsedBlock, ParseOptions, parse_block
from dlrm_vrgd.rundir import atomic_write_json
from dlrm_vrgd.serve import model as m
from dlrm_vrgd.serve.features import FeatureError, FeatureMapper
from dlrm_vrgd.serve.pipeline import prefetch

logger = logging.getLogger(__name__)

OutputFormat = Literal["csv", "parquet", "kaggle"]
#: The model's forward: ``auto`` is onnxruntime where the model has ``model.onnx`` (on CPU).
Engine = Literal["auto", "onnxruntime", "torch"]
#: ``(dense B x 13 float32, sparse B x 26 int64 table rows)`` -> ``B`` probabilities
Predict = Callable[[np.ndarray, np.ndarray], np.ndarray]
#: The splits of a preprocessed directory as the model's training config cut it.
Split = Literal["train", "val", "test"]
#: Raw text read at a time (as ``preprocess``): a line up to this long is a bad row that
#: ``skip_bad_rows`` can skip; a longer one stops the run.
BLOCK_BYTES = 16 << 20
#: Each block is parsed in pieces of about this much, cut at line ends (a longer line whole):
#: ~17k rows of Criteo text, about one forward pass of ``batch_rows``; small enough that the
#: first piece is parsed soon and the pieces in flight (at most ``workers + 2``) are a few tens
#: of MB, large enough that per-piece costs are small.
PIECE_BYTES = 4 << 20
_BAD_ROW_EXAMPLES = 20
#: Largest preprocessed ``manifest.json`` read.
_MAX_MANIFEST_BYTES = 64 << 20
_EPS = 1e-7  # probability clamp of the logloss (as dlrm_vrgd.metrics)
_AUC_BITS = 20  # histogram bins: the top 20 bits of the probability's float32 pattern


# ------------------------------------------------------------------------------- metrics
class StreamingMetrics:
    """AUC, logloss, NE and calibration over any number of rows in constant memory.

    logloss, NE and calibration are exact sums. AUC comes from per-class histograms over the
    top :data:`_AUC_BITS` bits of each probability's float32 bit pattern (for values in
    ``[0, 1]`` the pattern is monotone in the value; bins are ``2^-11`` of the value wide), with
    pairs inside one bin counted as ties: exact up to ties within a bin.
    """

    def __init__(self) -> None:
        bins = 1 << _AUC_BITS
        self.pos = np.zeros(bins, dtype=np.int64)
        self.neg = np.zeros(bins, dtype=np.int64)
        self.rows = 0
        self.clicks = 0
        self.prob_sum = 0.0
        self.loss_sum = 0.0

    def update(self, probs: np.ndarray, labels: np.ndarray) -> None:
        probs = np.asarray(probs, dtype=np.float32)
        y = np.asarray(labels) > 0
        shift = np.uint32(31 - _AUC_BITS)
        bins = (np.clip(probs, 0.0, 1.0).view(np.uint32) >> shift).astype(np.intp)
        self.pos += np.bincount(bins[y], minlength=len(self.pos))
        self.neg += np.bincount(bins[~y], minlength=len(self.neg))
        p = np.clip(probs.astype(np.float64), _EPS, 1 - _EPS)
        self.loss_sum -= float(np.sum(np.where(y, np.log(p), np.log1p(-p))))
        self.rows += len(probs)
        self.clicks += int(y.sum())
        self.prob_sum += float(probs.astype(np.float64).sum())

    def auc(self) -> float:
        n_pos, n_neg = int(self.pos.sum()), int(self.neg.sum())
        if n_pos == 0 or n_neg == 0:
            return 0.5
        below = np.cumsum(self.neg) - self.neg  # negatives in lower bins
        wins = float(np.sum(self.pos * below)) + 0.5 * float(np.sum(self.pos * self.neg))
        return wins / (n_pos * n_neg)

    def compute(self) -> dict[str, float]:
        n = self.rows
        rate = self.clicks / n if n else float("nan")
        logloss = self.loss_sum / n if n else float("nan")
        base = (
            -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate)) if 0 < rate < 1 else float("nan")
        )
        return {
            "rows": n,
            "clicks": self.clicks,
            "auc": self.auc(),
            "logloss": logloss,
            "ne": logloss / base if 0 < rate < 1 else float("nan"),
            "calibration": self.prob_sum / self.clicks if self.clicks else float("nan"),
        }


# -------------------------------------------------------------------------------- output
@dataclass(frozen=True)
class _Scored:
    """One block's predictions and where its rows came from."""

    file: str
    lines: np.ndarray  # 1-based line (or row) numbers in ``file``
    ids: pa.Array | None
    labels: np.ndarray | None  # -1 where a row has none
    probs: np.ndarray


class _Output:
    """Predictions appended as record batches to a temporary file, renamed when complete."""

    def __init__(self, path: Path, fmt: OutputFormat, with_id: bool, with_label: bool) -> None:
        self.path = path
        self.tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        self.kaggle = fmt == "kaggle"  # a Kaggle submission: Id,Predicted and nothing else
        fields = [pa.field("file", pa.string()), pa.field("line", pa.int64())]
        if with_id:
            fields.append(pa.field("Id", pa.string()))
        if with_label:
            fields.append(pa.field("label", pa.int8()))
        fields.append(pa.field("probability", pa.float32()))
        if self.kaggle:
            fields = [pa.field("Id", pa.string()), pa.field("Predicted", pa.float32())]
        self.schema = pa.schema(fields)
        self.with_id, self.with_label = with_id, with_label
        path.parent.mkdir(parents=True, exist_ok=True)
        self._writer: Any = (
            pq.ParquetWriter(str(self.tmp), self.schema)
            if fmt == "parquet"
            else pcsv.CSVWriter(str(self.tmp), self.schema)
        )

    def write(self, block: _Scored) -> None:
        file, lines, ids, labels, probs = (
            block.file, block.lines, block.ids, block.labels, block.probs
        )  # fmt: skip
        n = len(probs)
        if self.kaggle:
            if ids is None:
                raise CriteoFormatError(f"{file}: no Id column for a Kaggle submission")
            batch = [ids, pa.array(probs, type=pa.float32())]
            self._writer.write_batch(pa.record_batch(batch, schema=self.schema))
            return
        cols: list[pa.Array] = [
            pa.DictionaryArray.from_arrays(np.zeros(n, np.int32), pa.array([file])).cast(
                pa.string()
            ),
            pa.array(lines, type=pa.int64()),
        ]
        if self.with_id:
            cols.append(ids if ids is not None else pa.nulls(n, pa.string()))
        if self.with_label:
            if labels is None:
                cols.append(pa.nulls(n, pa.int8()))
            else:
                cols.append(pa.array(labels.astype(np.int8), mask=labels < 0))
        cols.append(pa.array(probs, type=pa.float32()))
        self._writer.write_batch(pa.record_batch(cols, schema=self.schema))

    def commit(self) -> None:
        self._writer.close()
        with self.tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:
            self.tmp.unlink(missing_ok=True)


class _Sink:
    """The output and the metrics, fed by one thread of their own (``score-write``) at most
    ``depth`` blocks behind the model, so writing overlaps the next block's forward. An error
    there is raised by the next :meth:`put` or by :meth:`drain`."""

    def __init__(self, writer: _Output, metrics: StreamingMetrics | None, depth: int = 2) -> None:
        self.writer, self.metrics, self.depth = writer, metrics, depth
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="score-write")
        self.pending: deque[Future[None]] = deque()

    def put(self, block: _Scored) -> None:
        while len(self.pending) >= self.depth:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(self._write, block))

    def _write(self, block: _Scored) -> None:
        self.writer.write(block)
        if self.metrics is not None and block.labels is not None:
            self.metrics.update(block.probs, block.labels)

    def drain(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def close(self) -> None:
        """Stop the thread (writes not started are dropped): the output may then be closed."""
        self.pool.shutdown(wait=True, cancel_futures=True)


# -------------------------------------------------------------------------------- inputs
@dataclass
class _Raw:
    path: Path
    layout: Layout
    root: Path | None = None  # inputs are confined to it (see data.criteo.format.open_input)


@dataclass
class _Days:
    path: Path
    manifest: dict[str, Any]
    #: ``(day, start, stop)`` row ranges to score (None: every day whole).
    segments: list[tuple[int, int, int]] | None = None


def _is_days(path: Path, root: Path | None = None) -> bool:
    manifest = path / DATA_MANIFEST
    if not (path.is_dir() and manifest.is_file()):
        return False
    for entry in path.iterdir() if root is not None else ():  # every file the days may open
        check_in_root(entry, root)
    try:
        with open_input(manifest, root) as f:
            data = f.read(_MAX_MANIFEST_BYTES + 1)
    except OSError:
        return False
    if len(data) > _MAX_MANIFEST_BYTES:
        raise CriteoFormatError(f"{manifest}: over {_MAX_MANIFEST_BYTES >> 20} MiB, not a manifest")
    try:
        found = safejson.loads(data)
    except safejson.JsonLimitError as err:
        raise CriteoFormatError(f"{manifest}: not a data manifest ({err})") from None
    except ValueError:  # not JSON at all: not a directory of day files
        return False
    return isinstance(found, dict) and found.get("format") == DATA_FORMAT


def _first_block(path: Path, block_bytes: int, root: Path | None = None) -> tuple[bytes, bool]:
    reader = BlockReader(path, block_bytes, root)
    first = next(iter(reader.blocks()), bytearray())
    return bytes(first), reader.gzip


#: What to do instead of scoring synthetic day files (``dlrm-vrgd generate``'s output).
GENERATED_DAYS = (
    "synthetic day files written by `dlrm-vrgd generate` (their dense columns are log1p of the "
    "generator's counts, not the transform score applies to Criteo's raw counts); score reads "
    "raw Criteo text (TSV/CSV, gzip) or directories written by `dlrm-vrgd preprocess`. A model "
    "trained on these days was scored on their val and test rows at the end of its run: its "
    "figures are in the run's result.json (`dlrm-vrgd jobs status ID` for a job)"
)
#: What to do instead of scoring one .npy file.
NPY_INPUT = (
    "a NumPy array (.npy), not raw Criteo text: give score the directory that holds the day "
    "files and their manifest.json (`dlrm-vrgd preprocess` writes them), not one of its files"
)


def resolve_inputs(
    paths: Sequence[str | Path],
    fmt: Format,
    labels: LabelsMode,
    block_bytes: int,
    root: Path | None = None,
) -> list[_Raw | _Days]:
    """Every input with its layout (raw) or manifest (days), in order. With ``root``, every
    file is checked to lie inside it (real path, no links), here and again when it is opened
    (:func:`~dlrm_vrgd.data.criteo.format.open_input`). A file given twice (also through a
    directory that holds it) is refused: its rows would be scored twice."""
    out: list[_Raw | _Days] = []
    seen: dict[str, Path] = {}

    def once(path: Path) -> None:
        """Every row is scored once: a file (or day directory) named twice, directly or
        through a directory that holds it, is refused."""
        real = os.path.realpath(path)
        if real in seen:
            raise CriteoFormatError(
                f"{path}: given twice (as {seen[real]}); every input row is scored once"
            )
        seen[real] = path

    for p in map(Path, paths):
        check_in_root(p, root)
        if _is_days(p, root):
            once(p)
            with open_input(p / DATA_MANIFEST, root) as f:
                manifest = safejson.loads(f.read(_MAX_MANIFEST_BYTES + 1))
            if isinstance(manifest, dict) and "generated" in manifest:
                raise CriteoFormatError(f"{p}: {GENERATED_DAYS}")
            out.append(_Days(p, manifest))
            continue
        for f in expand_inputs([p], root):
            if f.suffix == ".npy":
                raise CriteoFormatError(f"{f}: {NPY_INPUT}")
            once(f)
            first, gz = _first_block(f, block_bytes, root)
            if not first.strip():
                raise CriteoFormatError(f"{f}: empty input")
            out.append(_Raw(f, detect_layout(str(f), first, fmt, labels, gz), root))
    if not out:
        raise FileNotFoundError("no input files")
    return out


def block_lines(block: bytes | bytearray, parsed: ParsedBlock) -> np.ndarray:
    """0-based line (within ``block``) of each row of ``parsed``: the block's non-empty lines
    less those ``parse_block`` rejected."""
    b = np.frombuffer(block, dtype=np.uint8)
    ends = np.flatnonzero(b == ord("\n"))
    starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)
    length = ends - starts
    cr = np.zeros(len(ends), dtype=bool)
    has = length > 0
    cr[has] = b[ends[has] - 1] == ord("\r")
    nonempty = (length - cr) > 0
    keep = nonempty.copy()
    if parsed.bad_rows:
        keep[np.asarray([r.line - 1 for r in parsed.bad_rows], dtype=np.int64)] = False
    lines = np.flatnonzero(keep)
    if len(lines) != len(parsed):
        raise RuntimeError(f"{len(parsed)} rows parsed from {len(lines)} lines")
    return lines


def first_fields(block: bytes | bytearray, lines: np.ndarray, delimiter: str) -> pa.Array:
    """The first field (Kaggle's ``Id``) of the given 0-based lines of ``block``."""
    b = np.frombuffer(block, dtype=np.uint8)
    ends = np.flatnonzero(b == ord("\n"))
    starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)[lines]
    stops = ends[lines].astype(np.int64)
    delims = np.flatnonzero(b == ord(delimiter))
    at = np.searchsorted(delims, starts)
    cut = np.where(at < len(delims), delims[np.minimum(at, max(len(delims) - 1, 0))], stops)
    stops = np.minimum(cut, stops) if len(delims) else stops
    lengths = stops - starts
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    pos = np.repeat(starts - offsets[:-1], lengths) + np.arange(int(offsets[-1]))
    data = b[pos].tobytes()
    ids = pa.StringArray.from_buffers(len(lines), pa.py_buffer(offsets.tobytes()),
                                      pa.py_buffer(data))  # fmt: skip
    return pc.utf8_trim(ids, ' "\r')


# ------------------------------------------------------------------------------ scoring
@dataclass
class ScoreResult:
    out: Path
    rows: int
    seconds: float
    bad_rows: int
    metrics: dict[str, float] | None
    metrics_path: Path | None
    outside_ids: int
    bad_row_examples: list[dict[str, Any]] = field(default_factory=list)
    #: Scored days the model trained on (``DIR/day_N``): their metrics overstate it.
    training_days: list[str] = field(default_factory=list)
    #: Of ``seconds``, verifying and loading the model (every file hashed, the engine built).
    load_seconds: float = 0.0

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("nan")


def output_format(out: Path, fmt: OutputFormat | None) -> OutputFormat:
    if fmt is not None:
        return fmt
    return "parquet" if out.suffix.lower() in (".parquet", ".pq") else "csv"


def score(
    model_dir: str | Path,
    inputs: Sequence[str | Path],
    out: str | Path,
    *,
    fmt: OutputFormat | None = None,
    input_format: Format = "auto",
    labels: LabelsMode = "auto",
    skip_bad_rows: bool = False,
    overwrite: bool = False,
    batch_rows: int = 16_384,
    workers: int | None = None,
    block_bytes: int = BLOCK_BYTES,
    device: str = "cpu",
    metrics_path: str | Path | None = None,
    progress: bool = True,
    on_progress: Callable[[int, float, float], None] | None = None,
    days: Sequence[int] | None = None,
    split: Split | None = None,
    input_root: str | Path | None = None,
    engine: Engine = "auto",
) -> ScoreResult:
    """Score ``inputs`` with the model directory ``model_dir`` into ``out`` (module docstring).

    Preprocessed inputs score every day, or only ``days``, or the rows of ``split`` as the
    model's training config cut them (``test``: the rows its final test AUC was measured on);
    scoring days the model trained on is in ``ScoreResult.training_days`` (``dlrm-vrgd
    score`` warns of it).
    ``on_progress(rows, seconds, fraction of the input read)`` is called after every written
    block (for services). With ``input_root`` (the service's data root), every input file must
    be a regular file whose real path lies inside it, checked when the file is opened: a link,
    or a path that leads out of the root, is refused (:class:`InputPathError`). ``engine``:
    the forward of ONNX Runtime on ``model.onnx`` or of the torch module (:func:`predictor`)."""
    t0 = time.perf_counter()
    out = Path(out).absolute()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists: pass --overwrite or another --out")
    if batch_rows < 1:
        raise ValueError("--batch-rows must be >= 1")
    if days is not None and split is not None:
        raise ValueError("--days and --split pick rows two ways: pass one")
    chosen = resolve_engine(model_dir, engine, device)
    if chosen == "onnxruntime":
        # OnnxScorer verifies every file (model.onnx as it reads it); weights.pt is hashed,
        # then checked memory-mapped as the torch loader checks it (load_features) and let
        # go: ONNX Runtime holds the tables, once
        predict = predictor(model_dir, None, chosen, device, batch_rows, workers)
        layout, vocab = m.load_features(model_dir, verify=False)
    else:
        model, layout, vocab = m.load_scoring(model_dir, device)
        predict = predictor(model_dir, model, chosen, device, batch_rows, workers, verify=False)
    load_seconds = time.perf_counter() - t0
    mapper = FeatureMapper(layout, vocab)
    root = Path(input_root) if input_root is not None else None
    sources = resolve_inputs(inputs, input_format, labels, block_bytes, root)
    if (days is not None or split is not None) and not any(isinstance(s, _Days) for s in sources):
        raise ValueError("--days and --split choose days of a preprocessed directory: none given")
    config = m.read_training_config(model_dir) if any(isinstance(s, _Days) for s in sources) else {}
    training_days: list[str] = []
    for src in sources:
        if isinstance(src, _Days):
            mapper.check_days(src.manifest, str(src.path))
            trained = select_rows(src, config, days, split)
            training_days += [f"{src.path}/day_{d}" for d in trained]
        elif not layout.raw_rows:
            why = (
                "it was trained on synthetic data"
                if layout.source != "criteo"
                else "its frequency-threshold vocabulary was not saved by preprocess"
            )
            raise FeatureError(f"{src.path}: the model cannot map raw Criteo rows ({why})")
    if training_days:  # ScoreResult.training_days carries it: the CLI says it once, on stderr
        logger.info(
            "scoring days the model trained on (%s): their AUC overstates the model's; "
            "--split test scores the rows it was tested on",
            ", ".join(training_days),
        )
    with_id = any(isinstance(s, _Raw) and s.layout.has_id for s in sources)
    if fmt == "kaggle" and not all(isinstance(s, _Raw) and s.layout.has_id for s in sources):
        raise ValueError(
            "--output-format kaggle writes Id,Predicted: every input must be a Kaggle CSV with "
            "an Id column"
        )
    with_label = any(
        (isinstance(s, _Raw) and s.layout.labeled)
        or (isinstance(s, _Days) and any(d["labeled"] for d in s.manifest["days"]))
        for s in sources
    )
    writer = _Output(out, output_format(out, fmt), with_id, with_label)
    metrics = StreamingMetrics() if with_label else None
    sink = _Sink(writer, metrics)
    opts = layout.parse_options(skip_bad_rows)
    state = _Progress(sources, progress, on_progress)
    try:
        for src in sources:
            if isinstance(src, _Raw):
                _score_raw(src, opts, mapper, predict, sink, state, workers, block_bytes)
            else:
                _score_days(src, mapper, predict, sink, state, batch_rows)
        sink.drain()
        sink.close()
        if state.rows == 0:
            raise CriteoFormatError("the inputs hold no rows")
        writer.commit()
    except BaseException:
        sink.close()
        writer.abort()
        raise
    finally:
        state.close()
    result_metrics = metrics.compute() if metrics is not None and metrics.rows else None
    mpath = None
    if result_metrics is not None:
        mpath = Path(metrics_path) if metrics_path else out.with_name(out.name + ".metrics.json")
        atomic_write_json(mpath, {**result_metrics, "model": str(Path(model_dir).absolute()),
                                  "inputs": [str(s.path) for s in sources]})  # fmt: skip
    if mapper.outside:
        logger.warning(
            "%d ids were outside their tables (never seen in training, uncapped data) and were "
            "hashed into them",
            mapper.outside,
        )
    if state.bad_rows:
        logger.warning("skipped %d malformed rows", state.bad_rows)
    seconds = time.perf_counter() - t0
    return ScoreResult(out, state.rows, seconds, state.bad_rows, result_metrics, mpath,
                       mapper.outside, state.bad_examples, training_days,
                       load_seconds)  # fmt: skip


class _Progress:
    """A tqdm bar on a terminal; off one (a job's log), a plain line at most every
    ``DLRM_VRGD_PROGRESS_EVERY_S`` seconds (default 10) and one at the end, each in one write,
    so that a log holds no carriage-return redraws (as the trainer's ``ProgressLine``)."""

    def __init__(
        self,
        sources: list[_Raw | _Days],
        show: bool,
        callback: Callable[[int, float, float], None] | None,
    ) -> None:
        from tqdm import tqdm

        total = 0
        for s in sources:
            if isinstance(s, _Raw):
                total += s.path.stat().st_size
            elif s.segments is not None:
                total += sum(b - a for _, a, b in s.segments) * _DAY_ROW_BYTES
            else:
                total += sum(d["rows"] for d in s.manifest["days"]) * _DAY_ROW_BYTES
        self.total = max(total, 1)
        self.stream = sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.plain = show and not (isatty and isatty())
        self.every_s = float(os.environ.get("DLRM_VRGD_PROGRESS_EVERY_S", "10"))
        self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="score",
                        disable=not show or self.plain)  # fmt: skip
        self.done_bytes = 0
        self.rows = 0
        self.bad_rows = 0
        self.bad_examples: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self.callback = callback

    def advance(self, nbytes: int, rows: int) -> None:
        self.rows += rows
        self.done_bytes += nbytes
        self.bar.update(nbytes)
        seconds = time.perf_counter() - self.t0
        rate = self.rows / seconds if seconds > 0 else 0.0
        self.bar.set_postfix_str(f"{self.rows:,} rows, {rate:,.0f} rows/s", refresh=False)
        if self.plain and time.perf_counter() - self._printed >= self.every_s:
            self._line()
        if self.callback is not None:
            self.callback(self.rows, seconds, min(1.0, self.done_bytes / self.total))

    _printed = -float("inf")

    def _line(self) -> None:
        self._printed = now = time.perf_counter()
        rate = self.rows / (now - self.t0) if now > self.t0 else 0.0
        fraction = min(1.0, self.done_bytes / self.total)
        self.stream.write(f"score {fraction:.0%} {self.rows:,} rows, {rate:,.0f} rows/s\n")
        self.stream.flush()

    def close(self) -> None:
        if self.plain and self.rows:
            self._line()
        self.bar.close()


#: bytes of one preprocessed row (13 float32 + 26 int64 + int32), for the progress bar
_DAY_ROW_BYTES = 13 * 4 + 26 * 8 + 4


def resolve_engine(
    model_dir: str | Path, engine: Engine, device: str
) -> Literal["onnxruntime", "torch"]:
    """The forward ``score`` runs: ONNX Runtime on ``model.onnx`` (``onnxruntime``, or
    ``auto`` with the file listed and ``device`` cpu), else the torch module."""
    if engine not in ("auto", "onnxruntime", "torch"):
        raise ValueError(f"--engine {engine!r}: not auto, onnxruntime or torch")
    if engine == "torch":
        return "torch"
    has_onnx = m.ONNX in m.read_manifest(Path(model_dir), verify=False)["files"]
    if engine == "onnxruntime" or (engine == "auto" and has_onnx and device == "cpu"):
        if not has_onnx:
            raise m.ModelError(
                f"{model_dir}: no {m.ONNX} for --engine onnxruntime (export it with --format "
                "onnx or all, or pass --engine torch)"
            )
        return "onnxruntime"
    return "torch"


def predictor(
    model_dir: str | Path,
    model: m.ScoringModel | None,
    engine: Engine,
    device: str,
    batch_rows: int,
    threads: int | None = None,
    verify: bool = True,
) -> Predict:
    """The forward of :func:`resolve_engine`: an :class:`~dlrm_vrgd.serve.onnx.OnnxScorer`,
    or the torch module ``model`` (loaded from ``model_dir`` when None). ``verify=False``: the
    caller has just verified every file of ``model_dir`` (ONNX Runtime's bytes are checked
    against the manifest all the same)."""
    if resolve_engine(model_dir, engine, device) == "onnxruntime":
        from dlrm_vrgd.serve.onnx import OnnxScorer

        logger.info("scoring with onnxruntime (%s)", m.ONNX)
        return OnnxScorer(model_dir, device=device, batch_rows=batch_rows, threads=threads,
                          verify=verify)  # fmt: skip
    torch_model = model if model is not None else m.load_model(model_dir, device, verify)
    return lambda dense, sparse: _predict(torch_model, dense, sparse, batch_rows, device)


@torch.no_grad()
def _predict(
    model: m.ScoringModel, dense: np.ndarray, sparse: np.ndarray, batch_rows: int, device: str
) -> np.ndarray:
    out = np.empty(len(dense), dtype=np.float32)
    for a in range(0, len(dense), batch_rows):
        d = torch.from_numpy(np.ascontiguousarray(dense[a : a + batch_rows], dtype=np.float32))
        s = torch.from_numpy(np.ascontiguousarray(sparse[a : a + batch_rows], dtype=np.int64))
        out[a : a + batch_rows] = model(d.to(device), s.to(device)).float().cpu().numpy()
    return out


def _score_raw(
    src: _Raw,
    opts: ParseOptions,
    mapper: FeatureMapper,
    predict: Predict,
    sink: _Sink,
    state: _Progress,
    workers: int | None,
    block_bytes: int,
) -> None:
    layout = src.layout
    name = str(src.path)
    workers = workers or len(os.sched_getaffinity(0))

    def work(block: bytearray) -> tuple[ParsedBlock, np.ndarray, pa.Array | None, np.ndarray]:
        """A parsing thread's work: a block's rows, their lines, Ids and table rows."""
        parsed = parse_block(block, layout, opts)
        lines = block_lines(block, parsed)
        ids = first_fields(block, lines, layout.delimiter) if layout.has_id else None
        sparse = mapper.raw_ids(parsed.sparse) if len(parsed) else parsed.sparse
        return parsed, lines, ids, sparse

    next_line = 1
    seen = 0
    reader = BlockReader(src.path, block_bytes, src.root)
    pending: deque[tuple[Future[Any], int]] = deque()

    def consume() -> None:
        """This thread's work: the model on a parsed block, its rows handed to the sink."""
        nonlocal next_line, seen
        fut, position = pending.popleft()
        try:
            parsed, lines, ids, sparse = fut.result()
        except MalformedRowError as err:  # numbered from the block: renumber in the file
            raise MalformedRowError(err.path, err.line + next_line - 1, err.reason) from None
        offset = next_line
        next_line += parsed.lines
        for b in parsed.bad_rows[: max(0, _BAD_ROW_EXAMPLES - len(state.bad_examples))]:
            state.bad_examples.append({"path": name, "line": b.line + offset - 1,
                                       "reason": b.reason})  # fmt: skip
        state.bad_rows += len(parsed.bad_rows)
        if len(parsed):
            probs = predict(parsed.dense, sparse)
            labels = parsed.labels if layout.labeled else None
            sink.put(_Scored(name, lines + offset, ids, labels, probs))
        state.advance(position - seen, len(parsed))
        seen = position

    if layout.has_header:
        next_line = 2

    def submitted(pool: ThreadPoolExecutor) -> Iterator[tuple[Future[Any], int]]:
        """The reader thread's work: read each block, hand its pieces to parsing threads."""
        first = True
        before = 0  # file position before the block (progress: pieces by their share)
        for block in reader.blocks():
            if first and layout.has_header:
                del block[: block.find(b"\n") + 1]
            first = False
            done, size, read = 0, len(block), reader.position - before
            for piece in pieces(block, PIECE_BYTES):
                done += len(piece)
                yield pool.submit(work, piece), before + read * done // max(size, 1)
            before = reader.position

    # a reader thread reads blocks and submits their pieces for parsing and mapping, at most
    # `workers` ahead of this thread, which runs the model; the sink's thread writes: all
    # overlap, and one block and at most `workers + 2` pieces are in flight, whatever the
    # input length
    with ThreadPoolExecutor(workers, thread_name_prefix="score-parse") as pool:
        try:
            ahead = prefetch(submitted(pool), workers, lambda item: item[0].cancel(),
                             name="score-read")  # fmt: skip
            with closing(ahead):
                for item in ahead:
                    pending.append(item)
                    consume()
        except BaseException:
            for fut, _ in pending:
                fut.cancel()
            raise


def pieces(block: bytearray, size: int) -> Iterator[bytearray]:
    """``block`` (whole lines) cut after the first line end at or past every ``size`` bytes:
    pieces of whole lines, about ``size`` each (a longer line whole), in order."""
    start = 0
    while start < len(block):
        end = block.find(b"\n", min(start + size, len(block)) - 1) + 1 or len(block)
        yield block if start == 0 and end == len(block) else block[start:end]
        start = end


def _iter_days(src: _Days, mapper: FeatureMapper) -> Iterator[tuple[str, Any, int, int]]:
    """``(name, day, start, stop)`` of each row range of ``src`` to score."""
    from dlrm_vrgd.data.criteo.source import CriteoDataError, CriteoDays

    try:
        store = CriteoDays(src.path)
    except CriteoDataError as err:
        raise FeatureError(str(err)) from None
    by_index = {d.index: d for d in store.days}
    segments = src.segments or [(d.index, 0, d.rows) for d in store.days]
    for index, start, stop in segments:
        yield f"{src.path}/day_{index}", by_index[index], start, stop


def _days_of(src: _Days) -> dict[int, int]:
    """Day index -> rows of a preprocessed directory (its manifest, checked)."""
    from dlrm_vrgd.data.criteo.source import CriteoDataError, CriteoDays

    try:
        return {d.index: d.rows for d in CriteoDays(src.path).days}
    except CriteoDataError as err:
        raise FeatureError(str(err)) from None


def _model_splits(src: _Days, config: dict[str, Any]) -> Any:
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


def select_rows(
    src: _Days, config: dict[str, Any], days: Sequence[int] | None, split: Split | None
) -> list[int]:
    """Restrict ``src`` to ``days`` or to the model's ``split`` of it; the training days of
    the model among the days it will score (for a warning), when ``src`` is the model's
    training data."""
    held = _days_of(src)
    if days is not None:
        unknown = sorted(set(days) - set(held))
        if unknown:
            raise FeatureError(
                f"{src.path}: --days {','.join(map(str, unknown))}: no such day "
                f"(it holds {', '.join(map(str, sorted(held)))})"
            )
        src.segments = [(d, 0, held[d]) for d in days]
    elif split is not None:
        src.segments = list(getattr(_model_splits(src, config), split).segments)
    if not _is_training_data(src, config):
        return []
    try:
        train = {d for d, _, _ in _model_splits(src, config).train.segments}
    except FeatureError:
        return []
    scored = src.segments or [(d, 0, n) for d, n in held.items()]
    return sorted({d for d, a, b in scored if d in train and b > a})


def _is_training_data(src: _Days, config: dict[str, Any]) -> bool:
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


def _score_days(
    src: _Days,
    mapper: FeatureMapper,
    predict: Predict,
    sink: _Sink,
    state: _Progress,
    batch_rows: int,
) -> None:
    step = max(batch_rows, 65_536)
    for name, day, start, stop in _iter_days(src, mapper):
        for a in range(start, stop, step):
            b = min(a + step, stop)
            sparse = mapper.day_ids(np.array(day.sparse[a:b], dtype=np.int64))
            probs = predict(np.array(day.dense[a:b]), sparse)
            labels = np.asarray(day.labels[a:b, 0], dtype=np.int32) if day.labeled else None
            sink.put(_Scored(name, np.arange(a + 1, b + 1, dtype=np.int64), None, labels, probs))
            state.advance((b - a) * _DAY_ROW_BYTES, b - a)


def summary_lines(result: ScoreResult) -> list[str]:
    """What a run produced, for people (the CLI prints it)."""
    lines = [
        f"scored {result.rows:,} rows in {result.seconds:.1f} s "
        f"({result.rows_per_second:,.0f} rows/s) -> {result.out}"
    ]
    if result.bad_rows:
        first = result.bad_row_examples[0]
        lines.append(
            f"  skipped {result.bad_rows:,} malformed rows; first {first['path']}:"
            f"{first['line']}: {first['reason']}"
        )
    if result.metrics is not None:
        mm = result.metrics
        lines.append(
            f"  {int(mm['rows']):,} labelled rows: AUC {mm['auc']:.4f}  logloss "
            f"{mm['logloss']:.4f}  NE {mm['ne']:.4f}  calibration {mm['calibration']:.4f} "
            f"-> {result.metrics_path}"
        )
    return lines
