"""Write a synthetic split to npy files in torchrec's Criteo layout, streaming in blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numpy.lib.format import open_memmap
from tqdm import tqdm

from dlrm_vrgd.config import SyntheticData, TrainConfig
from dlrm_vrgd.data.synthetic import SyntheticCriteo
from dlrm_vrgd.rundir import atomic_write_json


def export_split(cfg: TrainConfig, split: str, out: Path) -> list[Path]:
    """``{split}_dense.npy`` (N x 13 float32), ``{split}_sparse.npy`` (N x 26 int64),
    ``{split}_labels.npy`` (N x 1 int32) and ``{split}_probs.npy`` (N float32 true click
    probabilities). Files appear under their final names only once complete."""
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
