"""configs/mlperf_dlrmv2.yaml and configs/mlperf_dlrmv2_512k.yaml run here, end to end, on the
CPU (issue 46, item 6): on MLPerf-format multi-hot days (``day_N_sparse_multi_hot.npz``, bag
sizes 3,2,1,...,100,27,... written by ``dlrm-vrgd generate --multi-hot mlperf``) each config
trains its epoch, stops at a reachable target, resumes bit for bit from a checkpoint on 1 and 2
ranks, and is exported and scored.

What the runs keep from the configs, because it is the point (these features together): the
model (``dlrm_dcn``, 3 cross layers, FBGEMM tables, fp32), the optimizers (Adagrad / Adagrad;
VR-Adagrad / GSNR Adagrad, their lr and eps, no schedule), the multi-hot sizes, MLPerf's split
(train on every day but the last, halve the last), one epoch evaluated 20 times, the target
field and ``keep_best_checkpoint: false``. :func:`test_the_runs_keep_the_configs_protocol`
asserts that. What they override (:data:`SHRINK`, and why):

* ``data.path``: the generated days (2,560 training rows; the last day's 512 rows halved);
* ``data.max_rows_per_table``: MLPerf's caps, each cut to at most 1,000 rows (204M rows and
  105 GB of tables do not fit CI; the small tables, 3 to 976 rows, stay as they are);
* ``model.embedding_dim`` 16, ``model.dense_arch`` [32, 16] (it ends at the embedding dim),
  ``model.over_arch`` [32, 32, 16, 8, 1] (the same five layers), ``model.dcn_low_rank_dim`` 8:
  CPU time on 2 cores;
* ``run.device`` cpu, ``run.nproc_per_node`` 1 or 2: no GPU, 2 cores;
* ``run.global_batch`` 512 (5 steps an epoch, an eval after each: ⌊2,560 / (512 × 20)⌋ rounds
  up to 1), ``run.micro_batch`` 512 / W for the reference (one pass a step, as its 6,912 on 8
  ranks) and 64 for the 512k config (8 gradient groups a step, over 1 or 2 ranks);
* ``run.eval_batch`` 256: memory; ``run.checkpoint_every`` 3: a checkpoint to resume from;
* ``run.target_auc``: only in the target test, to a value this run reaches (0.80275 is not
  reached in 5 steps of 512 rows).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dlrm_vrgd.config import load_config
from dlrm_vrgd.data.criteo.format import format_criteo_text
from dlrm_vrgd.data.criteo.preprocess import preprocess
from dlrm_vrgd.rundir import read_jsonl

from .data.criteo.test_criteo import make_rows
from .dist_utils import final_state

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "reference": ROOT / "configs" / "mlperf_dlrmv2.yaml",
    "512k": ROOT / "configs" / "mlperf_dlrmv2_512k.yaml",
}
MAX_ROWS = 1000
STEPS = 5  # 2,560 training rows at 512 a step
CKPT = 3


def caps() -> list[int]:
    full = load_config(CONFIGS["reference"]).data.max_rows_per_table
    assert isinstance(full, list) and len(full) == 26
    return [min(c, MAX_ROWS) for c in full]


def shrink(name: str, days: dict[str, Path], nproc: int) -> list[str]:
    """The ``--set`` overrides of a run here (the module docstring says why each)."""
    micro = 512 // nproc if name == "reference" else 64
    return [
        f"data.path={days[name]}",
        f"data.max_rows_per_table={json.dumps(caps())}",
        "model.embedding_dim=16",
        "model.dense_arch=[32,16]",
        "model.over_arch=[32,32,16,8,1]",
        "model.dcn_low_rank_dim=8",
        "run.device=cpu",
        f"run.nproc_per_node={nproc}",
        "run.global_batch=512",
        f"run.micro_batch={micro}",
        "run.eval_batch=256",
        f"run.checkpoint_every={CKPT}",
    ]


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def train(
    name: str, days: dict[str, Path], out: Path, nproc: int, *extra: str, resume: bool = False
) -> Path:
    sets = [a for s in (*shrink(name, days, nproc), *extra) for a in ("--set", s)]
    cli("train", "--config", str(CONFIGS[name]), "--out", str(out), *sets,
        *(["--resume"] if resume else []))  # fmt: skip
    return out


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"}


def val_evals(run: Path) -> list[tuple[int, float]]:
    return [
        (r["step"], r["auc"])
        for r in read_jsonl(run / "metrics.jsonl")
        if r["kind"] == "eval" and r["split"] == "val"
    ]


def state(run: Path, step: int) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (dense, tables, optimizer states), rank by rank."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            out[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)

    for path in sorted((run / "checkpoints" / f"step_{step:08d}").glob("rank*.pt")):
        walk(path.stem, torch.load(path, weights_only=True))
    return out


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Four days of 1,024, 1,024, 512 and 512 rows (days 0-2 train, day 3 halved into val and
    test), for each config in one of MLPerf's two inputs: the reference reads one-hot days
    (raw Criteo text through ``preprocess``), made multi-hot as read by MLPerf's synthesis; the
    512k config reads MLPerf's materialized ``day_N_sparse_multi_hot.npz`` (synthetic rows,
    ``dlrm-vrgd generate --multi-hot mlperf``). Ids below the caps of :func:`caps`."""
    tmp = tmp_path_factory.mktemp("mlperf-days")
    raw = tmp / "raw"
    raw.mkdir()
    for i, n in enumerate((1024, 1024, 512, 512)):
        (raw / f"day_{i}.tsv").write_bytes(format_criteo_text(*make_rows(n, 60 + i)))
    onehot = tmp / "onehot"
    preprocess([raw], onehot, max_rows_per_table=caps(), progress=False)
    gen = {
        "data": {
            "source": "synthetic",
            "seed": 1,
            "train_rows": 2048,
            "val_rows": 512,
            "test_rows": 512,
            "cardinalities": caps(),
            "chunk_rows": 512,
        },
        "model": {"embedding_dim": 8, "dense_arch": [16, 8], "over_arch": [16, 1]},
    }
    (tmp / "gen.yaml").write_text(yaml.safe_dump(gen))
    out = tmp / "npz"
    cli("generate", "--config", str(tmp / "gen.yaml"), "--out", str(out), "--rows-per-day",
        "1024", "--multi-hot", "mlperf", "--workers", "1", "--no-progress")  # fmt: skip
    assert sorted(p.name for p in out.glob("*_sparse_multi_hot.npz")) == [
        f"day_{i}_sparse_multi_hot.npz" for i in range(4)
    ]
    return {"reference": onehot, "512k": out}


