"""``dlrm-vrgd preprocess``: raw Criteo click logs -> day files in torchrec's npy layout.

```
OUT/
  day_{i}_dense.npy    N x 13 float32   log(max(x, floor) - floor + 2), missing = 0 (criteo.parse)
  day_{i}_sparse.npy   N x 26 int64     categorical ids, hashed / capped / compacted (below)
  day_{i}_labels.npy   N x 1  int32     0 / 1 (-1 for unlabeled inputs such as Kaggle test.txt)
  manifest.json        inputs, options, days (rows, shapes, SHA-256 of every file), cardinalities
```

Every input file becomes one day (``--rows-per-day R`` cuts each input into days of R rows:
Kaggle's ``train.txt`` is 7 days of data, ``R = 6548660`` gives the 7 days DLRM recipes use).
``--split 0.8,0.1,0.1`` cuts one input, in file order, into three days: train (day 0), val
(day 1) and test (day 2); the fractions are of its non-blank lines (counted in a first pass),
so rows skipped as malformed shorten the split they fall in. The manifest's ``splits`` names the
days, and training reads them as its default ``data.train_days`` / ``val_days`` / ``test_days``.

Categorical ids (the hex value ``v``; missing = 0, as torchrec):

* no cap: ``v`` itself (torchrec's ``tsv_to_npys`` layout); a table cap can still be applied at
  read time (``data.max_rows_per_table``, torchrec's ``id % num_embeddings``);
* ``--max-rows-per-table N`` (one N, or 26 comma-separated): ``v % N``, the same hash;
* ``--frequency-threshold F`` (needs a cap): ids seen fewer than ``F`` times over *all* inputs
  (after the cap) share row 0; the others get rows ``1..K`` in increasing order of ``v % N``,
  so each table has ``K + 1`` rows. Counting takes 4 bytes per capped row; the ids are written
  capped in one parsing pass, then remapped in place (no second parse).

Streaming in bounded memory: blocks of ~16 MiB of text are parsed by ``workers`` threads
(pyarrow releases the GIL), at most ``workers + 1`` blocks in flight; the npy files are
appended to and get their final header at the end. Everything is written into a hidden staging
directory next to ``OUT``; the manifest is written last and the directory is renamed to ``OUT``
only when complete, so an interrupted run leaves no ``OUT`` (and no manifest) to trust.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlrm_vrgd.data.criteo.format import (
    NUM_CAT,
    NUM_INT,
    BlockReader,
    CriteoFormatError,
    Format,
    LabelsMode,
    Layout,
    MalformedRowError,
    detect_layout,
    expand_inputs,
)
from dlrm_vrgd.data.criteo.frequency import FrequencyCounts, remap_day
from dlrm_vrgd.data.criteo.output import (
    KINDS,
    MANIFEST,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    DayWriter,
    day_file,
    prepare_staging,
    publish,
    sha256_file,
)
from dlrm_vrgd.data.criteo.parse import (
    DEFAULT_DENSE_FLOOR,
    ParsedBlock,
    ParseOptions,
    parse_block,
    parse_caps,
)
from dlrm_vrgd.rundir import atomic_write_json

logger = logging.getLogger(__name__)

_BAD_ROW_EXAMPLES = 20
#: With a frequency threshold: every table's kept (capped) ids, concatenated, increasing.
VOCAB = "vocab.npy"


# ---------------------------------------------------------------------------------- run
@dataclass
class _InputState:
    index: int
    path: Path
    layout: Layout | None = None
    rows: int = 0
    bad_rows: int = 0
    padded_rows: int = 0
    missing_labels: int = 0
    clamped_values: int = 0
    days: list[int] = field(default_factory=list)
    ends_with_newline: bool = True
    next_line: int = 1  # the file's line number of the next block to consume
    bad_examples: list[dict[str, Any]] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "path": str(self.path),
            "bytes": self.path.stat().st_size,
            "format": lay.format if lay else None,
            "gzip": lay.gzip if lay else None,
            "header": lay.has_header if lay else None,
            "labeled": lay.labeled if lay else None,
            "rows": self.rows,
            "bad_rows": self.bad_rows,
            "padded_rows": self.padded_rows,
            "missing_labels": self.missing_labels,
            "clamped_dense_values": self.clamped_values,
            "days": self.days,
        }


@dataclass
class PreprocessResult:
    out: Path
    manifest: dict[str, Any]
    seconds: float

    @property
    def rows(self) -> int:
        return int(self.manifest["rows"])


def preprocess(
    inputs: Sequence[str | Path],
    out: str | Path,
    *,
    fmt: Format = "auto",
    max_rows_per_table: int | str | Sequence[int] | None = None,
    frequency_threshold: int = 0,
    skip_bad_rows: bool = False,
    rows_per_day: int | None = None,
    split: Sequence[float] | None = None,
    labels: LabelsMode = "auto",
    dense_floor: int = DEFAULT_DENSE_FLOOR,
    overwrite: bool = False,
    workers: int | None = None,
    block_bytes: int = 16 << 20,
    progress: bool = True,
) -> PreprocessResult:
    """Convert raw Criteo files to day files in ``out`` (see the module docstring)."""
    t0 = time.perf_counter()
    caps = parse_caps(max_rows_per_table)
    if frequency_threshold < 0:
        raise ValueError("--frequency-threshold must be >= 0")
    if frequency_threshold and caps is None:
        raise ValueError(
            "--frequency-threshold needs --max-rows-per-table: ids are counted per capped "
            "table row (4 bytes each), which bounds the memory"
        )
    if rows_per_day is not None and rows_per_day < 1:
        raise ValueError("--rows-per-day must be >= 1")
    files = expand_inputs(inputs)
    day_limits = None
    if split is not None:
        day_limits = split_rows(files, split, rows_per_day, fmt, labels, block_bytes)
    out = Path(out).absolute()
    workers = workers or len(os.sched_getaffinity(0))
    opts = ParseOptions(caps=caps, dense_floor=dense_floor, skip_bad_rows=skip_bad_rows)
    staging = prepare_staging(out, overwrite)
    try:
        manifest = _run(
            files, staging, opts, fmt, labels, frequency_threshold, rows_per_day, day_limits,
            workers, block_bytes, progress,
        )  # fmt: skip
        if split is not None:
            manifest["splits"] = {
                "fractions": [float(f) for f in split],
                "train_days": [0], "val_days": [1], "test_days": [2],
            }  # fmt: skip
        atomic_write_json(staging / MANIFEST, manifest)
        os.chmod(staging / MANIFEST, 0o644)  # a data set, readable like the npy files
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    logger.info("preprocessed %d rows into %s in %.1f s", manifest["rows"], out, seconds)
    return PreprocessResult(out, manifest, seconds)


def parse_split(text: str) -> list[float]:
    """``"0.8,0.1,0.1"`` -> three positive fractions summing to 1 (train, val, test)."""
    try:
        parts = [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--split: {text!r} is not three fractions such as 0.8,0.1,0.1") from None
    if len(parts) != 3 or min(parts) <= 0 or abs(sum(parts) - 1.0) > 1e-6:
        raise ValueError(
            f"--split: {text!r}: expected three positive fractions (train, val, test) summing to 1"
        )
    return parts


def split_rows(
    files: list[Path],
    split: Sequence[float],
    rows_per_day: int | None,
    fmt: Format,
    labels: LabelsMode,
    block_bytes: int,
) -> list[int]:
    """The rows of the train and val days of ``--split`` (test takes the rest), from a count of
    the input's non-blank lines (its header left out)."""
    if rows_per_day is not None:
        raise ValueError("--split and --rows-per-day both cut the input into days: pass one")
    if len(files) != 1:
        raise ValueError(
            f"--split cuts one input into train, val and test; got {len(files)} files "
            "(concatenate them first, or train on whole days with data.train_days)"
        )
    reader = BlockReader(files[0], block_bytes)
    lines = 0
    for i, block in enumerate(reader.blocks()):
        if i == 0 and detect_layout(str(files[0]), block, fmt, labels, reader.gzip).has_header:
            del block[: block.find(b"\n") + 1]
        lines += _nonblank(block.replace(b"\r\n", b"\n") if b"\r" in block else block)
    train, val = round(split[0] * lines), round(split[1] * lines)
    if min(train, val, lines - train - val) < 1:
        raise ValueError(f"--split: {files[0]} has {lines} rows, too few for three non-empty days")
    return [train, val]


