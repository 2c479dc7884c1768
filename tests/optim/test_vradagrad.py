"""Dense Adagrad and VR-Adagrad: the ratio scales the step, config, trainer and resume.

The update rule itself is checked against a float64 reference in test_vrgd_reference.py and
against ``torch.optim.Adagrad`` (γ = 1, and ratio 1) in test_vrgd.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from dlrm_vrgd.config import DenseOptimConfig
from dlrm_vrgd.optim.dense import GroupAveraged, build_dense_optimizer
from dlrm_vrgd.optim.vrgd import VRAdagrad
from dlrm_vrgd.rundir import read_jsonl
from dlrm_vrgd.train.loop import Trainer
from dlrm_vrgd.train.run import Callback, train

from ..conftest import tiny_config
from .test_vrgd import base_steps, make_params, vr_steps

GAMMA = 0.2


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step(self, record: dict) -> None:
        if record["step"] == self.step:
            raise RuntimeError("simulated crash")


def one_step(placement: str) -> tuple[VRAdagrad, list[torch.Tensor], list[torch.Tensor]]:
    """One measured VR-Adagrad step (4 groups) and, from the same weights, torch's Adagrad on ḡ:
    the optimizer, its weights' moves and Adagrad's."""
    ours, ref = make_params(), make_params()
    before = [p.detach().clone() for p in ours]
    opt = VRAdagrad(ours, lr=0.05, gamma=GAMMA, placement=placement)
    opt.measure_steps = True
    vr_steps(opt, ours, steps=1)
    base_steps(torch.optim.Adagrad(ref, lr=0.05), ref, steps=1)
    moved = [(p.detach() - b).abs() for p, b in zip(ours, before, strict=True)]
    plain = [(p.detach() - b).abs() for p, b in zip(ref, before, strict=True)]
    return opt, moved, plain


def test_update_moves_every_element_by_its_ratio() -> None:
    """``update``: each element moves by exactly r times Adagrad's step; the realised step ratio
    in the summary is the mean ratio."""
    opt, moved, plain = one_step("update")
    for entry, m, q in zip(opt.gsnr_summary(), moved, plain, strict=True):
        realised = m / q
        assert GAMMA - 1e-5 <= float(realised.min()) and float(realised.max()) <= 1 + 1e-5
        assert entry["step_ratio_mean"] == pytest.approx(entry["ratio"], rel=1e-4)
        assert entry["step_ratio_mean"] == pytest.approx(float(realised.mean()), rel=1e-4)
    assert min(e["step_ratio_mean"] for e in opt.gsnr_summary()) < 0.9  # it did damp
    assert any(e["frac_clipped"] > 0 for e in opt.gsnr_summary())


def test_gradient_placement_cancels_on_the_first_step() -> None:
    """Why ``update`` is the default: fed ``r⊙ḡ``, Adagrad's first step is ``lr·u/|u|`` whatever
    ``r`` is, so no element is damped."""
    opt, moved, plain = one_step("gradient")
    for entry, m, q in zip(opt.gsnr_summary(), moved, plain, strict=True):
        torch.testing.assert_close(m, q, rtol=1e-5, atol=1e-7)
        assert entry["ratio"] < 1.0  # the ratio was there; the step ignored it
        assert entry["step_ratio_mean"] == pytest.approx(1.0, abs=1e-4)


# ------------------------------------------------------------------------------- config
def test_build_adagrad_and_vradagrad_from_config() -> None:
    named = [(f"w{i}", p) for i, p in enumerate(make_params())]
    fields = {"lr": 0.004, "eps": 1e-10, "initial_accumulator_value": 0.5, "weight_decay": 0.0}
    plain = build_dense_optimizer(DenseOptimConfig(name="adagrad", **fields), named)
    assert isinstance(plain, GroupAveraged)
    assert isinstance(plain.optimizer, torch.optim.Adagrad)
    group = plain.param_groups[0]
    assert (group["lr"], group["eps"], group["initial_accumulator_value"]) == (0.004, 1e-10, 0.5)
    assert group["lr_decay"] == 0
    torch.testing.assert_close(plain.optimizer.state[named[0][1]]["sum"].max(), torch.tensor(0.5))

    # gsnr_placement is vradam's / vrlamb's: vradagrad always scales its step
    cfg = DenseOptimConfig(name="vradagrad", gamma=0.3, gsnr_placement="gradient", **fields)
    vr = build_dense_optimizer(cfg, named)
    assert isinstance(vr, VRAdagrad)
    group = vr.param_groups[0]
    assert group["placement"] == "update" and group["gamma"] == 0.3
    assert (group["lr"], group["eps"], group["initial_accumulator_value"]) == (0.004, 1e-10, 0.5)
    assert group["initial_lr"] == 0.004  # the schedule's base


def test_plain_adagrad_is_group_averaged() -> None:
    """``adagrad`` over k groups a step is torch's Adagrad on their mean gradient."""
    named = [(f"w{i}", p) for i, p in enumerate(make_params())]
    opt = build_dense_optimizer(DenseOptimConfig(name="adagrad", lr=0.05, weight_decay=0.01), named)
    ours = [p for _, p in named]
    vr_steps(opt, ours, steps=4, k=4)
    ref = make_params()
    base_steps(torch.optim.Adagrad(ref, lr=0.05, eps=1e-8, weight_decay=0.01), ref, steps=4)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "field,value",
    [("initial_accumulator_value", -1.0), ("eps", 0.0), ("name", "vradagrd")],
)
def test_bad_fields_are_named(field: str, value) -> None:
    with pytest.raises(ValidationError, match=field):
        DenseOptimConfig(**{field: value})


# ------------------------------------------------------------------------------ trainer
def test_vradagrad_with_gamma_one_trains_like_adagrad() -> None:
    common = {"lr": 0.05, "initial_accumulator_value": 0.1}
    a = Trainer(tiny_config(optim={"dense": {"name": "adagrad", **common}}))
    b = Trainer(tiny_config(optim={"dense": {"name": "vradagrad", "gamma": 1.0, **common}}))
    for _ in range(3):
        ra, rb = a.train_step(), b.train_step()
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
    for (_, x), (_, y) in zip(
        a.model.named_dense_parameters(), b.model.named_dense_parameters(), strict=True
    ):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["vradagrad", "adagrad"])
def test_resume_equals_uninterrupted(name: str, tmp_path: Path) -> None:
    cfg = tiny_config(
        "run.steps=5",
        "run.checkpoint_every=2",
        f"optim.dense.name={name}",
        "optim.dense.lr=0.05",
        f"optim.dense.gamma={GAMMA}",
        "optim.dense.initial_accumulator_value=0.01",
    )
    whole = train(cfg, tmp_path / "whole")
    with pytest.raises(RuntimeError):
        train(cfg, tmp_path / "crashed", callbacks=[CrashAt(3)])
    resumed = train(cfg, tmp_path / "crashed", resume=True)
    assert resumed.losses == whole.losses[2:]  # steps 3..5, bit for bit
    assert resumed.test == whole.test
    if name == "vradagrad":  # every moving element moved by its ratio r ∈ [γ, 1], some by < 1
        dense = read_jsonl(tmp_path / "crashed" / "gsnr.jsonl")[-1]["dense"]
        for entry in dense:  # read from float32 weight moves: a few 1e-4 of slack
            assert GAMMA - 1e-3 <= entry["step_ratio_p10"] <= entry["step_ratio_mean"] <= 1 + 1e-3
        assert min(entry["step_ratio_mean"] for entry in dense) < 0.9
