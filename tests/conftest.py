"""Shared fixtures: tiny configs that train in seconds on 2 CPU cores."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (dlrm_vrgd/__init__.py)

import torch  # noqa: E402

from dlrm_vrgd.config import TrainConfig, apply_overrides, parse_config  # noqa: E402

# Tests use a fixed, small thread count so results do not depend on the machine.
torch.set_num_threads(int(os.environ.get("DLRM_VRGD_TEST_THREADS", "2")))
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

TINY_CARDINALITIES = [40, 25, 60, 8, 100, 3]


def tiny_config_dict(**sections: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "data": {
            "source": "synthetic",
            "seed": 1,
            "train_rows": 4096,
            "val_rows": 1024,
            "test_rows": 1024,
            "cardinalities": TINY_CARDINALITIES,
            "chunk_rows": 512,
        },
        "model": {"embedding_dim": 8, "dense_arch": [16, 8], "over_arch": [16, 1]},
        "optim": {
            "dense": {"name": "adamw", "lr": 0.01},
            "sparse": {"name": "rowwise_adagrad", "lr": 0.1},
        },
        "run": {
            "global_batch": 256,
            "micro_batch": 64,
            "steps": 4,
            "eval_every": 0,
            "eval_batch": 512,
        },
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return raw


def tiny_config(*overrides: str, **sections: Any) -> TrainConfig:
    return parse_config(apply_overrides(tiny_config_dict(**sections), list(overrides)))


@pytest.fixture
def tiny() -> TrainConfig:
    return tiny_config()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (root only; skipped elsewhere)."""
    fs = tmp_path / "fs"
    fs.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(fs)],
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
    try:
        yield fs
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


def fill_disk(fs: Path, leave: int) -> None:
    """Fill the filesystem of ``fs`` (with ``fs/filler``) so that about ``leave`` bytes stay
    free."""
    slack = fs / "slack"
    slack.write_bytes(b"\0" * leave)
    with (fs / "filler").open("wb", buffering=0) as f:
        try:
            while f.write(b"\0" * 4096):
                pass
        except OSError as err:
            assert err.errno == errno.ENOSPC
    slack.unlink()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n`` (xdist, as ``make test`` runs, ``--dist loadgroup``): every test of
    the real two-node Slurm runs on one worker, so the run starts one cluster, not one per
    worker; every other test runs on the worker of its module's other tests, so a module-scoped
    fixture (a trained model, a dashboard, a service) is built once, not once per worker."""
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
