"""Synthetic data written to files: the Criteo day layout that ``data.source: criteo`` reads
(:func:`generate_days`, ``dlrm-vrgd generate``), or one split as torchrec's ``{split}_*.npy``
(:func:`export_split`, ``dlrm-vrgd generate --split``).

A large synthetic job generates its rows once, in parallel over the cores, and then trains
from the day files at the reader's speed (docs/input.md)::

    OUT/
      day_{i}_dense.npy    N x F float32   log1p(count), as the synthetic source gives them
      day_{i}_sparse.npy   N x T int64     ids
      day_{i}_labels.npy   N x 1 int32     0 / 1
      day_{i}_probs.npy    N float32       the true click probabilities (the oracle's)
      day_{i}_sparse_multi_hot.npz         instead of day_{i}_sparse.npy with ``multi_hot``:
                           MLPerf DLRMv2's layout, one ``{k}.npy`` (N x s_k int32) a table,
                           the ids made multi-hot by MLPerf's synthesis (data/multihot.py)
      manifest.json        the Criteo source's manifest (rows, shapes, SHA-256 of every file,
                           cardinalities, the days of each split) and ``generated``: the data
                           config and the oracle metrics of every split

The train split becomes days ``0..D-1`` (``rows_per_day`` rows each, the last shorter), val
day ``D`` and test day ``D+1``; the manifest's ``splits`` makes them the default
``data.train_days`` / ``val_days`` / ``test_days``. Every row is the synthetic source's row
(a pure function of the seed, the split and its chunk), so reading the train days in the same
order (``data.shuffle_block_rows`` = ``chunk_rows``, same ``run.seed``) trains exactly the run
that live synthetic data trains. The output directory appears only once complete (a staging
directory is renamed), as ``dlrm-vrgd preprocess``'s does.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.format import open_memmap

from dlrm_vrgd.config import SyntheticData, TrainConfig
from dlrm_vrgd.data.criteo.output import (
    MANIFEST,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    day_file,
    prepare_staging,
    publish,
    sha256_file,
)
from dlrm_vrgd.data.synthetic import SPLITS, SyntheticCriteo
from dlrm_vrgd.rundir import atomic_write_json

logger = logging.getLogger(__name__)

#: The oracle metrics of a split are computed on at most this many of its first rows.
ORACLE_ROWS = 16_000_000
#: Rows a generation task covers (whole chunks): large enough that a task's overhead is small.
TASK_ROWS = 262_144
KINDS = ("dense", "sparse", "labels", "probs")


@dataclass(frozen=True)
class DayPlan:
    """Day ``day`` holds rows ``[start, start + rows)`` of ``split``."""

    day: int
    split: str
    start: int
    rows: int


@dataclass
class GenerateResult:
    out: Path
    manifest: dict[str, Any]
    seconds: float
    workers: int

    @property
    def rows(self) -> int:
        return int(self.manifest["rows"])


def plan_days(data: SyntheticData, rows_per_day: int | None) -> list[DayPlan]:
    """Train days of ``rows_per_day`` rows (None: one day), then one val and one test day."""
    days: list[DayPlan] = []
    train = data.train_rows
    per = train if rows_per_day is None else rows_per_day
    for start in range(0, train, per):
        days.append(DayPlan(len(days), "train", start, min(per, train - start)))
    for split, rows in (("val", data.val_rows), ("test", data.test_rows)):
        days.append(DayPlan(len(days), split, 0, rows))
    return days


def _specs(day: DayPlan, num_dense: int, num_tables: int) -> dict[str, tuple[tuple[int, ...], str]]:
    n = day.rows
    return {
        "dense": ((n, num_dense), "<f4"),
        "sparse": ((n, num_tables), "<i8"),
        "labels": ((n, 1), "<i4"),
        "probs": ((n,), "<f4"),
    }


# ------------------------------------------------------------------------------ workers
#: The generator of the run being written, set before the workers are forked (they inherit
#: it, with its teacher already calibrated: nothing is pickled).
_GEN: SyntheticCriteo | None = None


def _write_chunks(
    staging: str, split: str, chunks: tuple[int, int], days: list[DayPlan]
) -> dict[int, int]:
    """Generate chunks ``[c0, c1)`` of ``split`` and write each row into its day's files;
    returns the clicks written per day."""
    gen = _GEN
    assert gen is not None
    size = gen.cfg.chunk_rows
    maps: dict[tuple[int, str], np.ndarray] = {}
    clicks: dict[int, int] = {}
    for c in range(*chunks):
        rows = gen.generate(split, c)
        lo, hi = c * size, c * size + len(rows)
        for day in days:
            a, b = max(lo, day.start), min(hi, day.start + day.rows)
            if day.split != split or a >= b:
                continue
            src, dst = slice(a - lo, b - lo), slice(a - day.start, b - day.start)
            for kind in KINDS:
                key = (day.day, kind)
                if key not in maps:
                    path = Path(staging) / day_file(day.day, kind)
                    maps[key] = np.load(path, mmap_mode="r+")
            maps[(day.day, "dense")][dst] = rows.dense[src]
            maps[(day.day, "sparse")][dst] = rows.sparse[src]
            maps[(day.day, "labels")][dst, 0] = rows.labels[src]
            maps[(day.day, "probs")][dst] = rows.probs[src]  # type: ignore[index]
            clicks[day.day] = clicks.get(day.day, 0) + int(np.count_nonzero(rows.labels[src]))
    for arr in maps.values():
        arr.flush()  # type: ignore[attr-defined]
    return clicks


def _worker_init(parent: int) -> None:
    """A generating process ignores Ctrl-C (the parent stops it) and dies with the parent."""
    import signal

    from dlrm_vrgd.data.pipeline.processes import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)


def _tasks(gen: SyntheticCriteo, days: list[DayPlan]) -> list[tuple[str, tuple[int, int]]]:
    size = gen.cfg.chunk_rows
    per_task = max(1, TASK_ROWS // size)
    out = []
    for split in SPLITS:
        chunks = -(-gen.split_rows(split) // size)
        out += [(split, (c, min(c + per_task, chunks))) for c in range(0, chunks, per_task)]
    return out


def _run_tasks(
    staging: Path,
    tasks: list[tuple[str, tuple[int, int]]],
    days: list[DayPlan],
    workers: int,
    advance: Callable[[int], None],
    rows_of: Callable[[str, tuple[int, int]], int],
) -> dict[int, int]:
    clicks: dict[int, int] = {}

    def add(split: str, chunks: tuple[int, int], got: dict[int, int]) -> None:
        for day, n in got.items():
            clicks[day] = clicks.get(day, 0) + n
        advance(rows_of(split, chunks))

    if workers == 1:
        for split, chunks in tasks:
            add(split, chunks, _write_chunks(str(staging), split, chunks, days))
        return clicks
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    pool = ProcessPoolExecutor(workers, ctx, initializer=_worker_init, initargs=(os.getpid(),))
    try:
        futures: dict[Future[dict[int, int]], tuple[str, tuple[int, int]]] = {
            pool.submit(_write_chunks, str(staging), split, chunks, days): (split, chunks)
            for split, chunks in tasks
        }
        for fut in as_completed(futures):
            split, chunks = futures[fut]
            add(split, chunks, fut.result())
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)  # the running tasks end (one each)
        raise
    pool.shutdown(wait=True)
    return clicks


# ------------------------------------------------------------------------------- main
def generate_days(
    cfg: TrainConfig,
    out: str | Path,
    rows_per_day: int | None = None,
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    multi_hot: list[int] | None = None,
) -> GenerateResult:
    """Write the synthetic splits of ``cfg`` as Criteo day files into ``out`` (module
    docstring), with ``workers`` processes (None: every core this process may use);
    ``multi_hot``: bag sizes, one a table, to write MLPerf's multi-hot npz days instead of
    one-hot ids."""
    global _GEN
    if not isinstance(cfg.data, SyntheticData):
        raise ValueError("generate needs data.source: synthetic")
    if multi_hot is not None and len(multi_hot) != len(cfg.data.cardinalities):
        raise ValueError(
            f"--multi-hot: {len(multi_hot)} bag sizes for {len(cfg.data.cardinalities)} tables"
        )
    if rows_per_day is not None and rows_per_day < 1:
        raise ValueError(f"--rows-per-day must be at least 1, got {rows_per_day}")
    t0 = time.perf_counter()
    out = Path(out)
    data = cfg.data
    gen = SyntheticCriteo(data)
    _ = gen.teacher  # calibrated once, here: the forked workers inherit it
    days = plan_days(data, rows_per_day)
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    workers = max(1, workers)
    f, t = data.num_dense, len(data.cardinalities)
    staging = prepare_staging(out, overwrite)
    try:
        for day in days:
            for kind, (shape, dtype) in _specs(day, f, t).items():
                arr = open_memmap(staging / day_file(day.day, kind), "w+", dtype, shape)
                del arr
        tasks = _tasks(gen, days)
        size = data.chunk_rows

        def rows_of(split: str, chunks: tuple[int, int]) -> int:
            return min(chunks[1] * size, gen.split_rows(split)) - chunks[0] * size

        total = sum(d.rows for d in days)
        _GEN = gen
        if progress:
            from tqdm import tqdm

            with tqdm(total=total, unit="row", unit_scale=True, desc="generate") as bar:
                clicks = _run_tasks(staging, tasks, days, workers, bar.update, rows_of)
        else:  # no tqdm needed (a bare GPU host: bench/gpu_check.py)
            clicks = _run_tasks(staging, tasks, days, workers, lambda n: None, rows_of)
        if multi_hot is not None:
            _write_multi_hot(staging, days, data.cardinalities, multi_hot)
        manifest = _manifest(cfg, gen, days, staging, clicks, workers, multi_hot)
        atomic_write_json(staging / MANIFEST, manifest)
        os.chmod(staging / MANIFEST, 0o644)
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        _GEN = None
    seconds = time.perf_counter() - t0
    logger.info("generated %d rows into %s in %.1f s", manifest["rows"], out, seconds)
    return GenerateResult(out, manifest, seconds, workers)


def _write_multi_hot(
    staging: Path, days: list[DayPlan], cardinalities: list[int], sizes: list[int]
) -> None:
    """Each day's one-hot ids as MLPerf's ``day_{i}_sparse_multi_hot.npz`` (the one-hot file
    is removed): MLPerf's materialize script, applied to our days."""
    from dlrm_vrgd.data.criteo.npz import multi_hot_file, write_multi_hot
    from dlrm_vrgd.data.multihot import MultiHotTables

    tables = MultiHotTables(cardinalities, sizes)
    for day in days:
        onehot = staging / day_file(day.day, "sparse")
        ids = np.load(onehot, mmap_mode="r")
        write_multi_hot(
            staging / multi_hot_file(day.day),
            day.rows,
            sizes,
            lambda k, a, b, ids=ids: tables.bag(k, np.asarray(ids[a:b, k])),
        )
        del ids
        onehot.unlink()


