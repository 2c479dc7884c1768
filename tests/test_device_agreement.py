"""bench/device_agreement.py (run by bench/gpu_check.py on a GPU) on the CPU: the second trainer
is the "device". An honest pair agrees (exactly, and within bounds when the device's row
gradients carry rounding-level differences); every bug an outside audit planted in the second
trainer — a lost micro-batch's gradient, a merge that overwrites instead of adding, a halved mean
gradient, Adagrad state never written back — fails the check, as does a row moved on one side
and a ratio clipped differently. Tiny shapes: 8 groups of 256 rows."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from device_agreement import compare  # noqa: E402

from dlrm_vrgd.optim.sparse.accumulate import GroupRows  # noqa: E402
from dlrm_vrgd.train.loop import Trainer  # noqa: E402

TINY = ["run.global_batch=2048", "run.micro_batch=256"]


def run(
    tamper: Callable[[Trainer], None] | None = None, steps: int = 1, overrides: Sequence[str] = ()
) -> tuple[list, list]:
    return compare("cpu", steps, [*TINY, *overrides], tamper)


def once(plant: Callable[[Trainer], None]) -> Callable[[Trainer], None]:
    """``plant`` on the device trainer's first step only (tamper runs every step)."""
    planted = [False]

    def tamper(t: Trainer) -> None:
        if not planted[0]:
            planted[0] = True
            plant(t)

    return tamper


def test_the_cpu_agrees_with_itself_row_by_row() -> None:
    tables, problems = run(steps=2)
    assert problems == []
    assert len(tables) == 2 * 26 and all(t["max_diff"] == 0.0 for t in tables)
    assert sum(t["rows"] for t in tables) > 0


@pytest.mark.parametrize(
    "overrides",
    [[], ["optim.sparse.gsnr_placement=gradient"], ["optim.sparse.name=rowwise_adagrad"]],
    ids=["gsnr-update", "gsnr-gradient", "plain-fused-kernel"],
)
def test_rounding_level_differences_in_the_row_gradients_pass(overrides: list[str]) -> None:
    """The device's per-(row, group) gradients off by up to 16 float32 ulps each, as other
    summation orders and kernels leave them: rows then differ, within their bounds (GSNR
    scaling the row's step or the kernel's gradient, and the plain route's fused kernel)."""
    gen = torch.Generator().manual_seed(0)

    def perturb(t: Trainer) -> None:
        for lk in t.lookups:
            take = lk.capture.take

            def noisy(take=take) -> list:  # noqa: ANN001
                out = take()
                for call in out:
                    for rg in call:
                        u = torch.rand(rg.grads.shape, generator=gen) * 2 - 1
                        rg.grads.mul_(1 + 16 * torch.finfo(torch.float32).eps * u)
                return out

            lk.capture.take = noisy  # type: ignore[method-assign]

    tables, problems = run(once(perturb), steps=2, overrides=overrides)
    assert problems == []
    assert max(t["max_diff"] for t in tables) > 0  # the rows did differ
    assert 0 < max(t["grad_over_tol"] for t in tables) < 1


def lose_a_micro_batch(t: Trainer) -> None:
    """The third group's row gradients are lost: its rows are still touched and it still counts
    in k, with zero gradients (the rows' sets agree, so only the gradients can tell)."""
    for lk in t.lookups:
        take, calls = lk.capture.take, [0]

        def lossy(take=take, calls=calls) -> list:  # noqa: ANN001
            out = take()
            calls[0] += 1
            if calls[0] == 3:
                for call in out:
                    for rg in call:
                        rg.grads.zero_()
            return out

        lk.capture.take = lossy  # type: ignore[method-assign]


def overwrite_on_merge(t: Trainer) -> None:
    """Folding a group into a row already seen this step replaces its sum instead of adding."""
    for accs in t.sparse_opt._acc:
        for acc in accs:
            add = acc.add

            def overwriting(rg, acc=acc, add=add) -> None:  # noqa: ANN001
                if rg.rows.numel():
                    slots = acc.slot[rg.rows].long()
                    acc.grad_sum[slots[slots >= 0]] = 0.0
                add(rg)

            acc.add = overwriting


def halve_the_mean(t: Trainer) -> None:
    """The step's summed row gradients come out halved."""
    for accs in t.sparse_opt._acc:
        for acc in accs:
            drain = acc.drain

            def halved(drain=drain):  # noqa: ANN001, ANN202
                rows = drain()
                rows.grad_sum.mul_(0.5)
                return rows

            acc.drain = halved


def forget_adagrad_states(t: Trainer) -> None:
    """The row-wise Adagrad sums are computed and used, never written back."""
    for lk in t.lookups:
        for view in lk.space_views():
            view.put_states_ = lambda rows, values: None


def clip_at_another_gamma(t: Trainer) -> None:
    t.sparse_opt.gamma = 0.3


@pytest.mark.parametrize(
    "plant,says",
    [
        (lose_a_micro_batch, "mean gradients"),
        (overwrite_on_merge, "mean gradients"),
        (halve_the_mean, "mean gradients"),
        (forget_adagrad_states, "row-wise states"),
        (clip_at_another_gamma, "ratios"),
    ],
    ids=["lost-micro-batch", "overwriting-merge", "halved-mean", "states-not-written", "gamma"],
)
def test_a_planted_bug_fails_the_check(plant: Callable[[Trainer], None], says: str) -> None:
    _, problems = run(once(plant))
    assert any(says in p for p in problems), problems
    assert not any("check bug" in p for p in problems), problems  # the reference held


def gpu_route(t: Trainer) -> None:
    """The route a GPU's trainer takes: static-size (padded) captures, groups merged at the
    step (:class:`GroupRows`) instead of folded into slots."""
    opt = t.sparse_opt
    for li, lk in enumerate(t.lookups):
        lk.capture.static_size = True
        opt._acc[li] = [GroupRows(sp.dim, lk.device) for sp in lk.capture.layout.spaces]


def overwrite_on_gpu_merge(t: Trainer) -> None:
    """On the GPU's route: merging a group replaces the earlier groups' gradients of its rows."""
    gpu_route(t)
    for accs in t.sparse_opt._acc:
        for acc in accs:
            add = acc.add

            def overwriting(rg, acc=acc, add=add) -> None:  # noqa: ANN001
                for part in acc._parts:
                    part.grads[torch.isin(part.rows, rg.rows)] = 0.0
                add(rg)

            acc.add = overwriting


def test_the_gpu_route_on_the_device_side_agrees() -> None:
    tables, problems = run(once(gpu_route), steps=2)
    assert problems == []
    assert sum(t["rows"] for t in tables) > 0


def test_an_overwriting_merge_on_the_gpu_route_fails_the_check() -> None:
    _, problems = run(once(overwrite_on_gpu_merge))
    assert any("mean gradients" in p for p in problems), problems
    assert not any("check bug" in p for p in problems), problems


def test_a_row_moved_beyond_its_bound_is_reported() -> None:
    def tamper(trainer: Trainer) -> None:  # one row of table 0, a little off before the step
        with torch.no_grad():
            trainer.lookups[0].table_weights()[0][0] += 1e-2

    _, problems = run(tamper)
    assert any(
        "t_cat_0: a row moved" in p or "t_cat_0: rows the step did not" in p for p in problems
    ), problems
