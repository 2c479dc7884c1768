"""The optimizers under ``DistributedDataParallel`` (docs/library.md, "DDP"): 2 gloo ranks.

The pattern: every micro-batch's forward and backward inside ``model.no_sync()``, then
``collect()``; ``step()`` once a global step all-reduces the sums ``S``, ``Q`` and ``k``. It must
take the step of the optimizer driven without DDP on one process with the union of the rows,
micro-batch by micro-batch (the reference the project's trainer is proven equal to in
tests/train/test_distributed.py). A loop that forgets ``no_sync`` lets DDP average every
micro-batch across the ranks before ``collect()``: the optimizer sees identical gradients on
every rank, and must warn.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dlrm_vrgd.optim.vrgd import VRSGD, VRAdam

from ..dist_utils import run_ranks

WORLD, A, B, STEPS, FEATURES = 2, 2, 16, 3, 8
OPTIMIZERS = {
    "vradam": lambda named, pg: VRAdam(named, lr=0.01, gamma=0.3, process_group=pg),
    "vrsgd": lambda named, pg: VRSGD(named, lr=0.1, momentum=0.9, gamma=0.3, process_group=pg),
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1))


def rows(step: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``group`` (``rank·A + j``) of global step ``step``: ``B x F`` and ``B``."""
    g = torch.Generator().manual_seed(1000 * step + group)
    x = torch.randn(B, FEATURES, generator=g)
    y = (x[:, 0] + 0.5 * torch.randn(B, generator=g) > 0).float()
    return x, y


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def ddp_rank(rank: int, world: int, name: str, no_sync: bool) -> dict[str, Any]:
    """Train ``STEPS`` global steps with a DDP-wrapped model; the weights and what was said."""
    handler = Messages()
    logging.getLogger("dlrm_vrgd.optim.vrgd").addHandler(handler)
    model = DDP(make_model())
    opt = OPTIMIZERS[name](model.module.named_parameters(), dist.group.WORLD)
    identical = []
    for step in range(STEPS):
        for j in range(A):
            x, y = rows(step, rank * A + j)
            if no_sync:  # the pattern: DDP does not average; collect() sees this rank's own
                with model.no_sync():
                    loss_of(model, x, y).backward()
            else:  # the mistake: DDP averages this micro-batch across the ranks
                loss_of(model, x, y).backward()
            opt.collect()
        opt.step()
        identical.append(opt.identical_across_ranks)
    logging.getLogger("dlrm_vrgd.optim.vrgd").removeHandler(handler)
    return {
        "state": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
        "identical": identical,
        "warnings": handler.messages,
    }


def reference(name: str) -> dict[str, torch.Tensor]:
    """One process, no DDP, no process group: the union of the ranks' micro-batches."""
    model = make_model()
    opt = OPTIMIZERS[name](model.named_parameters(), None)
    for step in range(STEPS):
        for group in range(WORLD * A):
            loss_of(model, *rows(step, group)).backward()
            opt.collect()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_no_sync_pattern_takes_the_single_process_step(tmp_path: Path, name: str) -> None:
    out = run_ranks(ddp_rank, WORLD, tmp_path, name, True)
    ref = reference(name)
    start = make_model().state_dict()
    for result in out:
        assert result["identical"] == [False] * STEPS
        assert not any("identical gradients" in m for m in result["warnings"])
        for key, want in ref.items():
            assert not torch.equal(want, start[key])  # the steps moved the weights
            torch.testing.assert_close(result["state"][key], want, rtol=1e-5, atol=1e-6)


def test_forgotten_no_sync_is_detected_and_warned(tmp_path: Path) -> None:
    out = run_ranks(ddp_rank, WORLD, tmp_path, "vradam", False)
    ref = reference("vradam")
    for result in out:
        assert result["identical"] == [True] * STEPS
        warned = [m for m in result["warnings"] if "identical gradients" in m]
        assert len(warned) == 1 and "no_sync" in warned[0]
    # and the forgetful loop did train differently (averaged groups: a smaller spread)
    diff = max((out[0]["state"][k] - ref[k]).abs().max().item() for k in ref)
    assert diff > 1e-4


def test_lr_scheduler_drives_the_group_lr() -> None:
    """docs/library.md's scheduler claim: a ``torch.optim.lr_scheduler`` steps a VRGD optimizer
    as it steps ``torch.optim`` (γ = 1: VR-SGD is SGD on the mean of the groups' gradients)."""
    a, b = make_model(), make_model()
    vr = VRSGD(a.named_parameters(), lr=0.1, momentum=0.9, gamma=1.0)
    sgd = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5**s) for o in (vr, sgd)]
    for step in range(STEPS):
        for group in range(A):
            loss_of(a, *rows(step, group)).backward()
            vr.collect()
        sum(loss_of(b, *rows(step, g)) for g in range(A)).div(A).backward()
        sgd.step()
        sgd.zero_grad()
        vr.step()
        for s in scheds:
            s.step()
    assert vr.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**STEPS)
    for (key, want), got in zip(b.state_dict().items(), a.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=key)
