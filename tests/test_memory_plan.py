"""The per-rank memory plan before launch (dlrm_vrgd.resources.memory_plan): tables placed on
ranks by hand for table-wise, column-wise and row-wise sharding; MLPerf DLRMv2's 26 capped
tables (104.5 GB, as much again of full Adagrad state) on 8 GPUs of 80 GiB; a plan whose
largest rank cannot fit refused by ``dlrm-vrgd train`` (exit 2) before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dlrm_vrgd.config import parse_config
from dlrm_vrgd.resources import GIB, ResourceError, check_fits, estimate, memory_plan

from .conftest import tiny_config

TABLES = "data.cardinalities=[1000,300,200,100]"


def rest_per_rank(cfg) -> int:
    """What every rank holds besides its tables (the estimate's other parts, per process)."""
    parts = [p for p in estimate(cfg).parts if p.name != "embedding tables"]
    if cfg.run.device == "cuda":
        parts = [p for p in parts if p.name != "data in memory"]
    return sum(p.bytes for p in parts) // cfg.run.nproc_per_node


def test_table_wise_by_hand() -> None:
    cfg = tiny_config(TABLES, "run.nproc_per_node=2", "run.sharding=[table_wise]")
    plan = memory_plan(cfg, memory_bytes=64 * GIB)
    # largest first onto the least-loaded rank: 1000 -> 0; 300, 200, 100 -> 1 (600 < 1000 rows)
    r0, r1 = plan.ranks
    assert (r0.tables, r0.state) == (1000 * 8 * 4, 1000 * 4)  # D = 8 floats, 1 row-wise sum
    assert (r1.tables, r1.state) == (600 * 8 * 4, 600 * 4)
    assert r0.shards == ("table 0 (1,000 rows)",)
    assert len(r1.shards) == 3
    assert r0.rest == r1.rest == rest_per_rank(cfg)
    assert plan.largest() is r0
    assert plan.limit == 32 * GIB  # the host's 64 GiB over 2 ranks
    assert plan.lines()[1].startswith("  rank 0: ")


def test_column_wise_cuts_torchrecs_blocks() -> None:
    from torchrec.distributed.sharding_plan import _get_block_size_for_cw_shard

    # D = 8 is one block (torchrec's blocks are >= 128 wide): the same as table-wise
    narrow = tiny_config(TABLES, "run.nproc_per_node=2", "run.sharding=[column_wise]")
    plan = memory_plan(narrow, memory_bytes=64 * GIB)
    assert [r.tables for r in plan.ranks] == [1000 * 32, 600 * 32]
    assert _get_block_size_for_cw_shard(8, None) == 8
    # D = 256: two blocks of 128 columns per table, each with its own row-wise sums
    assert _get_block_size_for_cw_shard(256, None) == 128
    wide = ("model.embedding_dim=256", "model.dense_arch=[16,256]")
    cw = tiny_config(TABLES, *wide, "run.nproc_per_node=2", "run.sharding=[column_wise]")
    plan = memory_plan(cw, memory_bytes=64 * GIB)
    # blocks 1000, 1000, 300, 300, ... alternate between the ranks: 1,600 rows x 128 each
    for r in plan.ranks:
        assert (r.tables, r.state) == (1600 * 128 * 4, 1600 * 4)
        assert len(r.shards) == 4
    tw = tiny_config(TABLES, *wide, "run.nproc_per_node=2", "run.sharding=[table_wise]")
    assert [r.tables for r in memory_plan(tw, memory_bytes=64 * GIB).ranks] == [
        1000 * 256 * 4,
        600 * 256 * 4,
    ]


def test_row_wise_gives_every_rank_its_rows_of_every_table() -> None:
    cfg = tiny_config(
        "data.cardinalities=[1001,300,200,100]",
        "run.nproc_per_node=2",
        "run.sharding=[row_wise]",
        "run.device=cuda",
    )
    plan = memory_plan(cfg, device_memory_bytes=16 * GIB)
    # ceil(rows / 2) on rank 0: 501 + 150 + 100 + 50; the rest on rank 1
    assert [r.tables for r in plan.ranks] == [801 * 32, 800 * 32]
    assert plan.limit == 16 * GIB
    assert plan.ranks[0].rest == rest_per_rank(cfg)  # the cached data stays on the host


def test_one_rank_holds_every_table() -> None:
    cfg = tiny_config(TABLES)
    (r0,) = memory_plan(cfg, memory_bytes=8 * GIB).ranks
    assert r0.tables == 1600 * 32


# ------------------------------------------------------------------------- MLPerf DLRMv2
# fmt: off
CAPS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
        2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
# fmt: on
BIG = 40_000_000 * 128 * 4  # one 40M-row table of 128 floats: 20.48 GB


def dlrmv2(tmp_path: Path, **run: Any) -> Any:
    raw = {
        "data": {"source": "criteo", "path": str(tmp_path / "none"), "max_rows_per_table": CAPS},
        "model": {
            "arch": "dlrm_dcn", "embedding_dim": 128, "dense_arch": [512, 256, 128],
            "over_arch": [1024, 1024, 512, 256, 1], "dcn_num_layers": 3, "dcn_low_rank_dim": 512,
        },
        "optim": {"sparse": {"name": "rowwise_adagrad"}},
        "run": {"device": "cuda", "nproc_per_node": 8, "global_batch": 65536,
                "micro_batch": 8192, "steps": 1, **run},
    }  # fmt: skip
    return parse_config(raw)


def with_sparse(tmp_path: Path, name: str, **run: Any) -> Any:
    cfg = dlrmv2(tmp_path, **run)
    sparse = cfg.optim.sparse.model_copy(update={"name": name})
    return cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"sparse": sparse})})


