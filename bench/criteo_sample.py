"""Raw Criteo text with a planted signal, for trying the Criteo guide without Criteo's data.

Writes ``--rows`` lines in the format of Kaggle's ``train.txt`` (label, 13 counts, 26 hex ids,
tab-separated, empty fields where a value is missing) from the synthetic generator's hidden
teacher (:mod:`dlrm_vrgd.data.synthetic`): counts log-normal with 20% missing, ids Zipf-like
over Kaggle's table sizes (capped at 100k) and scrambled into 8 hex digits, labels drawn from
the teacher's click probability (click rate 0.25, an oracle AUC near 0.8, as real Criteo's best
models reach). It is not Criteo: it shows the path works and how a run behaves on a sample of
this size; its numbers are not Criteo's.

    python bench/criteo_sample.py --rows 10000 --out data/criteo_10k.txt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dlrm_vrgd.config import SyntheticData
from dlrm_vrgd.data.criteo.format import format_criteo_text
from dlrm_vrgd.data.synthetic import SyntheticCriteo

#: id -> 8 hex digits: a bijection of [0, 2^32) (an odd multiplier), so ids look like Criteo's.
SCRAMBLE = np.uint64(2654435761)


def sample(rows: int, seed: int) -> bytes:
    cfg = SyntheticData(seed=seed, train_rows=rows, val_rows=1, test_rows=1, chunk_rows=rows)
    gen = SyntheticCriteo(cfg)
    got = gen.generate("train", 0)
    counts = np.rint(np.expm1(got.dense.astype(np.float64))).astype(np.int64)
    ints = np.ma.masked_array(counts, mask=counts == 0)  # the generator's missing counts are 0
    table = np.arange(gen.num_tables, dtype=np.uint64)
    ids = (got.sparse.astype(np.uint64) * SCRAMBLE + table) % np.uint64(2**32)
    cats = np.ma.masked_array(ids, mask=np.zeros(ids.shape, dtype=bool))
    return format_criteo_text(got.labels.astype(np.int64), ints, cats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000, help="lines to write (default 10000)")
    ap.add_argument("--seed", type=int, default=0, help="the teacher's and the rows' seed")
    ap.add_argument("--out", type=Path, required=True, help="the TSV file to write")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_bytes(sample(args.rows, args.seed))
    tmp.replace(args.out)
    print(f"wrote {args.rows:,} rows to {args.out}")


if __name__ == "__main__":
    main()