@pytest.fixture(scope="module")
def runs(days: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The reference on 1 rank; the 512k config on 1 and 2 ranks (its one 2-rank run)."""
    tmp = tmp_path_factory.mktemp("mlperf-runs")
    return {
        "reference-1": train("reference", days, tmp / "reference-1", 1),
        "512k-1": train("512k", days, tmp / "512k-1", 1),
        "512k-2": train("512k", days, tmp / "512k-2", 2),
        "tmp": tmp,
    }


@pytest.mark.parametrize("name", ["reference", "512k"])
def test_the_runs_keep_the_configs_protocol(name: str, days: dict[str, Path]) -> None:
    full = load_config(CONFIGS[name])
    here = load_config(CONFIGS[name], shrink(name, days, 2))
    kept = (
        ("model", ("arch", "dcn_num_layers", "embedding_backend", "embedding_precision")),
        ("optim", ("dense", "sparse", "schedule")),
        ("data", ("split", "multi_hot_sizes", "source", "max_val_rows")),
        ("run", ("epochs", "evals_per_epoch", "target_auc", "keep_best_checkpoint", "precision")),
    )
    for section, fields in kept:
        for field in fields:
            a, b = getattr(getattr(full, section), field), getattr(getattr(here, section), field)
            assert a == b, f"{section}.{field}"
    assert here.model.arch == "dlrm_dcn" and here.data.split == "mlperf"
    assert here.run.evals_per_epoch == 20 and here.run.target_auc == 0.80275


@pytest.mark.parametrize("name", ["reference-1", "512k-1", "512k-2"])
def test_an_epoch_with_twenty_evals_on_multi_hot_days(name: str, runs: dict[str, Path]) -> None:
    run = runs[name]
    start = read_jsonl(run / "metrics.jsonl")[0]
    assert start["kind"] == "start" and start["train_rows"] == 2560  # days 0-2
    assert start["total_steps"] == STEPS and start["eval_every"] == 1
    assert list(losses(run)) == list(range(1, STEPS + 1))
    assert all(np.isfinite(v) for v in losses(run).values())
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"]
    val = [r for r in evals if r["split"] == "val"]
    test = [r for r in evals if r["split"] == "test"]
    assert [r["rows"] for r in val] == [256] * len(val) and [r["rows"] for r in test] == [256]
    result = json.loads((run / "result.json").read_text())
    assert result["target"]["target_auc"] == 0.80275 and result["target"]["reached"] is False
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["data"]["multi_hot_sizes"] == load_config(CONFIGS["reference"]).data.multi_hot_sizes
    if name.startswith("512k"):  # VR-Adagrad's and GSNR Adagrad's ratios are recorded
        gsnr = read_jsonl(run / "gsnr.jsonl")[-1]
        assert len(gsnr["tables"]) == 26
        assert all(0 < t["ratio"] <= 1 for t in gsnr["tables"])
        assert gsnr["noise_scale"]["k"] == 8


def test_512k_on_two_ranks_equals_one_rank(runs: dict[str, Path]) -> None:
    """8 groups of 64 rows a step: one rank's 8 micro-batches or two ranks' 4, tables table-wise."""
    one, two = losses(runs["512k-1"]), losses(runs["512k-2"])
    assert list(one) == list(two)
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5)
    dense_a, tables_a = final_state(runs["512k-1"], STEPS)
    dense_b, tables_b = final_state(runs["512k-2"], STEPS)
    assert dense_a.keys() == dense_b.keys() and tables_a.keys() == tables_b.keys()
    assert len(tables_a) == 26
    for name in dense_a:
        torch.testing.assert_close(dense_b[name], dense_a[name], rtol=1e-5, atol=1e-6)
    for name in tables_a:
        torch.testing.assert_close(tables_b[name], tables_a[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["reference", "512k"])
def test_a_reachable_target_stops_the_run_there(
    name: str, runs: dict[str, Path], days: dict[str, Path]
) -> None:
    """The target: between the best AUC before the first eval that improves on all earlier ones
    (from the second on) and that eval's; the run must stop at that eval's step (the target
    changes nothing before it is reached)."""
    full = runs[f"{name}-1"]
    evals = val_evals(full)[:-1]  # the last is the final eval
    k = next((i for i in range(1, len(evals)) if evals[i][1] > max(a for _, a in evals[:i])), None)
    assert k is not None, f"no eval improves on the earlier ones: {evals}"
    target = (max(a for _, a in evals[:k]) + evals[k][1]) / 2
    at = evals[k][0]
    out = train(name, days, runs["tmp"] / f"{name}-target", 1, f"run.target_auc={target!r}")
    assert list(losses(out)) == list(range(1, at + 1))  # stopped there
    assert losses(out) == {s: v for s, v in losses(full).items() if s <= at}
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == at and result["target"]["reached"] is True
    assert (out / "checkpoints" / f"step_{at:08d}").is_dir()  # the step that reached it


@pytest.mark.parametrize("name", ["reference-1", "512k-2"])
def test_resume_from_a_checkpoint_is_bit_for_bit(
    name: str, runs: dict[str, Path], days: dict[str, Path]
) -> None:
    """The uninterrupted run's copy, cut back to its step-3 checkpoint, resumed to the end."""
    full = runs[name]
    config, nproc = name.split("-")
    part = runs["tmp"] / f"{name}-resumed"
    shutil.copytree(full, part)
    for ckpt in (part / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > CKPT:
            shutil.rmtree(ckpt)
    assert sorted(p.name for p in (part / "checkpoints").glob("step_*")) == [f"step_{CKPT:08d}"]
    (part / "result.json").unlink()  # as a run stopped after its step-3 checkpoint
    records = read_jsonl(part / "metrics.jsonl")
    (part / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records if r.get("step", 0) <= CKPT)
    )
    assert max(losses(part)) == CKPT
    train(config, days, part, int(nproc), resume=True)
    assert losses(part) == losses(full)  # exactly
    assert val_evals(part) == val_evals(full)
    a, b = state(full, STEPS), state(part, STEPS)
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_export_and_score_the_reference_run(runs: dict[str, Path], tmp_path: Path) -> None:
    """The exported model (made multi-hot by MLPerf's synthesis, recorded in features.json)
    scores the test half of the last one-hot day as the run's own final test eval did."""
    run = runs["reference-1"]
    model = tmp_path / "model"
    cli("export", "--run", str(run), "--out", str(model))
    features = json.loads((model / "features.json").read_text())
    assert features["multi_hot_sizes"] == load_config(CONFIGS["reference"]).data.multi_hot_sizes
    assert features["multi_hot_synthesis"] == "mlperf-uniform"  # made multi-hot as read
    out = tmp_path / "p.csv"
    days = json.loads((run / "config.json").read_text())["data"]["path"]
    cli("score", "--model", str(model), "--input", days, "--split", "test", "--out", str(out),
        "--no-progress", "--engine", "torch")  # fmt: skip
    metrics = json.loads(out.with_suffix(".csv.metrics.json").read_text())
    final = next(
        r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval" and r["split"] == "test"
    )
    assert metrics["rows"] == final["rows"] == 256
    for key in ("logloss", "ne", "calibration"):  # exact sums: the same probabilities
        assert metrics[key] == pytest.approx(final[key], rel=1e-6), key
    # score's AUC is a streaming histogram (bins 2^-11 wide, pairs in one bin count as ties);
    # this barely trained model's probabilities crowd a few bins: 0.479 against the exact 0.469
    assert metrics["auc"] == pytest.approx(final["auc"], abs=0.02)
