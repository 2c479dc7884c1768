"""VRGD optimizers: SGD, Adam(W), LARS, LAMB and Adagrad with a per-element GSNR step scale
(DESIGN.md 4.2; VR-Adagrad: docs/vrgd.md).

Each is a ``torch.optim.Optimizer`` with the *group protocol*: after the backward of each
gradient group (a micro-batch, whose loss is the mean over its own rows) call :meth:`collect`;
it folds ``p.grad`` into running sums ``S = Σ_d g_d`` and ``Q = Σ_d g_d²`` (fp32) and clears
``p.grad``. :meth:`step` then finishes the statistics — one all-reduce of the concatenated sums
across ``process_group`` when one is given — computes ``ḡ = S/k`` and the clipped, normalized
ratio ``r`` of :func:`~dlrm_vrgd.optim.gsnr.gsnr_ratio` per tensor, and updates:

* :class:`VRSGD`: ``u = r⊙ḡ``, then exactly ``torch.optim.SGD`` on ``u`` (weight decay,
  momentum, dampening, Nesterov): ``b = μb + (1−τ)(u + wd·θ)``, ``θ −= lr·b``.
* :class:`VRAdam`: ``p = β₃p + (1−β₃)r``, ``p̂ = p/(1−β₃ᵗ)``. ``placement="gradient"`` (the
  paper's): ``g' = p̂⊙ḡ`` feeds both moments of exactly ``torch.optim.AdamW`` (decoupled weight
  decay) and the update itself is not rescaled — Adam's ``m̂/√v̂`` cancels any scale that is
  constant over time, so the ratio acts only through how ``p̂`` varies. ``placement="update"``:
  the moments see ``ḡ`` and the step is ``lr·p̂⊙m̂/(√v̂+ε)`` (plus AdamW's decay), so every
  element moves by ``p̂ ∈ [γ, 1]`` times Adam's own step from the same state.
* :class:`VRLARS`: ``u = r⊙ḡ``; trust ratio ``tr = η‖θ‖/(‖u‖ + wd‖θ‖ + ε)`` for weights (1 for
  1-D parameters, or when a norm is 0); ``u += wd·θ``; ``b = μb + lr·tr·u``; ``θ −= b``.
* :class:`VRLAMB`: VRAdam's moments and placement, ``u = m̂/(√v̂ + ε) + wd·θ`` (``update``:
  ``u = p̂⊙m̂/(√v̂ + ε) + wd·θ``), ``θ −= lr·(‖θ‖/‖u‖)·u`` (ratio 1 if a norm is 0). The trust
  ratio undoes any scale shared by a whole tensor, so under ``update`` only the spread of
  ``p̂`` within a tensor changes the step.

* :class:`VRAdagrad`: ``torch.optim.Adagrad`` (L2 weight decay, ``lr_decay = 0``) with the ratio
  on the step, as VR-SGD's: ``g = ḡ + wd·θ``, ``s ← s + g⊙g`` (``s₀`` =
  ``initial_accumulator_value``), ``θ −= lr·(r⊙ḡ + wd·θ)/(√s + ε)``: the accumulator sees the
  unscaled gradient and every element moves by exactly ``r ∈ [γ, 1]`` times Adagrad's own step
  from the same state (``wd = 0``). ``placement="gradient"`` (for comparison) hands ``r⊙ḡ`` to
  Adagrad, accumulator included; Adagrad's ``g/√Σg²`` then cancels the ratio on an element's
  first step and any ratio that is constant over time (as for the tables, DESIGN.md 4.3).

VR-SGD and VR-LARS are linear in ``ḡ``: they have one placement (the ratio scales ``ḡ``, never
the weight decay).

With ``γ = 1`` the ratio is identically 1 and each reduces to its base optimizer; a step in
which every param group has ``γ = 1`` skips the second-moment sums and the ratio altogether.
With fewer than two groups in a step the ratio is 1 as well, and a warning is logged once.
After each step, :meth:`gsnr_summary` gives per-tensor figures for the metrics stream; on steps
with ``measure_steps`` set they include the realised step ratio ``|actual step| / |plain step|``
per element, where the plain step is the same optimizer's update from the same state with the
ratio left out (one extra update, computed and undone).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.adagrad import adagrad as adagrad_update
from torch.optim.adam import adam as adam_update
from torch.optim.sgd import sgd as sgd_update

from dlrm_vrgd.optim.gsnr import gsnr_ratios, step_ratio_stats
from dlrm_vrgd.optim.noise_scale import GroupSqNorms, NoisePieces, sq_norms

logger = logging.getLogger(__name__)

#: A measured tensor's figures (:meth:`GroupGSNROptimizer.gsnr_summary`), then its realised
#: step ratio's on measured steps.
GSNR_KEYS = ("raw_gsnr", "ratio", "frac_clipped", "frac_degenerate")
STEP_RATIO_KEYS = ("step_ratio_mean", "step_ratio_p10")


def _check(name: str, value: float, ok: bool) -> None:
    if not ok:
        raise ValueError(f"Invalid {name}: {value}")


def _check_common(lr: float, weight_decay: float, gamma: float) -> None:
    _check("learning rate", lr, lr >= 0.0)
    _check("weight_decay value", weight_decay, weight_decay >= 0.0)
    _check("gamma", gamma, 0.0 < gamma <= 1.0)


def _check_betas(betas: tuple[float, float], gsnr_beta: float, eps: float) -> None:
    _check("beta parameter at index 0", betas[0], 0.0 <= betas[0] < 1.0)
    _check("beta parameter at index 1", betas[1], 0.0 <= betas[1] < 1.0)
    _check("gsnr_beta", gsnr_beta, 0.0 <= gsnr_beta < 1.0)
    _check("epsilon value", eps, eps >= 0.0)


class GroupGSNROptimizer(Optimizer):
    """Base class: the group protocol and the GSNR statistics; subclasses implement
    :meth:`_update` for one param group given ``ḡ`` and ``r`` per parameter."""

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        process_group: dist.ProcessGroup | None = None,
        foreach: bool = True,
    ) -> None:
        super().__init__(params, defaults)
        self.process_group = process_group
        self.foreach = foreach
        self._k = 0
        self._sums: dict[Tensor, Tensor] = {}
        self._sqs: dict[Tensor, Tensor] = {}
        self._with_sq = True
        # the last step's figures: per tensor (name, numel, its columns' keys or None = not
        # measured), and per param group a (tensors x keys) float64 block on the device
        self._stats: list[tuple[str, int, tuple[str, ...] | None]] = []
        self._blocks: list[Tensor] = []
        self._summary: list[dict[str, Any]] | None = None
        self._warned_single_group = False
        self._warned_identical = False
        #: Set by each step on several ranks: every rank collected bit-identical gradients
        #: (a DDP loop without ``no_sync()``; see :meth:`_check_identical`).
        self.identical_across_ranks = False
        self._group_norms = GroupSqNorms(p for g in self.param_groups for p in g["params"])
        self._noise: NoisePieces | None = None
        #: Keep the gradient noise scale's sums (off: :meth:`noise_pieces` is None).
        self.track_noise = True
        #: Measure the realised step ratio in the next step (the trainer sets it on the steps
        #: whose GSNR it records; it costs one extra update).
        self.measure_steps = False
        #: Keep the next step's per-element ratios in :attr:`last_ratios` (name -> tensor;
        #: the trainer sets it on the steps TensorBoard's histograms follow).
        self.keep_ratios = False
        self.last_ratios: dict[str, Tensor] = {}

    # ------------------------------------------------------------------ protocol
    @property
    def groups_collected(self) -> int:
        return self._k

    @torch.no_grad()
    def collect(self) -> None:
        """Fold every ``p.grad`` into the step's sums as one more group; clear the grads."""
        if self._k == 0:  # first group of a step: are any statistics needed?
            self._with_sq = any(g["gamma"] < 1.0 for g in self.param_groups)
        with_sq = self._with_sq
        fresh, grads, sums, sqs = [], [], [], []
        if self.track_noise:  # the noise scale's Σ_d |g_d|²
            with_grad = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            self._group_norms.add(with_grad, [p.grad for p in with_grad])
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p not in self._sums:
                    fresh.append(p)
                else:
                    grads.append(p.grad.to(torch.float32))
                    sums.append(self._sums[p])
                    if with_sq:
                        sqs.append(self._sqs[p])
        for p in fresh:
            g = p.grad.to(torch.float32)
            self._sums[p] = g.clone()
            if with_sq:
                self._sqs[p] = g * g
        if grads:
            if self.foreach:
                torch._foreach_add_(sums, grads)
                if with_sq:
                    torch._foreach_addcmul_(sqs, grads, grads)
            else:
                for i, g in enumerate(grads):
                    sums[i].add_(g)
                    if with_sq:
                        sqs[i].addcmul_(g, g)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        self._k += 1

    def _reduce(self) -> int:
        """All-reduce the sums across the process group (one call); returns the total ``k``."""
        k = self._k
        if self.process_group is None:
            return k
        params = [p for g in self.param_groups for p in g["params"]]
        stores = (self._sums, self._sqs) if self._with_sq else (self._sums,)
        for store in stores:
            for p in params:
                if p not in store:  # keep every rank's layout identical
                    store[p] = torch.zeros_like(p, dtype=torch.float32)
        norms = self._group_norms.total
        device = params[0].device
        world = dist.get_world_size(self.process_group)
        # this rank's fingerprint of its local sums in its own slots, zeros elsewhere: the sum
        # below hands every rank every rank's fingerprint, bit for bit (x + 0 is exact)
        slots = torch.zeros(world, 2, dtype=torch.float32, device=device)
        slots[dist.get_rank(self.process_group)] = _fingerprint([self._sums[p] for p in params])
        flat = torch.cat(
            [store[p].reshape(-1) for store in stores for p in params]
            + [norms.to(device), slots.reshape(-1), torch.tensor([float(k)], device=device)]
        )
        dist.all_reduce(flat, group=self.process_group)
        offset = 0
        for buffers in stores:
            for p in params:
                n = p.numel()
                buffers[p].copy_(flat[offset : offset + n].view_as(p))
                offset += n
        norms.copy_(flat[offset : offset + norms.numel()])
        tail = flat[offset + norms.numel() :].tolist()  # the fingerprints and k: one copy
        self._check_identical([tuple(tail[2 * r : 2 * r + 2]) for r in range(world)])
        return int(round(tail[-1]))

    def _check_identical(self, prints: list[tuple[float, ...]]) -> None:
        """Warn (once) when every rank collected bit-identical gradients (``prints``: each
        rank's :func:`_fingerprint`): under DDP that is a loop without ``no_sync()``, whose
        backward averaged each micro-batch's gradient across the ranks before :meth:`collect`
        saw it; the groups are then copies of one another and the GSNR is overstated (the
        degenerate ratio 1 everywhere with one micro-batch a rank)."""
        world = len(prints)
        same = world > 1 and prints[0][1] != 0 and all(f == prints[0] for f in prints)
        self.identical_across_ranks = same
        if same and not self._warned_identical:
            logger.warning(
                "VRGD step: the %d ranks collected identical gradients. Under "
                "DistributedDataParallel, run every micro-batch's forward and backward inside "
                "`with model.no_sync():` (the optimizer all-reduces its own sums at step()); "
                "otherwise DDP averages each micro-batch across ranks before collect() and the "
                "GSNR is overstated. (Or the ranks read the same rows.)",
                world,
            )
            self._warned_identical = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finish the statistics of the collected groups and update once.

        A ``closure`` (re-evaluating the loss and calling ``backward``) is run under grad mode
        and its gradients are collected as one more group first.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self.collect()
        if self._k == 0:
            raise RuntimeError("step() called before collect(): no gradient groups")
        k = self._reduce()
        self._noise = self._noise_pieces(k) if self.track_noise else None
        if k < 2 and not self._warned_single_group:
            logger.warning("VRGD step with %d gradient group(s): GSNR is undefined, ratio = 1", k)
            self._warned_single_group = True
        self._stats, self._blocks, self._summary = [], [], None
        self.last_ratios = {}
        for group in self.param_groups:
            names = group.get("param_names") or [
                f"param{len(self._stats) + i}" for i in range(len(group["params"]))
            ]
            present = [
                (n, p) for n, p in zip(names, group["params"], strict=True) if p in self._sums
            ]
            if not present:
                continue
            params = [p for _, p in present]
            means = [(self._sums[p] / k).to(p.dtype) for p in params]
            ratios: list[Tensor | None] = [None] * len(params)
            columns: list[Tensor] = []  # one float64 entry per tensor each, on the device
            keys: tuple[str, ...] | None = None
            if group["gamma"] < 1.0:
                parts, seg = gsnr_ratios(
                    [self._sums[p] for p in params],
                    [self._sqs[p] for p in params],
                    k,
                    group["gamma"],
                )
                ratios = [r.to(p.dtype) for r, p in zip(parts, params, strict=True)]
                keys = GSNR_KEYS
                columns = [
                    t.double()
                    for t in (seg.raw_mean, seg.ratio_mean, seg.frac_clipped, seg.frac_degenerate)
                ]
                if self.keep_ratios:
                    self.last_ratios.update(
                        (n, r) for (n, _), r in zip(present, parts, strict=True)
                    )
            if self.measure_steps and keys is not None:
                columns += self._measured_update(group, params, means, ratios)
                keys += STEP_RATIO_KEYS
            else:
                self._update(group, params, means, ratios)
            if keys is not None:
                scale = self._scale_stats()
                if scale is not None:
                    columns.append(scale.double())
                    keys += ("scale",)
                self._blocks.append(torch.stack(columns, dim=1))
            for name, p in present:
                self._stats.append((name, p.numel(), keys))
        self._sums.clear()
        self._sqs.clear()
        self._group_norms.reset()
        self._k = 0
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._sums.clear()
        self._sqs.clear()
        self._group_norms.reset()
        self._k = 0

    def _noise_pieces(self, k: int) -> NoisePieces:
        """The noise scale's sums of the step (all groups of all ranks), per tensor."""
        params = self._group_norms.params
        names: list[str] = []
        for g in self.param_groups:
            given = g.get("param_names")
            names += given or [f"param{len(names) + i}" for i in range(len(g["params"]))]
        present = [p for p in params if p in self._sums]
        norms = sq_norms([self._sums[p] for p in present])
        grad_sq = self._group_norms.spread(present, norms)
        return NoisePieces.of(names, grad_sq, self._group_norms.total, k)

    def noise_pieces(self) -> NoisePieces | None:
        """Per tensor, ``|ḡ|²`` and ``mean_d |g_d|²`` of the last step (DESIGN.md 4.6)."""
        return self._noise

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        means: list[Tensor],
        ratios: list[Tensor | None],
    ) -> None:
        """Update ``params`` of ``group`` from ``ḡ`` (``means``) and ``r`` (None means 1)."""
        raise NotImplementedError

    def _scale_stats(self) -> Tensor | None:
        """An extra per-tensor figure of the update just made, on the device (none here; VRAdam
        gives the mean of ``p̂``, the scale it applied)."""
        return None

    def _measured_update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        means: list[Tensor],
        ratios: list[Tensor | None],
    ) -> list[Tensor]:
        """The update, plus the realised step ratio of each tensor (mean and 10th percentile,
        float64 on the device): the plain update (ratio 1) is made first from a copy of the
        state and undone, then the real one."""
        before = [p.detach().clone() for p in params]
        saved = [_clone_state(self.state[p]) for p in params]
        self._update(group, params, means, [None] * len(params))
        plain = [(p.detach() - b).abs() for p, b in zip(params, before, strict=True)]
        for p, b, st in zip(params, before, saved, strict=True):
            p.copy_(b)
            self.state[p] = st
        self._update(group, params, means, ratios)
        actual = [(p.detach() - b).abs() for p, b in zip(params, before, strict=True)]
        return list(step_ratio_stats(actual, plain))

    # ----------------------------------------------------------------- telemetry
    def gsnr_summary(self) -> list[dict[str, Any]]:
        """Per tensor of the last step: name, numel, mean raw GSNR, mean clipped ratio,
        fraction clipped at γ, fraction degenerate (``None`` where γ = 1 skipped the statistics)
        and, on measured steps, the realised step ratio. The figures stay on the device until
        this is called: it reads them back, all at once (one copy per step)."""
        if self._summary is not None:
            return self._summary
        unmeasured = {"raw_gsnr": None, "ratio": 1.0, "frac_clipped": 0.0, "frac_degenerate": None}
        values: list[float] = []
        if self._blocks:
            values = torch.cat([b.reshape(-1) for b in self._blocks]).tolist()
        out, at = [], 0
        for name, numel, keys in self._stats:
            entry: dict[str, Any] = {"name": name, "numel": numel}
            if keys is None:
                entry.update(unmeasured)
            else:
                row = values[at : at + len(keys)]
                at += len(keys)
                entry.update(
                    (key, None if math.isnan(v) and key in STEP_RATIO_KEYS else v)
                    for key, v in zip(keys, row, strict=True)
                )
            out.append(entry)
        self._summary = out
        return out


