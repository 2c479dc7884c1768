"""configs/mlperf_dlrmv2*.yaml against MLPerf DLRM-dcnv2's reference, written here from
mlcommons/training recommendation_v2/torchrec_dlrm (dlrm_main.py, README.MD) and mlcommons/logging
(compliance_checker/training_5.1.0/closed_dlrm_dcnv2.yaml, rcp_checker/.../rcps_dlrm_dcnv2.json),
not read from our configs; the 512k config differs from the reference only where docs/mlperf.md
says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dlrm_vrgd.config import load_config
from dlrm_vrgd.study.config import load_study

ROOT = Path(__file__).resolve().parents[1]

# MLPerf's values, field by field (our config key -> MLPerf's value).
MLPERF: dict[str, Any] = {
    "data.source": "criteo",
    "data.split": "mlperf",  # train days 0-22, day 23 halved into val / test
    "data.max_rows_per_table": [
        40000000,
        39060,
        17295,
        7424,
        20265,
        3,
        7122,
        1543,
        63,
        40000000,
        3067956,
        405282,
        10,
        2209,
        11938,
        155,
        4,
        976,
        14,
        40000000,
        40000000,
        40000000,
        590152,
        12973,
        108,
        36,
    ],  # --num_embeddings_per_feature
    "data.multi_hot_sizes": [
        3,
        2,
        1,
        2,
        6,
        1,
        1,
        1,
        1,
        7,
        3,
        8,
        1,
        6,
        9,
        5,
        1,
        1,
        1,
        12,
        100,
        27,
        10,
        3,
        1,
        1,
    ],  # --multi_hot_sizes
    "data.max_val_rows": None,  # eval_samples 89,137,319: the whole half
    "model.arch": "dlrm_dcn",  # --interaction_type=dcn: torchrec's DLRM_DCN
    "model.embedding_dim": 128,
    "model.dense_arch": [512, 256, 128],
    "model.over_arch": [1024, 1024, 512, 256, 1],
    "model.dcn_num_layers": 3,
    "model.dcn_low_rank_dim": 512,
    "model.embedding_backend": "fbgemm",
    "model.embedding_precision": "fp32",
    "optim.dense.name": "adagrad",  # --adagrad: torch.optim.Adagrad
    "optim.dense.lr": 0.004,  # RCP dlrm_dcnv2_ref_55296
    "optim.dense.eps": 1e-8,  # ADAGRAD_EPS; compliance: opt_adagrad_epsilon == 1e-8
    "optim.dense.initial_accumulator_value": 0.0,  # ADAGRAD_INIT_ACC
    "optim.dense.weight_decay": 0.0,  # WEIGHT_DECAY
    "optim.sparse.lr": 0.004,  # the same optimizer_kwargs for the tables
    "optim.sparse.eps": 1e-8,
    "optim.schedule.warmup_steps": 0,
    "optim.schedule.decay": "none",
    "optim.schedule.lr_scaling": "none",
    "run.global_batch": 55296,
    "run.nproc_per_node": 8,
    "run.epochs": 1,
    "run.evals_per_epoch": 20,  # validation_freq_within_epoch = samples / (batch x 20)
    "run.eval_every": 0,
    "run.target_auc": 0.80275,
    "run.precision": "fp32",  # --allow_tf32 off
}
ASSERT_TOTAL_LOOKUPS = 214
# The tables' optimizer: full element-wise Adagrad (FBGEMM EXACT_ADAGRAD), as MLPerf's.
TABLES = {"optim.sparse.name": "adagrad"}
# The fields docs/mlperf.md names as the 512k config's differences from the reference.
DIFFERS_512K = {"run.global_batch", "run.micro_batch", "optim.dense.name", "optim.sparse.name"}


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _config(name: str) -> dict[str, Any]:
    return _flat(load_config(ROOT / "configs" / f"{name}.yaml").model_dump(mode="json"))


def test_the_reference_values_are_mlperfs() -> None:
    assert sum(MLPERF["data.multi_hot_sizes"]) == ASSERT_TOTAL_LOOKUPS
    assert len(MLPERF["data.max_rows_per_table"]) == 26
    assert sum(MLPERF["data.max_rows_per_table"]) == 204_184_588  # 104.5 GB at 128 x fp32


@pytest.mark.parametrize("key", sorted(MLPERF))
def test_reference_config_is_mlperfs(key: str) -> None:
    assert _config("mlperf_dlrmv2")[key] == MLPERF[key]


def test_reference_config_runs_one_pass_a_step_on_8_ranks() -> None:
    got = _config("mlperf_dlrmv2")
    assert got["run.micro_batch"] * got["run.nproc_per_node"] == MLPERF["run.global_batch"]
    assert {k: got[k] for k in TABLES} == TABLES


def test_512k_config_differs_only_where_the_docs_say() -> None:
    ref, big = _config("mlperf_dlrmv2"), _config("mlperf_dlrmv2_512k")
    assert set(ref) == set(big)
    assert {k for k in ref if ref[k] != big[k]} == DIFFERS_512K
    assert big["run.global_batch"] == 524288
    assert big["optim.dense.name"] == "vradagrad"
    assert big["optim.sparse.name"] == "gsnr_adagrad"
    page = (ROOT / "docs" / "mlperf.md").read_text()
    for key in DIFFERS_512K:
        assert f"`{key}`" in page


def test_study_pairs_them() -> None:
    study = load_study(ROOT / "configs" / "mlperf_dlrmv2_study.yaml")
    ref, big = _config("mlperf_dlrmv2"), _config("mlperf_dlrmv2_512k")
    assert max(study.batch_sizes) == big["run.global_batch"]
    base = _flat(study.base)
    for key, value in base.items():
        if key.startswith(("data.", "model.")):
            assert ref[key] == value == big[key], key
    arms = {o.name: o for o in study.optimizers}
    assert arms["vradagrad"].baseline == "adagrad"
    for arm, cfg in (("adagrad", ref), ("vradagrad", big)):
        cell = next(c for c in study.cells() if c.optimizer == arm and c.lr_multiplier == 1)
        got = _flat(study.cell_config(cell).model_dump(mode="json"))
        for key in (
            "optim.dense.name", "optim.dense.lr", "optim.dense.eps",
            "optim.dense.initial_accumulator_value", "optim.sparse.name", "optim.sparse.lr",
            "optim.sparse.eps", "optim.schedule.warmup_steps", "optim.schedule.decay",
        ):  # fmt: skip
            assert got[key] == cfg[key], (arm, key)
    cell = next(c for c in study.cells() if c.global_batch == 524288 and c.optimizer == "vradagrad")
    got = _flat(study.cell_config(cell).model_dump(mode="json"))
    assert got["run.micro_batch"] == big["run.micro_batch"]  # 64 groups, as the 512k config
    # one epoch of days 0-22 (4,195,197,692 rows) at 524,288, 20 evaluations
    assert got["run.steps"] == 4_195_197_692 // 524288 and got["run.eval_every"] == 400
    assert study.target_auc == MLPERF["run.target_auc"]
