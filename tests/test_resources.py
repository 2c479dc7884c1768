"""The memory estimate before launch: its parts against hand-computed sizes, and refusals that
name the fields driving them (train configs and study configs alike)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import yaml

from dlrm_vrgd.config import MAX_TABLE_ROWS, DenseOptimizerName
from dlrm_vrgd.resources import (
    GIB,
    RUNTIME_BYTES,
    ResourceError,
    check_fits,
    check_study_fits,
    estimate,
)
from dlrm_vrgd.study.config import StudyConfig

from .conftest import tiny_config
from .study.test_study import TINY


def parts(cfg) -> dict[str, int]:
    return {p.name: p.bytes for p in estimate(cfg).parts}


def test_the_parts_of_the_tiny_job_by_hand() -> None:
    got = parts(tiny_config())
    # tables 40+25+60+8+100+3 = 236 rows x (8 weights + 1 row-wise adagrad state) x 4 bytes
    assert got["embedding tables"] == 236 * 9 * 4
    # a step touches at most 256 rows x 6 tables, here capped by the 236 rows there are;
    # each: 8 + 1 floats and two int64 indices
    assert got["step row accumulator"] == 236 * (9 * 4 + 16)
    # bottom MLP 13->16->8, dot interaction of 7 features: 8 + 7*6/2 = 29, top MLP 29->16->1;
    # AdamW: weights, gradients, two moments
    params = (13 * 16 + 16) + (16 * 8 + 8) + (29 * 16 + 16) + (16 * 1 + 1)
    assert got["dense layers and optimizer state"] == params * 4 * 4
    assert got["runtime"] == RUNTIME_BYTES
    # per row of a micro-batch: 13 dense + 6x8 looked up + 16+8 bottom + 7x7 interaction
    # + 29 + 16+1 top, three times over (saved for backward, gradients, temporaries)
    per_row = 13 + 48 + 24 + 49 + 29 + 17
    assert got["training activations"] == 64 * per_row * 4 * 3


def test_tables_grow_with_the_ema_estimator_and_shrink_over_nodes() -> None:
    base = parts(tiny_config())["embedding tables"]
    ema = parts(tiny_config("optim.sparse.name=gsnr_rowwise_adagrad", "optim.sparse.estimator=ema"))
    assert ema["embedding tables"] == base // 9 * 11  # two more floats per row
    two = tiny_config(
        "data.cardinalities=[1000,1000,1000,1000]",
        "run.nnodes=2",
        "run.rdzv_endpoint=h:1",
    )
    # a node holds half of the 4,000 rows
    assert parts(two)["embedding tables"] == 2000 * 9 * 4


def test_a_job_bigger_than_the_memory_is_refused_naming_its_drivers() -> None:
    cfg = tiny_config(f"data.cardinalities=[{MAX_TABLE_ROWS}]", "model.embedding_dim=8")
    with pytest.raises(ResourceError) as err:
        check_fits(cfg, memory_bytes=16 * GIB)
    assert err.value.fields == ["data.cardinalities", "model.embedding_dim"]
    assert "more than the 16.0 GiB of this host" in str(err.value)
    check_fits(cfg, memory_bytes=200 * GIB)  # (2^31 - 1) x 9 x 4 bytes = 72 GiB fits in 200
    big_batch = tiny_config("run.micro_batch=4194304", "run.global_batch=4194304")
    with pytest.raises(ResourceError) as err:
        check_fits(big_batch, memory_bytes=4 * GIB)  # 4M rows x 182 floats x 3 = 8.5 GiB
    assert "run.micro_batch" in err.value.fields


def test_a_study_is_checked_cell_by_cell_naming_study_fields() -> None:
    study = copy.deepcopy(TINY)
    study["base"]["data"]["cardinalities"] = [MAX_TABLE_ROWS] * 4
    with pytest.raises(ResourceError) as err:
        check_study_fits(StudyConfig.model_validate(study), memory_bytes=64 * GIB)
    assert err.value.fields[:2] == ["base.data.cardinalities", "base.model.embedding_dim"]
    assert str(err.value).startswith(
        "base.data.cardinalities, base.model.embedding_dim: study cell G=256 sgd: the job needs"
    )
    check_study_fits(StudyConfig.model_validate(TINY))


def test_the_study_cli_refuses_before_running_a_cell(tmp_path: Path) -> None:
    study = copy.deepcopy(TINY)
    study["base"]["data"]["cardinalities"] = [MAX_TABLE_ROWS] * 26
    study["base"]["model"] = {"embedding_dim": 64, "dense_arch": [16, 64], "over_arch": [16, 1]}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "study", "--config", str(path), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert (
        "error: base.data.cardinalities, base.model.embedding_dim: study cell G=256 sgd: "
        "the job needs about 13,521.2 GiB" in proc.stderr
    )
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.parametrize("name", get_args(DenseOptimizerName))
def test_every_dense_optimizer_has_an_estimate(name: str) -> None:
    # the admission check and `dlrm-vrgd train` estimate every job: a name the estimate does not
    # know would stop them with a KeyError (vradagrad did)
    assert estimate(tiny_config(f"optim.dense.name={name}")).total > 0