def _manifest(
    cfg: TrainConfig,
    gen: SyntheticCriteo,
    days: list[DayPlan],
    staging: Path,
    clicks: dict[int, int],
    workers: int,
    multi_hot: list[int] | None = None,
) -> dict[str, Any]:
    from dlrm_vrgd.data.criteo.npz import multi_hot_file

    data = cfg.data
    assert isinstance(data, SyntheticData)
    f, t = data.num_dense, len(data.cardinalities)

    def name(day: int, kind: str) -> str:
        multi = kind == "sparse" and multi_hot is not None
        return multi_hot_file(day) if multi else day_file(day, kind)

    with ThreadPoolExecutor(min(8, max(1, workers))) as hasher:
        hashes = {
            (d.day, k): hasher.submit(sha256_file, staging / name(d.day, k), sync=True)
            for d in days
            for k in KINDS
        }
        records = []
        for d in days:
            files = {}
            for kind, (shape, dtype) in _specs(d, f, t).items():
                if kind == "sparse" and multi_hot is not None:
                    path = staging / multi_hot_file(d.day)
                    files["sparse_multi_hot"] = {
                        "file": path.name,
                        "sizes": list(multi_hot),
                        "bytes": path.stat().st_size,
                        "sha256": hashes[(d.day, kind)].result(),
                    }
                    continue
                path = staging / day_file(d.day, kind)
                files[kind] = {
                    "file": path.name,
                    "dtype": dtype,
                    "shape": list(shape),
                    "bytes": path.stat().st_size,
                    "sha256": hashes[(d.day, kind)].result(),
                }
            records.append(
                {
                    "day": d.day,
                    "rows": d.rows,
                    "labeled": True,
                    "positives": clicks.get(d.day, 0),
                    "source": {"split": d.split, "rows": [d.start, d.start + d.rows]},
                    "files": files,
                }
            )
    split_days = {s: [d.day for d in days if d.split == s] for s in SPLITS}
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "rows": sum(d.rows for d in days),
        "num_dense": f,
        "num_sparse": t,
        "dense_transform": {"rule": "log1p(count), a missing count = 0 (synthetic)", "floor": None},
        "sparse": {
            "max_rows_per_table": None,
            "frequency_threshold": 0,
            "cardinalities": [int(c) for c in data.cardinalities],
            "vocab": None,
        },
        "skip_bad_rows": False,
        "bad_rows": 0,
        "bad_row_examples": [],
        "inputs": [],
        "days": records,
        "splits": {f"{s}_days": split_days[s] for s in SPLITS},
        **(
            {"multi_hot": {"sizes": list(multi_hot), "synthesis": "mlperf-uniform, seed 0"}}
            if multi_hot is not None
            else {}
        ),
        "generated": {
            "by": "dlrm-vrgd generate",
            "data": data.model_dump(mode="json"),
            "chunk_rows": data.chunk_rows,
            "oracle": {s: oracle_metrics(staging, split_days[s]) for s in SPLITS},
        },
    }