def _fingerprint(sums: list[Tensor]) -> Tensor:
    """Two float32 numbers of a rank's local sums ``S``: ``Σ S`` and ``Σ |S|`` (per tensor in
    its dtype, across tensors in float64). Two ranks' are bit-identical in practice only when
    their sums are: the check of :meth:`GroupGSNROptimizer._check_identical`."""
    first = torch.stack([s.sum() for s in sums]).double().sum()
    second = torch.stack(torch._foreach_norm(sums, 1)).double().sum()
    return torch.stack([first, second]).float()


def _clone_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()}


def _scaled(mean: Tensor, ratio: Tensor | None) -> Tensor:
    return mean if ratio is None else mean * ratio


def _norm64(t: Tensor) -> Tensor:
    """``‖t‖₂`` (computed in ``t``'s dtype) as a float64 device scalar."""
    return torch.linalg.vector_norm(t).double()


class VRSGD(GroupGSNROptimizer):
    """SGD with GSNR-scaled gradient ``u = r⊙ḡ`` (see module doc)."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        gamma: float = 0.1,
        *,
        process_group: dist.ProcessGroup | None = None,
        foreach: bool = True,
    ) -> None:
        _check_common(lr, weight_decay, gamma)
        _check("momentum value", momentum, momentum >= 0.0)
        _check("dampening value", dampening, dampening >= 0.0)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            nesterov=nesterov,
            weight_decay=weight_decay,
            gamma=gamma,
        )
        super().__init__(params, defaults, process_group, foreach)

    def _update(self, group, params, means, ratios) -> None:
        grads = [_scaled(m, r) for m, r in zip(means, ratios, strict=True)]
        bufs = [self.state[p].get("momentum_buffer") for p in params]
        sgd_update(
            params,
            grads,
            bufs,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=False,
            foreach=self.foreach,
        )
        if group["momentum"] != 0:
            for p, buf in zip(params, bufs, strict=True):
                self.state[p]["momentum_buffer"] = buf


def _gsnr_ema(state: dict[str, Any], ratio: Tensor | None, beta: float, step: int) -> Tensor | None:
    """``p = β₃p + (1−β₃)r`` and the bias-corrected ``p̂ = p/(1−β₃ᵗ)`` (None when r ≡ 1)."""
    if ratio is None:
        return None
    if "gsnr_ema" not in state:
        state["gsnr_ema"] = torch.zeros_like(ratio)
    ema = state["gsnr_ema"]
    ema.mul_(beta).add_(ratio, alpha=1.0 - beta)
    return ema / (1.0 - beta**step)


def _adam_state(state: dict[str, Any], p: Tensor) -> dict[str, Any]:
    """Adam's per-parameter state (step, first and second moments), created on first use."""
    if "step" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _check_placement(placement: str) -> None:
    if placement not in ("gradient", "update"):
        raise ValueError(f"Invalid placement: {placement!r} (gradient or update)")


