"""Dense optimizers under the group protocol (DESIGN.md 4.2).

The trainer treats every dense optimizer alike: ``collect()`` after the backward of each group
(micro-batch, whose loss is the mean over its own ``B`` rows), then one ``step()`` per global
batch. :class:`GroupAveraged` gives a stock ``torch.optim`` optimizer that protocol: the ``k``
local groups' gradients are summed (each moved out of ``.grad`` into the step's sum, so that its
``|g_d|²`` can be taken for the gradient noise scale, :mod:`dlrm_vrgd.optim.noise_scale`), and
``step()`` averages them over all groups of all ranks (one all-reduce of the flattened gradients
per step) before the inner step, so the update is exactly the one the base optimizer would make
on the whole global batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dlrm_vrgd.config import DenseOptimConfig
from dlrm_vrgd.optim.noise_scale import GroupSqNorms, NoisePieces, sq_norms
from dlrm_vrgd.optim.vrgd import (
    VR_OPTIMIZERS,
    VRLAMB,
    VRLARS,
    VRSGD,
    GroupGSNROptimizer,
    VRAdagrad,
    VRAdam,
)


class GroupAveraged:
    """Wraps ``optimizer`` (any ``torch.optim.Optimizer``) for the group protocol. ``names``:
    the parameters' names, in ``param_groups`` order (for the noise scale's records)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        process_group: dist.ProcessGroup | None = None,
        names: list[str] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.process_group = process_group
        self.k = 0
        params = self._params()
        self.names = names or [f"param{i}" for i in range(len(params))]
        self._sums: dict[torch.Tensor, torch.Tensor] = {}
        self._group_norms = GroupSqNorms(params)
        self._noise: NoisePieces | None = None
        #: Keep the gradient noise scale's sums (off: ``.grad`` sums the groups as autograd
        #: leaves it, and :meth:`noise_pieces` is None; bench/gsnr_overhead.py compares both).
        self.track_noise = True

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def _params(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    @torch.no_grad()
    def collect(self) -> None:
        """Fold the group's ``p.grad`` into the step's sums (and its ``|g|²`` into the noise
        scale's), then clear it: one more group."""
        if not self.track_noise:  # the gradients stay summed in .grad
            self.k += 1
            return
        params = [p for p in self._params() if p.grad is not None]
        self._group_norms.add(params, [p.grad for p in params])
        sums, grads = [], []
        for p in params:
            if p in self._sums:
                sums.append(self._sums[p])
                grads.append(p.grad)
            else:
                self._sums[p] = p.grad  # the first group's gradient becomes the sum
            p.grad = None
        if sums:
            torch._foreach_add_(sums, grads)
        self.k += 1

    @torch.no_grad()
    def step(self) -> None:
        if self.k == 0:
            raise RuntimeError("step() called before any collect()")
        params = self._params()
        for p in params:
            if p in self._sums:
                p.grad = self._sums.pop(p)
        k_total = self.k
        norms = self._group_norms.total
        if self.process_group is not None:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads] + [norms.to(grads[0].dtype)])
            dist.all_reduce(flat, group=self.process_group)
            offset = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n
            norms.copy_(flat[offset:])
            k_total *= dist.get_world_size(self.process_group)
        self._noise = None
        if self.track_noise:
            present = [p for p in params if p.grad is not None]
            grad_sq = self._group_norms.spread(present, sq_norms([p.grad for p in present]))
            self._noise = NoisePieces.of(self.names, grad_sq, norms, k_total)
        for p in params:
            if p.grad is not None:
                p.grad.div_(k_total)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._group_norms.reset()
        self.k = 0

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._sums.clear()
        self._group_norms.reset()
        self.k = 0

    def noise_pieces(self) -> NoisePieces | None:
        """Per tensor, ``|ḡ|²`` and ``mean_d |g_d|²`` of the last step (DESIGN.md 4.6)."""
        return self._noise

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def gsnr_summary(self) -> list[dict[str, Any]]:
        """Plain optimizers measure no GSNR."""
        return []


DenseOptimizer = GroupAveraged | GroupGSNROptimizer


def build_dense_optimizer(
    cfg: DenseOptimConfig,
    named_params: Iterable[tuple[str, nn.Parameter]],
    process_group: dist.ProcessGroup | None = None,
) -> DenseOptimizer:
    """The dense optimizer named by ``cfg``, with the group protocol (collect / step)."""
    named = list(named_params)
    if cfg.name in ("lars", "lamb"):  # the plain algorithms: their VR classes with γ = 1
        cfg = cfg.model_copy(update={"name": f"vr{cfg.name}", "gamma": 1.0})
    if cfg.name in VR_OPTIMIZERS:
        common = {
            "lr": cfg.lr,
            "weight_decay": cfg.weight_decay,
            "gamma": cfg.gamma,
            "process_group": process_group,
        }
        if cfg.name == "vrsgd":
            opt: GroupGSNROptimizer = VRSGD(
                named,
                momentum=cfg.momentum,
                dampening=cfg.dampening,
                nesterov=cfg.nesterov,
                **common,
            )
        elif cfg.name == "vradam":
            opt = VRAdam(named, betas=cfg.betas, eps=cfg.eps, gsnr_beta=cfg.gsnr_beta,
                         placement=cfg.gsnr_placement, **common)  # fmt: skip
        elif cfg.name == "vradagrad":  # one placement: the ratio scales the step
            opt = VRAdagrad(
                named,
                eps=cfg.eps,
                initial_accumulator_value=cfg.initial_accumulator_value,
                **common,
            )
        elif cfg.name == "vrlars":
            opt = VRLARS(
                named,
                momentum=cfg.momentum,
                eps=cfg.eps,
                trust_coefficient=cfg.trust_coefficient,
                **common,
            )
        else:
            opt = VRLAMB(named, betas=cfg.betas, eps=cfg.eps, gsnr_beta=cfg.gsnr_beta,
                         placement=cfg.gsnr_placement, **common)  # fmt: skip
        for group in opt.param_groups:
            group.setdefault("initial_lr", group["lr"])
        return opt
    params = [p for _, p in named]
    if cfg.name == "sgd":
        inner: torch.optim.Optimizer = torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            dampening=cfg.dampening,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
        )
    elif cfg.name == "adam":
        inner = torch.optim.Adam(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    elif cfg.name == "adamw":
        inner = torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    elif cfg.name == "adagrad":
        inner = torch.optim.Adagrad(
            params,
            lr=cfg.lr,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            initial_accumulator_value=cfg.initial_accumulator_value,
        )
    else:  # pragma: no cover - the config's Literal rules this out
        raise ValueError(f"unknown dense optimizer {cfg.name!r}")
    for group in inner.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return GroupAveraged(inner, process_group, [n for n, _ in named])