def test_dlrmv2_tables_are_104_5_gb() -> None:
    assert sum(CAPS) == 204_184_588
    assert sum(CAPS) * 128 * 4 == 104_542_509_056


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
def test_dlrmv2_on_8_gpus_whole_tables(tmp_path: Path, sharding: str) -> None:
    cfg = dlrmv2(tmp_path, sharding=[sharding])
    plan = check_fits(cfg)  # 80 GiB a GPU: fits
    assert plan is not None and plan.limit == 80 * GIB and len(plan.ranks) == 8
    assert sum(r.tables for r in plan.ranks) == 104_542_509_056
    # D = 128 is one column block: column-wise places whole tables, as table-wise does; the
    # five 40M-row tables (0, 9, 19, 20, 21) have a rank each and are the largest load
    for rank, table in enumerate([0, 9, 19, 20, 21]):
        r = plan.ranks[rank]
        assert r.tables == BIG and r.state == 40_000_000 * 4
        assert r.shards[0].startswith(f"table {table} (40,000,000 rows)")
    assert plan.largest().rank == 0 and plan.largest().tables == BIG
    assert all(r.tables < BIG for r in plan.ranks[5:])


def test_dlrmv2_row_wise_on_8_gpus(tmp_path: Path) -> None:
    plan = check_fits(dlrmv2(tmp_path, sharding=["row_wise"]))
    per_rank = sum(-(-n // 8) for n in CAPS)  # ceil(rows / 8) of every table on rank 0
    assert plan.ranks[0].tables == per_rank * 512
    assert sum(r.tables for r in plan.ranks) == 104_542_509_056


def test_dlrmv2_with_full_adagrad(tmp_path: Path) -> None:
    # full (element-wise) Adagrad: one float per weight, the tables' size again
    plan = check_fits(with_sparse(tmp_path, "adagrad", sharding=["table_wise"]))
    assert sum(r.state for r in plan.ranks) == 104_542_509_056
    assert plan.largest().tables + plan.largest().state == 2 * BIG  # 38.1 GiB: fits in 80
    # on 2 GPUs rank 0 gets three 40M-row tables: 3 x 40.96 GB > 80 GiB
    two = with_sparse(tmp_path, "adagrad", sharding=["table_wise"], nproc_per_node=2)
    with pytest.raises(ResourceError) as err:
        check_fits(two)
    msg = str(err.value)
    assert "rank 0 of 2 needs about" in msg and "table 0 (40,000,000 rows)" in msg
    assert f"tables {3 * BIG / GIB:,.1f} GiB, state {3 * BIG / GIB:,.1f} GiB" in msg
    assert "more than the 80.0 GiB a rank may use" in msg
    assert err.value.fields[:5] == [
        "run.sharding", "run.nproc_per_node", "run.nnodes", "data.max_rows_per_table",
        "model.embedding_dim",
    ]  # fmt: skip
    # row-wise on 4 GPUs: a quarter of both each (52.3 GB)
    check_fits(with_sparse(tmp_path, "adagrad", sharding=["row_wise"], nproc_per_node=4))


def test_several_types_allowed_show_the_smallest_largest_rank(tmp_path: Path) -> None:
    cfg = dlrmv2(tmp_path, sharding=["table_wise", "row_wise"])
    assert memory_plan(cfg).sharding == "row_wise"


# ------------------------------------------------------------------------- the CLI refuses
def test_train_refuses_a_rank_that_cannot_fit(tmp_path: Path) -> None:
    raw = yaml.safe_dump(
        {
            "data": {"source": "criteo", "path": str(tmp_path / "none"),
                     "max_rows_per_table": 2_000_000_000},
            "model": {"embedding_dim": 64, "dense_arch": [16, 64], "over_arch": [16, 1]},
            "run": {"device": "cuda", "nproc_per_node": 4, "global_batch": 256,
                    "micro_batch": 64, "steps": 1},
        }
    )  # fmt: skip
    path = tmp_path / "big.yaml"
    path.write_text(raw)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "train", "--config", str(path), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    # 26 tables of 2e9 rows x (64 + 1) floats on 4 GPUs: 7 tables = 3,389.8 GiB on rank 0
    assert "error: run.sharding, run.nproc_per_node, run.nnodes, data.max_rows_per_table, " in (
        proc.stderr
    )
    assert "rank 0 of 4 needs about" in proc.stderr
    assert f"tables {7 * 2e9 * 64 * 4 / GIB:,.1f} GiB" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


# ------------------------------------------------------------------- the service's admission
def test_the_service_refuses_a_rank_that_cannot_fit_with_422(tmp_path: Path) -> None:
    import secrets

    import httpx

    from service.launcher import LocalService

    from .hostile import with_value
    from .service.conftest import FAST_ENV

    svc = LocalService.start(
        tmp_path / "data",
        secrets.token_urlsafe(24),
        env={**FAST_ENV, "DLRM_VRGD_MAX_CONCURRENT_JOBS": "0"},
    )
    try:
        headers = {"Authorization": f"Bearer {svc.token}"}
        with httpx.Client(base_url=f"{svc.base_url}/api/v1", headers=headers, timeout=30) as http:
            # 4 tables of 1.5e9 rows x (8 + 1) floats = 50.3 GiB each; 2 on rank 0 of 2 GPUs
            cfg = with_value("data.cardinalities", [1_500_000_000] * 4)
            cfg["run"].update(device="cuda", nproc_per_node=2)
            response = http.post("/jobs", json={"name": "x", "config": cfg})
            assert response.status_code == 422, response.text
            issues = response.json()["detail"]
            assert [i["field"] for i in issues][:4] == [
                "config.run.sharding", "config.run.nproc_per_node", "config.run.nnodes",
                "config.data.cardinalities",
            ]  # fmt: skip
            assert issues[0]["loc"] == ["body", "config", "run", "sharding"]
            assert "rank 0 of 2 needs about" in issues[0]["msg"]
            assert "more than the 80.0 GiB a rank may use" in issues[0]["msg"]
            assert http.get("/jobs").json()["count"] == 0
            # on 4 GPUs a table each fits: queued
            cfg["run"]["nproc_per_node"] = 4
            response = http.post("/jobs", json={"name": "x", "config": cfg})
            assert response.status_code in (201, 422), response.text
            if response.status_code == 422:  # this host has no 4 GPUs for jobs
                assert "GPU" in response.text and "rank 0" not in response.text
    finally:
        svc.stop()