def oracle_metrics(folder: Path, days: list[int]) -> dict[str, float]:
    """AUC, logloss, NE and calibration of the true probabilities on the first
    :data:`ORACLE_ROWS` rows of ``days`` (and how many rows that was)."""
    import torch

    from dlrm_vrgd.metrics import binary_metrics

    probs, labels, left = [], [], ORACLE_ROWS
    for day in days:
        if left <= 0:
            break
        p = np.load(folder / day_file(day, "probs"), mmap_mode="r")[:left]
        y = np.load(folder / day_file(day, "labels"), mmap_mode="r")[:left, 0]
        probs.append(np.asarray(p, dtype=np.float32))
        labels.append(np.asarray(y, dtype=np.float32))
        left -= len(p)
    p_all, y_all = np.concatenate(probs), np.concatenate(labels)
    figures = binary_metrics(torch.from_numpy(p_all), torch.from_numpy(y_all))
    return {"rows": len(p_all), **{k: float(v) for k, v in figures.items()}}


def summary_lines(result: GenerateResult) -> list[str]:
    """What a generation wrote, and how to train on it (the CLI prints it)."""
    m = result.manifest
    gen = m["generated"]
    rate = result.rows / result.seconds if result.seconds > 0 else float("nan")
    lines = [
        f"generated {result.rows:,} rows in {len(m['days'])} day(s) in {result.seconds:.1f} s "
        f"({rate:,.0f} rows/s, {result.workers} process(es)) -> {result.out}"
    ]
    for split in SPLITS:
        days = m["splits"][f"{split}_days"]
        rows = sum(d["rows"] for d in m["days"] if d["day"] in days)
        o = gen["oracle"][split]
        lines.append(
            f"  {split:5s} day(s) {days[0]}"
            + (f"-{days[-1]}" if len(days) > 1 else "")
            + f": {rows:,} rows, oracle AUC {o['auc']:.4f} logloss {o['logloss']:.4f}"
        )
    lines += [
        "train on it with this data section (the same rows in the same order as the live",
        "synthetic source, for the same run.seed):",
        "  data:",
        "    source: criteo",
        f"    path: {result.out}",
        f"    shuffle_block_rows: {gen['chunk_rows']}",
        "    max_val_rows: null",
    ]
    return lines


