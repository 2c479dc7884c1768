"""The best-validation checkpoint survives pruning, ``export --best`` exports it, early stopping
ends a run whose validation AUC stopped improving, and ``checkpoint_every_s`` checkpoints by
the clock. Expected steps are worked out here from the run's own metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from dlrm_vrgd import checkpoint as ckpt
from dlrm_vrgd.rundir import read_jsonl
from dlrm_vrgd.train.run import Callback, train

from ..conftest import tiny_config, tiny_config_dict


def val_aucs(out: Path) -> list[tuple[int, float]]:
    """(step, AUC) of the periodic validation evals, in order (the final one excluded)."""
    records = read_jsonl(out / "metrics.jsonl")
    last = max(r["step"] for r in records if r["kind"] == "train")
    return [
        (r["step"], r["auc"])
        for r in records
        if r["kind"] == "eval" and r["split"] == "val" and r["step"] < last
    ]


def first_best(evals: list[tuple[int, float]]) -> tuple[int, float]:
    best = evals[0]
    for step, auc in evals[1:]:
        if auc > best[1]:
            best = (step, auc)
    return best


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", *args], capture_output=True, text=True, timeout=300
    )


# A learning rate high enough that validation AUC peaks early and then wanders.
NOISY = ("optim.dense.lr=0.3", "optim.sparse.lr=3.0", "run.eval_every=1", "run.eval_rows=256")


def test_the_best_checkpoint_is_kept_beside_the_newest_and_exported(tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(
        tiny_config(*NOISY, "run.steps=12", "run.checkpoint_every=4", "run.keep_checkpoints=1"), out
    )
    evals = val_aucs(out)
    best_step, best_auc = first_best(evals)
    assert best_step < 11, "the test needs a run whose best is not its last eval"
    names = [p.name for p in ckpt.list_checkpoints(out)]
    assert names == [f"step_{best_step:08d}", "step_00000012"]
    best = json.loads((out / "checkpoints" / ckpt.BEST).read_text())
    assert best == {"step": best_step, "val_auc": best_auc, "checkpoint": f"step_{best_step:08d}"}
    assert ckpt.best_checkpoint(out).name == f"step_{best_step:08d}"

    done = cli(
        "export", "--run", str(out), "--best", "--out", str(tmp_path / "model"), "--no-program"
    )
    assert done.returncode == 0, done.stderr
    assert f"best-validation checkpoint (checkpoints/best.json): step {best_step}" in done.stdout
    manifest = json.loads((tmp_path / "model" / "manifest.json").read_text())
    assert manifest["step"] == best_step and manifest["checkpoint"] == f"step_{best_step:08d}"

    both = cli("export", "--run", str(out), "--best", "--step", "12", "--out", str(tmp_path / "m2"))
    assert both.returncode == 2 and "--best and --step" in both.stderr


def test_without_keep_best_only_the_newest_are_kept(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = tiny_config(
        *NOISY, "run.steps=12", "run.checkpoint_every=4", "run.keep_checkpoints=1",
        "run.keep_best_checkpoint=false",
    )  # fmt: skip
    train(cfg, out)
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000012"]
    assert not (out / "checkpoints" / ckpt.BEST).exists()
    done = cli("export", "--run", str(out), "--best", "--out", str(tmp_path / "model"))
    assert done.returncode == 2 and "kept no best checkpoint" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "model").exists()


def test_early_stop_after_patience_evals_without_a_better_auc(tmp_path: Path) -> None:
    out = tmp_path / "run"
    patience = 2
    cfg = tiny_config(*NOISY, "run.steps=40", f"run.early_stop_patience={patience}")
    result = train(cfg, out)

    # worked out from the evals: stop at the first eval `patience` evals after the best so far
    records = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "eval"]
    periodic = [(r["step"], r["auc"]) for r in records if r["split"] == "val"][:-1]
    best, expected = periodic[0], None
    for step, auc in periodic[1:]:
        if auc > best[1]:
            best = (step, auc)
        elif step - best[0] >= patience:
            expected = step
            break
    assert expected is not None and expected < 40, "the test needs a run that plateaus"
    assert result.steps == expected and periodic[-1][0] == expected
    assert result.stopped_early == {
        "step": expected, "best_step": best[0], "best_val_auc": best[1], "patience": patience,
    }  # fmt: skip
    stored = json.loads((out / "result.json").read_text())
    assert stored["steps"] == expected and stored["stopped_early"] == result.stopped_early
    assert stored["test"]["auc"] == result.test["auc"]  # the final evals still ran
    kinds = [r["kind"] for r in read_jsonl(out / "metrics.jsonl")]
    assert kinds.count("early_stop") == 1
    # resuming a run that stopped early finds it finished
    again = train(cfg, out, resume=True)
    assert again.already_finished and again.steps == expected


def test_early_stop_needs_periodic_evals() -> None:
    raw = tiny_config_dict(run={"early_stop_patience": 3, "eval_every": 0})
    done = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "config", "--config", "/dev/stdin"],
        input=yaml.safe_dump(raw),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "early_stop_patience needs periodic evaluations" in done.stderr


class Slow(Callback):
    """Each step takes at least ``seconds`` (so the clock, not the step count, decides)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step(self, record: dict) -> None:
        time.sleep(self.seconds)


def test_checkpoint_every_s_checkpoints_by_the_clock(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = tiny_config(
        "run.steps=60", "run.checkpoint_every_s=1", "run.keep_checkpoints=1000",
        "run.eval_every=0",
    )  # fmt: skip
    train(cfg, out, callbacks=[Slow(0.05)])  # >= 3 s of steps
    ckpts = ckpt.list_checkpoints(out)
    steps = [int(p.name.removeprefix("step_")) for p in ckpts]
    assert steps[-1] == 60 and len(steps) >= 3  # at ~1 s, ~2 s, ... and the last step
    times = [(p / "manifest.json").stat().st_mtime for p in ckpts[:-1]]
    started = (out / "config.json").stat().st_mtime
    gaps = [b - a for a, b in zip([started, *times], times, strict=False)]
    assert all(g >= 0.9 for g in gaps), gaps  # never sooner than checkpoint_every_s


def test_a_finished_run_without_periodic_checkpoints_leaves_its_last_and_its_best(
    tmp_path: Path,
) -> None:
    """``checkpoint_every: 0`` (configs/criteo_small.yaml's setting): the finished run still
    leaves the checkpoint of its last step and the one of its best validation AUC, so
    ``export --run`` and ``export --run --best`` work."""
    out = tmp_path / "run"
    train(tiny_config(*NOISY, "run.steps=12", "run.checkpoint_every=0"), out)
    best_step, best_auc = first_best(val_aucs(out))
    assert best_step < 11, "the test needs a run whose best is not its last eval"
    names = [p.name for p in ckpt.list_checkpoints(out)]
    # the best, and the newest keep_checkpoints (2) beside it: the last step's among them
    assert f"step_{best_step:08d}" in names and names[-1] == "step_00000012", names
    assert len(names) <= 3, names
    best = json.loads((out / "checkpoints" / ckpt.BEST).read_text())
    assert best == {"step": best_step, "val_auc": best_auc, "checkpoint": f"step_{best_step:08d}"}
    last = cli("export", "--run", str(out), "--out", str(tmp_path / "m"), "--no-program")
    assert last.returncode == 0 and "exported step 12 " in last.stdout, last.stderr
    done = cli("export", "--run", str(out), "--best", "--out", str(tmp_path / "b"), "--no-program")
    assert done.returncode == 0 and f"exported step {best_step} " in done.stdout, done.stderr