class VRAdam(GroupGSNROptimizer):
    """AdamW with the GSNR ratio's EMA ``p̂`` on the moments' input (``placement="gradient"``,
    ``g' = p̂⊙ḡ``) or on the step (``"update"``, ``lr·p̂⊙m̂/(√v̂+ε)``); see the module doc."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        gamma: float = 0.1,
        gsnr_beta: float = 0.9,
        placement: str = "gradient",
        *,
        process_group: dist.ProcessGroup | None = None,
        foreach: bool = True,
    ) -> None:
        _check_common(lr, weight_decay, gamma)
        _check_betas(betas, gsnr_beta, eps)
        _check_placement(placement)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            gamma=gamma,
            gsnr_beta=gsnr_beta,
            placement=placement,
        )
        super().__init__(params, defaults, process_group, foreach)
        self._scales: list[Tensor | None] = []

    def _scale_stats(self) -> Tensor | None:
        if not self._scales or any(s is None for s in self._scales):
            return None
        return torch.stack([s.float().mean() for s in self._scales if s is not None])

    def _ratio_emas(self, group, params, ratios) -> list[Tensor | None]:
        """Advance Adam's step count and the ratio's EMA; ``p̂`` per parameter (None: r ≡ 1)."""
        scales = []
        for p, r in zip(params, ratios, strict=True):
            state = _adam_state(self.state[p], p)
            t = int(state["step"].item()) + 1
            scales.append(_gsnr_ema(state, r, group["gsnr_beta"], t))
        self._scales = scales
        return scales

    def _update(self, group, params, means, ratios) -> None:
        scales = self._ratio_emas(group, params, ratios)
        if group.get("placement", "gradient") == "update" and scales[0] is not None:
            self._update_scaled_step(group, params, means, scales)
            return
        grads, exp_avgs, exp_avg_sqs, steps = [], [], [], []
        for p, m, scale in zip(params, means, scales, strict=True):
            state = self.state[p]
            grads.append(_scaled(m, scale))
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adam_update(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=self.foreach,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _update_scaled_step(self, group, params, means, scales) -> None:
        """``placement="update"``: AdamW (as ``torch.optim.AdamW``'s single-tensor rule) on the
        unscaled ``ḡ``, its step ``lr·m̂/(√v̂+ε)`` scaled element-wise by ``p̂``."""
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        for p, g, scale in zip(params, means, scales, strict=True):
            state = self.state[p]
            state["step"] += 1
            t = int(state["step"].item())
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            p.mul_(1.0 - lr * wd)
            exp_avg.lerp_(g, 1.0 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**t)).add_(eps)
            p.addcdiv_(exp_avg * scale, denom, value=-lr / (1.0 - beta1**t))


class VRLARS(GroupGSNROptimizer):
    """LARS on the GSNR-scaled gradient (see module doc)."""

    def __init__(
        self,
        params: Any,
        lr: float = 1.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        gamma: float = 0.1,
        *,
        process_group: dist.ProcessGroup | None = None,
        foreach: bool = True,
    ) -> None:
        _check_common(lr, weight_decay, gamma)
        _check("momentum value", momentum, 0.0 <= momentum < 1.0)
        _check("trust_coefficient", trust_coefficient, trust_coefficient > 0.0)
        _check("epsilon value", eps, eps >= 0.0)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            gamma=gamma,
        )
        super().__init__(params, defaults, process_group, foreach)

    def _update(self, group, params, means, ratios) -> None:
        wd, mu = group["weight_decay"], group["momentum"]
        for p, m, r in zip(params, means, ratios, strict=True):
            u = _scaled(m, r)
            trust: Tensor | None = None  # 1 (biases, 1-D)
            if p.ndim > 1:  # on the device, in float64 as Python's floats: nothing read back
                w_norm, u_norm = _norm64(p), _norm64(u)
                trust = torch.where(
                    (w_norm > 0) & (u_norm > 0),
                    group["trust_coefficient"] * w_norm / (u_norm + wd * w_norm + group["eps"]),
                    1.0,
                )
            if wd:
                u = u.add(p, alpha=wd)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            if trust is None:
                buf.mul_(mu).add_(u, alpha=group["lr"])
            else:
                buf.mul_(mu).addcmul_(u, (group["lr"] * trust).to(buf.dtype))
            p.sub_(buf)


class VRLAMB(VRAdam):
    """LAMB on VRAdam's moments (see module doc); ``eps`` defaults to LAMB's 1e-6."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        gamma: float = 0.1,
        gsnr_beta: float = 0.9,
        placement: str = "gradient",
        *,
        process_group: dist.ProcessGroup | None = None,
        foreach: bool = True,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            gamma,
            gsnr_beta,
            placement,
            process_group=process_group,
            foreach=foreach,
        )

    def _update(self, group, params, means, ratios) -> None:
        beta1, beta2 = group["betas"]
        on_step = group.get("placement", "gradient") == "update"
        scales = self._ratio_emas(group, params, ratios)
        for p, m, scale in zip(params, means, scales, strict=True):
            state = self.state[p]
            state["step"] += 1
            t = int(state["step"].item())
            g = m if on_step else _scaled(m, scale)
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.lerp_(g, 1.0 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            m_hat = exp_avg / (1.0 - beta1**t)
            v_hat = exp_avg_sq / (1.0 - beta2**t)
            u = m_hat / (v_hat.sqrt() + group["eps"])
            if on_step and scale is not None:
                u.mul_(scale)
            if group["weight_decay"]:
                u.add_(p, alpha=group["weight_decay"])
            # ‖θ‖/‖u‖, 1 where a norm is 0 or the ratio not finite: on the device, in float64
            # as Python's floats, nothing read back
            w_norm, u_norm = _norm64(p), _norm64(u)
            trust = w_norm / u_norm
            ok = (w_norm > 0) & (u_norm > 0) & torch.isfinite(trust)
            trust = torch.where(ok, trust, 1.0)
            p.addcmul_(u, (group["lr"] * trust).to(p.dtype), value=-1.0)


class VRAdagrad(GroupGSNROptimizer):
    """Adagrad whose step is scaled element-wise by the GSNR ratio ``r``, as VR-SGD's.

    With ``ḡ`` the mean group gradient (shape of ``θ``), ``r ∈ [γ, 1]`` its clipped ratio, ``s``
    the per-element sum of squares (state ``"sum"``, starting at ``initial_accumulator_value``)
    and ``t`` the step count (state ``"step"``), ``placement="update"`` (the default) is::

        g = ḡ + wd·θ                       (torch.optim.Adagrad's L2 weight decay)
        s ← s + g⊙g                        (the unscaled gradient)
        θ ← θ − lr·(r⊙ḡ + wd·θ)/(√s + ε)   (the ratio scales ḡ, never the decay)

    so every element moves by exactly ``r`` times Adagrad's step from the same state (``wd =
    0``); ``γ = 1`` is ``torch.optim.Adagrad`` (``lr_decay = 0``), state keys included.
    ``placement="gradient"`` hands ``u = r⊙ḡ`` to Adagrad (``g = u + wd·θ`` feeds ``s`` and the
    step): the paper's form for Adam, kept for comparison; Adagrad's ``g/√Σg²`` cancels ``r`` on
    an element's first step and any ``r`` that stays constant over steps.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        gamma: float = 0.1,
        placement: str = "update",
        *,
        process_group: dist.ProcessGroup | None = None,
        foreach: bool = True,
    ) -> None:
        _check_common(lr, weight_decay, gamma)
        _check("epsilon value", eps, eps >= 0.0)
        _check(
            "initial_accumulator_value",
            initial_accumulator_value,
            initial_accumulator_value >= 0.0,
        )
        _check_placement(placement)
        defaults = dict(
            lr=lr,
            eps=eps,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            gamma=gamma,
            placement=placement,
        )
        super().__init__(params, defaults, process_group, foreach)

    def _update(self, group, params, means, ratios) -> None:
        sums, steps = [], []
        for p in params:
            state = self.state[p]
            if "sum" not in state:  # torch.optim.Adagrad's state, created on first use
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["sum"] = torch.full_like(
                    p, group["initial_accumulator_value"], memory_format=torch.preserve_format
                )
            sums.append(state["sum"])
            steps.append(state["step"])
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        if group.get("placement", "update") == "gradient" or ratios[0] is None:
            adagrad_update(
                params,
                [_scaled(m, r) for m, r in zip(means, ratios, strict=True)],
                sums,
                steps,
                foreach=self.foreach,
                lr=lr,
                weight_decay=wd,
                lr_decay=0.0,
                eps=eps,
                maximize=False,
            )
            return
        for t in steps:  # on the CPU, as torch.optim.Adagrad keeps it
            t.add_(1)
        if self.foreach:
            grads = torch._foreach_add(means, params, alpha=wd) if wd else means
            torch._foreach_addcmul_(sums, grads, grads)
            std = torch._foreach_sqrt(sums)
            torch._foreach_add_(std, eps)
            steps_scaled = torch._foreach_mul(means, ratios)
            if wd:
                torch._foreach_add_(steps_scaled, params, alpha=wd)
            torch._foreach_addcdiv_(params, steps_scaled, std, value=-lr)
            return
        for p, m, r, s in zip(params, means, ratios, sums, strict=True):
            g = m.add(p, alpha=wd) if wd else m
            s.addcmul_(g, g)
            u = m * r
            if wd:
                u.add_(p, alpha=wd)
            p.addcdiv_(u, s.sqrt().add_(eps), value=-lr)


VR_OPTIMIZERS: dict[str, type[GroupGSNROptimizer]] = {
    "vrsgd": VRSGD,
    "vradam": VRAdam,
    "vrlars": VRLARS,
    "vrlamb": VRLAMB,
    "vradagrad": VRAdagrad,
}