def _nonblank(block: bytes | bytearray) -> int:
    """Non-empty lines of ``block`` (a last line without its newline counts)."""
    ends = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == ord("\n"))
    ends = np.append(ends, len(block))  # the text after the last newline (maybe none)
    return int(np.count_nonzero(np.diff(ends, prepend=-1) > 1))


def _run(
    files: list[Path],
    staging: Path,
    opts: ParseOptions,
    fmt: Format,
    labels: LabelsMode,
    threshold: int,
    rows_per_day: int | None,
    day_limits: list[int] | None,
    workers: int,
    block_bytes: int,
    progress: bool,
) -> dict[str, Any]:
    from tqdm import tqdm

    states = [_InputState(i, f) for i, f in enumerate(files)]
    days: list[DayWriter] = []
    counts = FrequencyCounts(opts.caps, threshold) if threshold and opts.caps is not None else None
    caps_list = [int(c) for c in opts.caps] if opts.caps is not None else []
    id_max = np.zeros(NUM_CAT, dtype=np.uint64)
    hasher = ThreadPoolExecutor(1, thread_name_prefix="criteo-sha256")
    current: DayWriter | None = None

    def limit(day: DayWriter) -> int | None:
        """The most rows ``day`` takes (None: the rest of its input)."""
        if day_limits is not None:
            return day_limits[day.index] if day.index < len(day_limits) else None
        return rows_per_day

    def close_day(day: DayWriter) -> None:
        day.close()
        # with a threshold, the sparse file is rewritten (and then hashed) at the end
        for kind in KINDS if counts is None else ("dense", "labels"):
            day.hashes[kind] = hasher.submit(sha256_file, day.files[kind].path, sync=True)

    def consume(fut: Future[tuple[ParsedBlock, Any]], state: _InputState) -> None:
        nonlocal current, id_max
        try:
            block, contribution = fut.result()
        except MalformedRowError as err:  # numbered from the block: renumber in the file
            raise MalformedRowError(err.path, err.line + state.next_line - 1, err.reason) from None
        offset = state.next_line - 1
        state.next_line += block.lines
        if counts is not None:
            counts.add(contribution, len(block))
        np.maximum(id_max, block.id_max, out=id_max)
        state.rows += len(block)
        state.bad_rows += len(block.bad_rows)
        state.padded_rows += block.padded_rows
        state.missing_labels += block.missing_labels
        state.clamped_values += block.clamped_values
        for b in block.bad_rows[: max(0, _BAD_ROW_EXAMPLES - len(state.bad_examples))]:
            state.bad_examples.append(
                {"path": str(state.path), "line": b.line + offset, "reason": b.reason}
            )
        pos = 0
        while pos < len(block):
            cap = limit(current) if current is not None else None
            full = current is not None and cap is not None and current.rows >= cap
            if current is None or current.input_index != state.index or full:
                if current is not None:
                    close_day(current)
                start = 0 if current is None or current.input_index != state.index else (
                    current.input_row + current.rows
                )  # fmt: skip
                assert state.layout is not None
                current = DayWriter(len(days), state.index, start, staging, state.layout.labeled)
                days.append(current)
                state.days.append(current.index)
            take = len(block) - pos
            cap = limit(current)
            if cap is not None:
                take = min(take, cap - current.rows)
            current.append(block, pos, pos + take)
            pos += take

    def work(block: bytearray, layout: Layout) -> tuple[ParsedBlock, Any]:
        parsed = parse_block(block, layout, opts)
        contribution = FrequencyCounts.contribution(parsed.sparse, caps_list) if counts else None
        return parsed, contribution

    total = sum(f.stat().st_size for f in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="preprocess", disable=not progress)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="criteo-parse")
    ok = False
    try:
        pending: deque[tuple[Future[tuple[ParsedBlock, Any]], _InputState]] = deque()
        for state in states:
            reader = BlockReader(state.path, block_bytes)
            seen = 0
            for block in reader.blocks():
                if state.layout is None:
                    state.layout = detect_layout(str(state.path), block, fmt, labels, reader.gzip)
                    if state.layout.has_header:
                        del block[: block.find(b"\n") + 1]
                        state.next_line = 2
                pending.append((pool.submit(work, block, state.layout), state))
                bar.update(reader.position - seen)
                seen = reader.position
                while len(pending) > workers:
                    consume(*pending.popleft())
                    bar.set_postfix_str(f"{sum(s.rows for s in states):,} rows", refresh=False)
            bar.update(state.path.stat().st_size - seen)
            state.ends_with_newline = reader.ends_with_newline
        while pending:
            consume(*pending.popleft())
        if current is not None:
            close_day(current)
            current = None
        bar.close()
        manifest = _finish(files, states, days, staging, opts, threshold, counts, id_max, hasher)
        ok = True
        return manifest
    finally:
        bar.close()
        pool.shutdown(wait=True, cancel_futures=True)
        hasher.shutdown(wait=True, cancel_futures=not ok)
        if current is not None:
            current.abort()


