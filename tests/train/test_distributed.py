"""Several processes through the real CLI and torchrun (gloo): equivalence with one process,
sharded checkpoints, and failure of a rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from dlrm_vrgd.rundir import read_jsonl

from ..conftest import tiny_config_dict
from ..dist_utils import final_state, rank_pids

OPTIM = {
    "dense": {"name": "vradam", "lr": 0.01, "gamma": 0.3},
    "sparse": {"name": "gsnr_rowwise_adagrad", "lr": 0.1, "gamma": 0.3},
}


def write_config(path: Path, nproc: int, **run: object) -> Path:
    raw = tiny_config_dict(
        run={"nproc_per_node": nproc, "micro_batch": 32, "steps": 6, "checkpoint_every": 3, **run},
        optim=OPTIM,
    )
    path.write_text(yaml.safe_dump(raw))
    return path


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train(tmp: Path, name: str, nproc: int, *sets: str, **run: object) -> Path:
    out = tmp / name
    cfg = write_config(tmp / f"{name}.yaml", nproc, **run)
    args = ["train", "--config", str(cfg), "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("dist")
    return {"one": train(tmp, "one", 1), "two": train(tmp, "two", 2), "tmp": tmp}


def assert_same_model(a: Path, b: Path, step: int) -> None:
    dense_a, tables_a = final_state(a, step)
    dense_b, tables_b = final_state(b, step)
    assert dense_a.keys() == dense_b.keys() and tables_a.keys() == tables_b.keys()
    for name in dense_a:
        torch.testing.assert_close(dense_a[name], dense_b[name], rtol=1e-5, atol=1e-6)
    for name in tables_a:
        torch.testing.assert_close(tables_a[name], tables_b[name], rtol=1e-5, atol=1e-6)


def test_two_ranks_equal_one_rank_with_twice_the_micro_batches(runs: dict[str, Path]) -> None:
    """G = 256: one process runs 8 micro-batches of 32, two run 4 each over the same rows;
    VR-Adam dense and GSNR row-wise Adagrad sparse, tables sharded table-wise."""
    one, two = losses(runs["one"]), losses(runs["two"])
    assert list(one) == list(two) == [1, 2, 3, 4, 5, 6]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5)
    assert_same_model(runs["one"], runs["two"], 6)
    # every table lives on exactly one rank, and both ranks own some
    owners = [
        [n for t in torch.load(p, weights_only=True)["tables"] for n in t["names"]]
        for p in sorted((runs["two"] / "checkpoints" / "step_00000006").glob("rank*.pt"))
    ]
    assert len(owners) == 2 and all(owners) and not set(owners[0]) & set(owners[1])
    gsnr = read_jsonl(runs["two"] / "gsnr.jsonl")[-1]
    assert sorted(t["table"] for t in gsnr["tables"]) == sorted(owners[0] + owners[1])
    assert all(0.3 <= t["ratio"] <= 1 for t in gsnr["tables"])
    test_one = [r for r in read_jsonl(runs["one"] / "metrics.jsonl") if r.get("split") == "test"]
    test_two = [r for r in read_jsonl(runs["two"] / "metrics.jsonl") if r.get("split") == "test"]
    assert test_two[0]["auc"] == pytest.approx(test_one[0]["auc"], abs=1e-5)
    assert test_two[0]["rows"] == test_one[0]["rows"] == 1024


def test_only_rank_zero_writes_tensorboard_with_every_rank_s_tables(runs: dict[str, Path]) -> None:
    from tests.tracking.events import f32, scalars

    files = list((runs["two"] / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1  # rank 1 wrote none
    tb = scalars(runs["two"] / "tb")
    assert tb["train/loss"] == [(s, f32(v)) for s, v in losses(runs["two"]).items()]
    last = read_jsonl(runs["two"] / "gsnr.jsonl")[-1]
    for t in last["tables"]:  # tables owned by rank 1 too, gathered on rank 0
        assert tb[f"gsnr/table/{t['table']}/ratio"][-1] == (last["step"], f32(t["ratio"]))


def test_column_wise_sharding_matches_one_rank(runs: dict[str, Path]) -> None:
    tmp = runs["tmp"]
    sets = ("optim.sparse.name=sgd", "optim.dense.name=adamw", "run.steps=3")
    one = train(tmp, "cw_one", 1, *sets)
    two = train(tmp, "cw_two", 2, *sets, "run.sharding=[column_wise]")
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    assert_same_model(one, two, 3)


def test_sharded_checkpoint_resumes_on_two_ranks_exactly(runs: dict[str, Path]) -> None:
    tmp = runs["tmp"]
    part = train(tmp, "part", 2, "run.steps=3")
    cfg = write_config(tmp / "part.yaml", 2)
    proc = cli("train", "--config", str(cfg), "--out", str(part), "--resume")  # steps back to 6
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole = losses(runs["two"])
    resumed = losses(part)
    assert resumed == whole  # bit for bit, steps 1-3 from the first run, 4-6 after the resume
    assert_same_model(runs["two"], part, 6)


def test_a_dying_rank_fails_the_job_fast(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "long.yaml", 2, steps=100_000, checkpoint_every=0)
    out = tmp_path / "long"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlrm_vrgd.cli", "train", "--config", str(cfg), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not losses(out) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        assert losses(out), "training never started"
        workers = rank_pids(proc.pid)  # the launcher's child is torchrun, whose are the ranks
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        t0 = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert elapsed < 45, f"the job took {elapsed:.0f}s to notice"
    assert "FAILED" in stderr and "Signal 9" in stderr
    for pid in workers:
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        )


def test_torchrun_command_for_one_and_several_nodes() -> None:
    from dlrm_vrgd.config import parse_config
    from dlrm_vrgd.train.distributed import torchrun_command

    one = parse_config(tiny_config_dict(run={"nproc_per_node": 2}))
    cmd = torchrun_command(one, ["train", "--config", "c.yaml", "--out", "o"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--standalone" in cmd and "--nproc_per_node=2" in cmd and "--max_restarts=0" in cmd
    assert cmd[-7:] == ["-m", "dlrm_vrgd.cli", "train", "--config", "c.yaml", "--out", "o"]
    two = parse_config(tiny_config_dict(run={"nproc_per_node": 2, "nnodes": 2}))
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        torchrun_command(two, ["train"])
    two = parse_config(
        tiny_config_dict(run={"nproc_per_node": 2, "nnodes": 2, "rdzv_endpoint": "head:29400"})
    )
    cmd = torchrun_command(two, ["train"])
    assert "--rdzv_backend=c10d" in cmd and "--rdzv_endpoint=head:29400" in cmd
    assert "--nnodes=2" in cmd and "--standalone" not in cmd


def test_cowclip_on_two_ranks_equals_one_rank(runs: dict[str, Path]) -> None:
    """CowClip's counts cover every rank's lookups: a table's owner sees all ranks' bags, so
    two ranks (table-wise) train exactly what one does, with the clip active on some rows."""
    tmp = runs["tmp"]
    sets = (
        "optim.sparse.name=cowclip_rowwise_adagrad",
        "optim.sparse.clip_ratio=0.03",
        "optim.sparse.weight_decay=0.01",
        "run.steps=3",
    )
    one = train(tmp, "cowclip_one", 1, *sets)
    two = train(tmp, "cowclip_two", 2, *sets)
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    assert_same_model(one, two, 3)
    for run in (one, two):
        tables = read_jsonl(run / "gsnr.jsonl")[-1]["tables"]
        clipped = [t["cowclip_clipped"] for t in tables]
        assert len(tables) == 6 and max(clipped) > 0 and min(clipped) < 1


def test_noise_scale_on_two_ranks_equals_one_rank(runs: dict[str, Path]) -> None:
    """The same k = 8 groups of 32 rows (one rank's 8 micro-batches, or two ranks' 4): the
    dense tensors' sums ride in the all-reduce, each table's are its owner's, gathered on rank
    0; the noise-scale records agree (model, dense, tables, per tensor, per table)."""
    one = read_jsonl(runs["one"] / "gsnr.jsonl")
    two = read_jsonl(runs["two"] / "gsnr.jsonl")
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two, strict=True):
        na, nb = a["noise_scale"], b["noise_scale"]
        assert na["k"] == nb["k"] == 8 and na["rows_per_group"] == nb["rows_per_group"] == 32
        fields = ("g2", "s", "g2_raw", "s_raw")
        for scope in ("model", "dense", "tables"):
            for f in fields:
                assert nb[scope][f] == pytest.approx(na[scope][f], rel=1e-4, abs=1e-9)
        tables_a = {t["table"]: t for t in na["per_table"]}
        tables_b = {t["table"]: t for t in nb["per_table"]}
        assert tables_a.keys() == tables_b.keys() and len(tables_a) == 6
        for name, t in tables_a.items():
            for f in fields:
                assert tables_b[name][f] == pytest.approx(t[f], rel=1e-4, abs=1e-9)
        for ta, tb in zip(na["per_tensor"], nb["per_tensor"], strict=True):
            assert ta["name"] == tb["name"]
            assert tb["s"] == pytest.approx(ta["s"], rel=1e-4)