# ------------------------------------------------------------------- one split (torchrec)
def export_split(cfg: TrainConfig, split: str, out: Path) -> list[Path]:
    """``{split}_dense.npy`` (N x 13 float32), ``{split}_sparse.npy`` (N x 26 int64),
    ``{split}_labels.npy`` (N x 1 int32) and ``{split}_probs.npy`` (N float32 true click
    probabilities), torchrec's names for one split (not a directory the Criteo source reads:
    :func:`generate_days` writes that). Files appear under their final names only once
    complete."""
    from tqdm import tqdm

    if not isinstance(cfg.data, SyntheticData):
        raise ValueError("generate needs data.source: synthetic")
    src = SyntheticCriteo(cfg.data).source(split)
    out.mkdir(parents=True, exist_ok=True)
    n, t, f = src.num_rows, len(src.cardinalities), src.num_dense
    specs = {
        "dense": ((n, f), np.float32),
        "sparse": ((n, t), np.int64),
        "labels": ((n, 1), np.int32),
        "probs": ((n,), np.float32),
    }
    tmp = {k: out / f".{split}_{k}.npy.tmp" for k in specs}
    arrays = {k: open_memmap(tmp[k], mode="w+", dtype=d, shape=s) for k, (s, d) in specs.items()}
    step = src.block_rows
    with tqdm(total=n, unit="row", unit_scale=True, desc=f"generate {split}") as bar:
        for start in range(0, n, step):
            rows = src.read(start, min(start + step, n))
            stop = start + len(rows)
            arrays["dense"][start:stop] = rows.dense
            arrays["sparse"][start:stop] = rows.sparse
            arrays["labels"][start:stop, 0] = rows.labels
            arrays["probs"][start:stop] = rows.probs
            bar.update(len(rows))
    paths = []
    for k, arr in arrays.items():
        arr.flush()
        del arr
        final = out / f"{split}_{k}.npy"
        tmp[k].replace(final)
        paths.append(final)
    atomic_write_json(
        out / f"{split}_manifest.json",
        {
            "split": split,
            "rows": n,
            "cardinalities": src.cardinalities,
            "config": cfg.data.model_dump(mode="json"),
        },
    )
    return paths