def _finish(
    files: list[Path],
    states: list[_InputState],
    days: list[DayWriter],
    staging: Path,
    opts: ParseOptions,
    threshold: int,
    counts: FrequencyCounts | None,
    id_max: np.ndarray,
    hasher: ThreadPoolExecutor,
) -> dict[str, Any]:
    """Warnings, the frequency remap, checksums and the manifest, once every block is in."""
    for state in states:
        if state.rows == 0:
            logger.warning("%s: no rows", state.path)
        if not state.ends_with_newline:
            logger.warning(
                "%s does not end with a newline: its last line may be truncated", state.path
            )
        if state.bad_rows:
            logger.warning("%s: skipped %d malformed rows", state.path, state.bad_rows)
        if state.missing_labels:
            logger.warning(
                "%s: %d rows have an empty label (read as 0, like torchrec)",
                state.path,
                state.missing_labels,
            )
        if state.clamped_values:
            logger.warning(
                "%s: %d dense values below %d were clamped to it",
                state.path,
                state.clamped_values,
                opts.dense_floor,
            )
    if not days:
        raise CriteoFormatError("the inputs hold no rows")

    caps_list = [int(c) for c in opts.caps] if opts.caps is not None else []
    vocab: dict[str, Any] | None = None
    if counts is not None:
        logger.info("frequency threshold %d: remapping the sparse ids", threshold)
        remaps = counts.remaps()
        cardinalities = [int(r.max()) + 1 for r in remaps]
        # the kept ids of every table, in order: row 1 + rank, for mapping raw rows later
        # (dlrm_vrgd.serve.features)
        vocab_path = staging / VOCAB
        np.save(vocab_path, np.concatenate([np.flatnonzero(r) for r in remaps]).astype(np.int64))
        vocab = {
            "file": VOCAB,
            "bytes": vocab_path.stat().st_size,
            "sha256": sha256_file(vocab_path, sync=True),
        }
        for day in days:
            path = staging / day_file(day.index, "sparse")
            remap_day(path, remaps)
            day.hashes["sparse"] = hasher.submit(sha256_file, path, sync=True)
        del remaps
    elif opts.caps is not None:
        cardinalities = caps_list
    else:
        cardinalities = [int(m) + 1 for m in id_max]
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "rows": sum(d.rows for d in days),
        "num_dense": NUM_INT,
        "num_sparse": NUM_CAT,
        "dense_transform": {
            "rule": "log(max(x, floor) - floor + 2), missing x = 0",
            "floor": opts.dense_floor,
        },
        "sparse": {
            "max_rows_per_table": caps_list or None,
            "frequency_threshold": threshold,
            "cardinalities": cardinalities,
            "vocab": vocab,
        },
        "skip_bad_rows": opts.skip_bad_rows,
        "bad_rows": sum(s.bad_rows for s in states),
        "bad_row_examples": [b for s in states for b in s.bad_examples][:_BAD_ROW_EXAMPLES],
        "inputs": [s.record() for s in states],
        "days": [day.record(str(files[day.input_index])) for day in days],
    }


