"""Raw Criteo text -> npy day files: rows/s of `dlrm-vrgd preprocess` on 2 cores, per input kind,
beside pyarrow's CSV reader alone on the same text (the parsing floor), in one run.

The input is N generated Criteo-like rows (counts log-normal with 20% missing and negatives in
I2; ids Zipf-distributed per column as 8 hex digits, 10% missing; ~240 bytes a line, like
Kaggle's train.txt). Each variant converts the whole input into a fresh directory (manifest,
SHA-256 of every file, atomic publish included); the time is the median over --reps runs, and
"CPU s / 1M rows" the process CPU time (all threads), which is less sensitive to other load on
the machine than the wall time. Target: >= 300,000 rows/s on 2 cores.

    python bench/preprocess.py [--rows 1000000] [--reps 3] [--cores 2]
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
from common import print_table

from dlrm_vrgd.data.criteo.format import format_criteo_text
from dlrm_vrgd.data.criteo.preprocess import preprocess

TARGET = 300_000


def generate(n: int, seed: int = 0) -> tuple[np.ndarray, np.ma.MaskedArray, np.ma.MaskedArray]:
    rng = np.random.default_rng(seed)
    labels = (rng.random(n) < 0.25).astype(np.int64)
    ints = np.floor(np.exp(rng.normal(1.5, 2.0, (n, 13)))).astype(np.int64)
    ints[:, 1] -= 3
    ints = np.ma.masked_array(ints, mask=rng.random((n, 13)) < 0.2)
    vocab = np.array([3, 500, 10**4, 10**5, 10**6, 10**7] * 5)[:26]
    ranks = np.minimum(rng.zipf(1.2, (n, 26)) - 1, vocab - 1).astype(np.uint64)
    ids = (ranks * np.uint64(2654435761) + np.arange(26, dtype=np.uint64)) % np.uint64(2**32)
    return labels, ints, np.ma.masked_array(ids, mask=rng.random((n, 26)) < 0.1)


def write_inputs(root: Path, n: int) -> dict[str, Path]:
    labels, ints, cats = generate(n)
    tsv = format_criteo_text(labels, ints, cats)
    paths = {"tsv": root / "day_0", "gz": root / "day_0.gz", "csv": root / "train.csv"}
    paths["tsv"].write_bytes(tsv)
    paths["gz"].write_bytes(gzip.compress(tsv, compresslevel=6))
    csv = format_criteo_text(labels, ints, cats, ",", header=True, ids=np.arange(n) + 10**7)
    paths["csv"].write_bytes(csv)
    # every line with its trailing empty fields stripped, and CRLF line ends
    lines = [ln.rstrip(b"\t") for ln in tsv.split(b"\n")]
    paths["stripped"] = root / "stripped.txt"
    paths["stripped"].write_bytes(b"\r\n".join(lines))
    return paths


def pyarrow_alone(path: Path, cores: int) -> Callable[[], int]:
    names = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    types = {n: pa.int64() for n in names[:14]} | {n: pa.binary() for n in names[14:]}

    def run() -> int:
        pa.set_cpu_count(cores)
        table = pcsv.read_csv(
            path,
            read_options=pcsv.ReadOptions(column_names=names, use_threads=True),
            parse_options=pcsv.ParseOptions(delimiter="\t", quote_char=False),
            convert_options=pcsv.ConvertOptions(column_types=types, strings_can_be_null=True),
        )
        return table.num_rows

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cores", type=int, default=2, help="CPUs to run on (sched_setaffinity)")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > args.cores:
        os.sched_setaffinity(0, cpus[: args.cores])
    cores = len(os.sched_getaffinity(0))
    root = Path(tempfile.mkdtemp(prefix="bench-preprocess-"))
    try:
        t0 = time.perf_counter()
        paths = write_inputs(root, args.rows)
        mb = paths["tsv"].stat().st_size / 1e6
        print(
            f"{args.rows:,} rows, {mb:,.0f} MB of TSV ({mb * 1e6 / args.rows:.0f} B/line), "
            f"gzip {paths['gz'].stat().st_size / 1e6:,.0f} MB; generated in "
            f"{time.perf_counter() - t0:.0f} s; {cores} cores, median of {args.reps}"
        )

        def convert(path: Path, **kw: object) -> Callable[[], int]:
            def run() -> int:
                out = root / "out"
                shutil.rmtree(out, ignore_errors=True)
                return preprocess([path], out, workers=cores, progress=False, **kw).rows

            return run

        variants: dict[str, Callable[[], int]] = {
            "pyarrow read_csv alone (TSV, no conversion, no output)": pyarrow_alone(
                paths["tsv"], cores
            ),
            "TSV, ids as written (torchrec layout)": convert(paths["tsv"]),
            "TSV, --max-rows-per-table 10000000": convert(
                paths["tsv"], max_rows_per_table=10_000_000
            ),
            "TSV.gz": convert(paths["gz"]),
            "Kaggle CSV with Id/header": convert(paths["csv"]),
            "TSV, trailing fields stripped + CRLF": convert(paths["stripped"]),
            "TSV, cap 1000000 + --frequency-threshold 3": convert(
                paths["tsv"], max_rows_per_table=1_000_000, frequency_threshold=3
            ),
        }
        wall: dict[str, list[float]] = {k: [] for k in variants}
        cpu: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.reps):
            for name, fn in variants.items():
                c0, t0 = time.process_time(), time.perf_counter()
                rows = fn()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                assert rows == args.rows, (name, rows)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    floor = statistics.median(wall[next(iter(variants))])
    table = []
    for name in variants:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        rate = args.rows / w
        table.append([name, w, rate, c * 1e6 / args.rows, rate / TARGET, floor / w])
    print_table(["variant", "s", "rows/s", "CPU s / 1M rows", "x target", "x pyarrow alone"], table)


if __name__ == "__main__":
    main()
