"""``dlrm-vrgd score``: click probabilities of raw Criteo rows (or preprocessed days).

Inputs, in the order given (a directory holding a preprocessed ``manifest.json`` is a set of
day files; any other directory stands for its files in natural order):

* raw Criteo text exactly as ``preprocess`` reads it (:mod:`~dlrm_vrgd.serve.score.raw`);
* preprocessed day files (:mod:`~dlrm_vrgd.serve.score.days`).

A file given twice is refused. Raw text is read a block at a time and parsed in a thread pool,
scored ``batch_rows`` rows at a time by ONNX Runtime on ``model.onnx`` or the torch module
(``engine``, :mod:`~dlrm_vrgd.serve.score.engine`), and written by a thread of its own
(:mod:`~dlrm_vrgd.serve.score.sinks`, two blocks behind at most). Reading, parsing, the model
and writing overlap, and memory is bounded by the block size, not the input length. Whichever
engine scores, every file of the model directory is verified.

Output (CSV, or Parquet when the name ends in ``.parquet``/``.pq`` or ``fmt="parquet"``): one
row per scored input row, in input order, with columns ``file``, ``line`` (the line in the raw
file, header included, 1-based; for day files the 1-based row of the day), ``Id`` (when any
input has one), ``label`` (when any input has labels) and ``probability``. It is written under a
temporary name and renamed when complete. With labels, the metrics (AUC, logloss, NE,
calibration) are computed on the fly (:class:`~dlrm_vrgd.serve.score.sinks.StreamingMetrics`)
and written next to the output (``OUT.metrics.json``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlrm_vrgd.data.criteo.format import (
    CriteoFormatError,
    Format,
    LabelsMode,
    check_in_root,
    expand_inputs,
)
from dlrm_vrgd.rundir import atomic_write_json
from dlrm_vrgd.serve import model as m
from dlrm_vrgd.serve.features import FeatureError, FeatureMapper
from dlrm_vrgd.serve.score.days import (
    DaysInput,
    Split,
    check_bags,
    open_days,
    score_days,
    select_rows,
)
from dlrm_vrgd.serve.score.engine import Engine, load_engine
from dlrm_vrgd.serve.score.progress import Progress
from dlrm_vrgd.serve.score.raw import BLOCK_BYTES, RawInput, open_raw, score_raw
from dlrm_vrgd.serve.score.sinks import (
    OutputFile,
    OutputFormat,
    Sink,
    StreamingMetrics,
    output_format,
)

logger = logging.getLogger(__name__)


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


def resolve_inputs(
    paths: Sequence[str | Path],
    fmt: Format,
    labels: LabelsMode,
    block_bytes: int,
    root: Path | None = None,
) -> list[RawInput | DaysInput]:
    """Every input with its layout (raw) or manifest (days), in order. With ``root``, every
    file is checked to lie inside it (real path, no links), here and again when it is opened
    (:func:`~dlrm_vrgd.data.criteo.format.open_input`). A file given twice (also through a
    directory that holds it) is refused: its rows would be scored twice."""
    out: list[RawInput | DaysInput] = []
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
        days = open_days(p, root)
        if days is not None:
            once(p)
            out.append(days)
            continue
        for f in expand_inputs([p], root):
            once(f)
            out.append(open_raw(f, fmt, labels, block_bytes, root))
    if not out:
        raise FileNotFoundError("no input files")
    return out


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
    the forward of ONNX Runtime on ``model.onnx`` or of the torch module
    (:func:`~dlrm_vrgd.serve.score.engine.predictor`)."""
    t0 = time.perf_counter()
    out = Path(out).absolute()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists: pass --overwrite or another --out")
    if batch_rows < 1:
        raise ValueError("--batch-rows must be >= 1")
    if days is not None and split is not None:
        raise ValueError("--days and --split pick rows two ways: pass one")
    predict, layout, vocab = load_engine(model_dir, engine, device, batch_rows, workers)
    load_seconds = time.perf_counter() - t0
    mapper = FeatureMapper(layout, vocab)
    root = Path(input_root) if input_root is not None else None
    sources = resolve_inputs(inputs, input_format, labels, block_bytes, root)
    day_sources = [s for s in sources if isinstance(s, DaysInput)]
    if (days is not None or split is not None) and not day_sources:
        raise ValueError("--days and --split choose days of a preprocessed directory: none given")
    config = m.read_training_config(model_dir) if day_sources else {}
    training_days: list[str] = []
    for src in sources:
        if isinstance(src, DaysInput):
            mapper.check_days(src.manifest, str(src.path))
            trained = select_rows(src, config, days, split)
            check_bags(src, mapper)
            training_days += [f"{src.path}/day_{d}" for d in trained]
        elif not layout.raw_rows:
            why = (
                "it was trained on synthetic data"
                if layout.source != "criteo"
                else "it was trained on materialized multi-hot ids and does not record how "
                "they were made from one-hot ids"
                if not layout.one_hot_rows
                else "its frequency-threshold vocabulary was not saved by preprocess"
            )
            raise FeatureError(f"{src.path}: the model cannot map raw Criteo rows ({why})")
    if training_days:  # ScoreResult.training_days carries it: the CLI says it once, on stderr
        logger.info(
            "scoring days the model trained on (%s): their AUC overstates the model's; "
            "--split test scores the rows it was tested on",
            ", ".join(training_days),
        )
    if fmt == "kaggle" and not all(s.has_id for s in sources):
        raise ValueError(
            "--output-format kaggle writes Id,Predicted: every input must be a Kaggle CSV with "
            "an Id column"
        )
    with_label = any(s.labeled for s in sources)
    writer = OutputFile(out, output_format(out, fmt), any(s.has_id for s in sources), with_label)
    metrics = StreamingMetrics() if with_label else None
    sink = Sink(writer, metrics)
    opts = layout.parse_options(skip_bad_rows)
    state = Progress(sum(s.nbytes for s in sources), progress, on_progress)
    try:
        for src in sources:
            if isinstance(src, RawInput):
                score_raw(src, opts, mapper, predict, sink, state, workers, block_bytes)
            else:
                score_days(src, mapper, predict, sink, state, batch_rows)
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