def summary_lines(result: PreprocessResult) -> list[str]:
    """What a run produced, for people (the CLI prints it)."""
    m = result.manifest
    rate = result.rows / result.seconds if result.seconds > 0 else float("nan")
    lines = [
        f"preprocessed {result.rows:,} rows from {len(m['inputs'])} input(s) into "
        f"{len(m['days'])} day(s) in {result.seconds:.1f} s ({rate:,.0f} rows/s) -> {result.out}"
    ]
    for d in m["days"]:
        src = d["source"]
        clicks = f"{d['positives'] / max(d['rows'], 1):.1%} clicks" if d["labeled"] else "no labels"
        lines.append(
            f"  day {d['day']}: {d['rows']:,} rows ({clicks}) from {Path(src['path']).name} "
            f"rows {src['rows'][0]:,}-{src['rows'][1]:,}"
        )
    if m.get("splits"):
        sp = m["splits"]
        fractions = "/".join(f"{f:g}" for f in sp["fractions"])
        lines.append(
            f"  split {fractions}: train day {sp['train_days'][0]}, val day "
            f"{sp['val_days'][0]}, test day {sp['test_days'][0]} (training reads them so)"
        )
    sp = m["sparse"]
    cards = sp["cardinalities"]
    rule = "ids as written (uncapped)"
    if sp["max_rows_per_table"]:
        rule = "id % cap"
        if sp["frequency_threshold"]:
            rule += f", ids seen < {sp['frequency_threshold']} times -> row 0"
    lines.append(
        f"  tables: {len(cards)} ({rule}); rows {min(cards):,} .. {max(cards):,}, "
        f"{sum(cards):,} in all"
    )
    if m["bad_rows"]:
        first = m["bad_row_examples"][0]
        lines.append(
            f"  skipped {m['bad_rows']:,} malformed rows; first {first['path']}:{first['line']}: "
            f"{first['reason']}"
        )
    return lines
