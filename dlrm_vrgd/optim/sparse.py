"""Row-wise optimizer for embedding tables, one update per global batch (DESIGN.md 4.3).

Group protocol, as for the dense optimizers: after the backward of each group (micro-batch)
call :meth:`SparseRowwiseOptimizer.collect`; it folds the captured per-(row, group) gradients
into per-table accumulators. :meth:`SparseRowwiseOptimizer.step` then forms, for every row
touched in the step, the mean row gradient over the ``k`` groups

    ḡ_row = (1/k) Σ_d g_{d,row}        (g_{d,row} = 0 for groups that did not touch the row)

and hands it to the table's fused kernel (FBGEMM EXACT_ROWWISE_ADAGRAD / EXACT_SGD), which
updates each touched row exactly once. Since every group's loss is the mean over its own ``B``
rows, ``ḡ`` is the gradient of the mean loss over the whole global batch.

With GSNR on, the row's ratio ``r_row ∈ [γ, 1]`` acts in one of two places (``placement``):

* ``"update"`` (the default, DESIGN.md 4.3): the kernel gets the unscaled ``ḡ_row``, so the
  optimizer state accumulates the plain gradient, and the row's step is then scaled: the kernel
  moved the row by its plain step ``Δ_row`` (for row-wise Adagrad ``−lr·ḡ_row/(√s_row + ε)``
  from the row's new state ``s_row``), and ``(r_row − 1)·Δ_row`` is added to it. For row-wise
  Adagrad that is ``s_row += mean_D(ḡ_row²)``, ``w_row −= lr · r_row · ḡ_row / (√s_row + ε)`` —
  every touched row moves by exactly ``r_row`` times its plain step. Cost: a gather of the
  damped rows' states (``O(U)``) and one ``index_add_`` of their weights (``O(U x D)``).
* ``"gradient"`` (the first design, kept for comparison): the kernel gets ``r_row · ḡ_row``.
  Row-wise Adagrad's normalization then largely cancels the ratio (on a row's first update
  ``u / √mean(u²)`` does not depend on ``r``). For EXACT_SGD the two placements are the same.

CowClip (``cowclip``, Zheng et al., arXiv 2204.06240) replaces GSNR by the adaptive column-wise
clip, as its authors' code (bytedance/LargeBatchCTR ``train.py``/``clip.py``) runs it: for every
touched row ``j`` with ``cnt_j`` samples of the step's ``G`` holding its id (all groups, all
ranks), weights ``w_j`` (D-vector) and ``ḡ_j`` the gradient of the *mean* loss over the step's
rows (what the groups' sums give, see above),

    g_j = ḡ_j + 2λ·w_j                        L2 as Keras ``l2(λ)``: ``λ‖w_j‖²`` in the loss
    t_j = r · cnt_j · max(‖w_j‖₂, r·√D·ζ)     their ``clip_id_norm`` with ``min_w = r·√D·ζ``
    g_j ← g_j · min(1, t_j / ‖g_j‖₂)

and the fused kernel then updates the row as usual (:func:`cowclip_rows`). The bound acts on the
mean-loss gradient, with no division by ``G``: their loss is Keras's ``SUM_OVER_BATCH_SIZE``
mean, and so is Algorithm 1's. Where the paper (``max(r·‖w‖, ζ)``) and the code differ, this
follows the code; one departure, for a sparse kernel: the decay reaches the touched rows only
(their dense Keras regularizer decays every row at every step). See docs/cowclip.md.

Memory: an ``int32`` slot per table row (the size of the row-wise Adagrad state), two floats
per row for the EMA estimator, plus the step's sums: ``4·D + 16`` bytes per touched row
(:class:`RowAccumulator`; with CowClip 8 more, its id count). The step's ``rows x D``
temporaries (the blend's ``Δ``, the telemetry's weights before and after, CowClip's gathered
weights) are taken ``chunk_rows`` rows at a time, so they are bounded by the chunk, not by the
touched rows; what else spans the step is ``O(touched rows)`` scalars (ratios, table indices).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

import torch

from dlrm_vrgd.embedding.capture import LookupCapture, RowGrads, RowSpace
from dlrm_vrgd.malloc import released
from dlrm_vrgd.optim.gsnr import (
    normalize_clip,
    raw_gsnr,
    row_moments,
    row_sq_norm,
    rowwise_ratio,
    step_ratio_summary,
)
from dlrm_vrgd.optim.noise_scale import NoisePieces

Estimator = Literal["step", "ema"]
Placement = Literal["update", "gradient"]


logger = logging.getLogger(__name__)


class RowwiseLookup(Protocol):
    """What the optimizer needs from an embedding collection (FBGEMM or torch backend)."""

    capture: LookupCapture

    @property
    def device(self) -> torch.device: ...

    @property
    def table_names(self) -> list[str]: ...

    @property
    def table_rows(self) -> list[int]: ...

    @property
    def kernel(self) -> str:
        """The row-wise update: ``"rowwise_adagrad"`` or ``"sgd"``."""
        ...

    @property
    def eps(self) -> float: ...

    def apply_rows(
        self, rows: list[torch.Tensor], grads: list[torch.Tensor], lr: float, chunk_rows: int
    ) -> None:
        """Update global rows ``rows[s]`` (unique) of row space ``s`` of the lookup's layout by
        ``grads[s]`` through the lookup's row-wise optimizer at learning rate ``lr``."""

    def gather_rows(self, space: int, rows: torch.Tensor) -> torch.Tensor:
        """A copy of the weights of global rows ``rows`` of row space ``space`` (U x D)."""
        ...

    def add_rows(self, space: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``values`` (U x D) to the weights of global rows ``rows`` (unique) of row space
        ``space``."""

    def gather_states(self, space: int, rows: torch.Tensor) -> torch.Tensor | None:
        """A copy of the row-wise Adagrad sums of ``rows`` (U), None for SGD."""
        ...


class RowAccumulator:
    """Sums over one step of one table's per-group row gradients, keyed by row.

    ``grad_sum[i]`` = Σ_d g_{d,row_i} (D-vector), ``sq_sum[i]`` = Σ_d ‖g_{d,row_i}‖²,
    ``n_groups[i]`` = number of groups that touched ``row_i``; ``rows[:size]`` in first-touch order.
    With ``count_ids``, ``counts[i]`` = samples of the step holding ``row_i``'s id (the sum of
    :attr:`RowGrads.counts` over groups, which hold disjoint samples; CowClip's ``cnt``).

    On the CPU the buffers are reserved for every row of the table at once: the operating system
    commits a page only when it is first written, so resident memory follows the rows actually
    touched and never needs a grow-and-copy (whose old and new buffers would both be alive). On a
    GPU, whose allocations are committed in full, they grow geometrically instead.
    """

    def __init__(
        self,
        num_rows: int,
        dim: int,
        device: torch.device | None = None,
        count_ids: bool = False,
    ) -> None:
        self.dim = dim
        self.count_ids = count_ids
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.slot = torch.full((num_rows,), -1, dtype=torch.int32, device=self.device)
        self.size = 0
        self._alloc(num_rows if self.device.type == "cpu" else 0)

    def _alloc(self, capacity: int) -> None:
        self.rows = torch.empty(capacity, dtype=torch.int64, device=self.device)
        self.grad_sum = torch.empty(capacity, self.dim, device=self.device)
        self.sq_sum = torch.empty(capacity, device=self.device)
        self.n_groups = torch.empty(capacity, dtype=torch.int32, device=self.device)
        self.counts = torch.empty(
            capacity if self.count_ids else 0, dtype=torch.int64, device=self.device
        )

    def _bufs(self) -> tuple[torch.Tensor, ...]:
        return (self.rows, self.grad_sum, self.sq_sum, self.n_groups, self.counts)

    def _reserve(self, needed: int) -> None:
        if needed <= self.rows.numel():
            return
        old = self._bufs()
        grown = max(needed, self.rows.numel() * 3 // 2, 1024)
        self._alloc(min(grown, self.slot.numel()))  # never past one slot per table row
        for new, prev in zip(self._bufs(), old, strict=True):
            new[: self.size] = prev[: self.size]

    def add(self, rg: RowGrads) -> None:
        """Fold one call's per-(row, group) gradients (``rg.rows`` sorted) into the sums."""
        if rg.rows.numel() == 0:
            return
        urows, inverse = torch.unique_consecutive(rg.rows, return_inverse=True)
        slots = self.slot[urows].long()
        new = slots < 0
        n_new = int(new.sum())
        if n_new:
            self._reserve(self.size + n_new)
            fresh = torch.arange(self.size, self.size + n_new, device=slots.device)
            slots[new] = fresh
            self.slot[urows[new]] = fresh.to(torch.int32)
            self.rows[self.size : self.size + n_new] = urows[new]
            self.grad_sum[self.size : self.size + n_new].zero_()
            self.sq_sum[self.size : self.size + n_new].zero_()
            self.n_groups[self.size : self.size + n_new].zero_()
            if self.count_ids:
                self.counts[self.size : self.size + n_new].zero_()
            self.size += n_new
        idx = slots[inverse]
        self.grad_sum.index_add_(0, idx, rg.grads)
        self.sq_sum.index_add_(0, idx, row_sq_norm(rg.grads))
        self.n_groups.index_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
        if self.count_ids:
            self.counts.index_add_(0, idx, rg.counts)

    def drain(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(rows, grad_sum, sq_sum, n_groups, counts or None)`` of the step, then reset for
        the next one.

        The returned tensors are views into buffers reused by the next step.
        """
        n = self.size
        rows = self.rows[:n]
        self.slot[rows] = -1
        self.size = 0
        counts = self.counts[:n] if self.count_ids else None
        return rows, self.grad_sum[:n], self.sq_sum[:n], self.n_groups[:n], counts


@dataclass
class RowStep:
    """One step of one table: the touched ``rows`` (U, sorted, table-local), the gradient
    handed to the fused kernel ``update`` (U x D: ``ḡ_row`` under the ``update`` placement,
    ``r_row · ḡ_row`` under ``gradient``), raw GSNR ``raw`` and final ``ratio`` (both U; 1
    without GSNR). The last step's are kept in ``last_rows`` when ``record_rows`` is set, for
    inspection."""

    rows: torch.Tensor
    update: torch.Tensor
    raw: torch.Tensor
    ratio: torch.Tensor


@dataclass(frozen=True)
class CowClip:
    """CowClip's settings (see the module doc): clip ratio ``r``, weight-norm floor ``ζ`` (their
    ``bound``: the floor is ``r·√D·ζ``) and L2 coefficient ``λ`` (the gradient gains
    ``2λ·w``)."""

    clip_ratio: float = 1.0
    zeta: float = 1e-5
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        checks = (
            ("clip_ratio", math.isfinite(self.clip_ratio) and self.clip_ratio > 0),
            ("zeta", math.isfinite(self.zeta) and self.zeta >= 0),
            ("weight_decay", math.isfinite(self.weight_decay) and self.weight_decay >= 0),
        )
        for name, ok in checks:
            if not ok:
                raise ValueError(f"Invalid CowClip {name}: {getattr(self, name)}")


def cowclip_rows(
    mean_grad: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, cc: CowClip
) -> torch.Tensor:
    """CowClip of the touched rows, in place on ``mean_grad`` (U x D, the mean-loss gradient
    ``ḡ``) given their ``weights`` (U x D) and ``counts`` (U, samples holding the id):
    ``g = ḡ + 2λ·w``, then ``g · min(1, t/‖g‖)`` with ``t = r·cnt·max(‖w‖, r·√D·ζ)``. Returns
    the clip factor of each row (U, 1 where the clip is inactive or ``g = 0``)."""
    dim = mean_grad.shape[1]
    if cc.weight_decay:
        mean_grad.add_(weights, alpha=2.0 * cc.weight_decay)
    floor = cc.clip_ratio * math.sqrt(dim) * cc.zeta
    w_norm = torch.linalg.vector_norm(weights, dim=1).clamp_min(floor)
    threshold = cc.clip_ratio * counts.to(mean_grad.dtype) * w_norm
    g_norm = torch.linalg.vector_norm(mean_grad, dim=1)
    factor = torch.where(
        g_norm > threshold, threshold / g_norm.clamp_min(torch.finfo(g_norm.dtype).tiny), 1.0
    )
    clipped = factor < 1.0
    if bool(clipped.any()):
        mean_grad[clipped] *= factor[clipped, None]
    return factor


def plain_step(
    kernel: str, lr: float, eps: float, grad: torch.Tensor, state: torch.Tensor | None
) -> torch.Tensor:
    """``Δw_row`` (U x D) of the fused kernel's plain update of each row by ``grad`` (U x D),
    given the row state *after* the update (U, the Adagrad sums including ``mean_D g²``):
    row-wise Adagrad ``−lr·g/(√s + ε)``, SGD ``−lr·g`` (the kernels' own rules, see
    :mod:`dlrm_vrgd.torch_model`)."""
    if kernel == "sgd" or state is None:
        return grad * -lr
    return grad * (-lr / (state.sqrt() + eps))[:, None]


def plain_step_norm(
    kernel: str, lr: float, eps: float, grad: torch.Tensor, state: torch.Tensor | None
) -> torch.Tensor:
    """``‖Δw_row‖`` of the fused kernel's plain update of each row by ``grad`` (U x D) from row
    state ``state`` (U, the Adagrad sums *before* the step): row-wise Adagrad
    ``lr·‖g‖/(√(s + mean_D g²) + ε)``, SGD ``lr·‖g‖``."""
    after = None if state is None else state + grad.square().mean(dim=1)
    return torch.linalg.vector_norm(plain_step(kernel, lr, eps, grad, after), dim=1)


def add_table_sums(
    noise_sums: torch.Tensor,
    tables: tuple[int, ...],
    table_ix: torch.Tensor,
    grad_sum: torch.Tensor,
    sq_sum: torch.Tensor,
) -> None:
    """The noise scale's two sums per table (DESIGN.md 4.6) over one row space's touched rows:
    adds ``Σ_rows ‖Σ_d g_{d,row}‖²`` and ``Σ_rows Σ_d ‖g_{d,row}‖²`` of the rows of
    ``tables[i]`` (``table_ix``: i of each row; ``grad_sum`` U x D, ``sq_sum`` U) to
    ``noise_sums[0 | 1, tables[i]]``."""
    at = torch.tensor(tables, device=noise_sums.device)
    for i, per_row in enumerate((row_sq_norm(grad_sum), sq_sum)):
        per_space = torch.zeros(len(tables), dtype=torch.float64, device=grad_sum.device)
        per_space.index_add_(0, table_ix, per_row.double())
        noise_sums[i].index_add_(0, at, per_space.to(noise_sums.device))


def _chunks(n: int, size: int) -> list[slice]:
    """``[0, n)`` as consecutive slices of at most ``size``."""
    return [slice(start, start + size) for start in range(0, n, size)]


class SparseRowwiseOptimizer:
    """One row-wise update of every touched embedding row per global step, optionally scaled by
    the row's gradient signal-to-noise ratio (DESIGN.md 4.3).

    With ``gsnr=True`` every touched row's ratio ``r_row`` (:func:`~dlrm_vrgd.optim.gsnr.
    rowwise_ratio`: normalized over the table's touched rows and clipped to ``[γ, 1]``) scales
    the row's step (``placement="update"``: the row moves by exactly ``r_row`` times the fused
    kernel's plain step, whose state sees the unscaled ``ḡ_row``) or the gradient handed to the
    kernel (``placement="gradient"``; see the module doc). Two estimators of the raw ratio
    ``‖ḡ‖² / σ²``:

    * ``"step"``: this step's groups only. A row touched by one group has raw ratio ``1/(k−1)``.
    * ``"ema"``: per-row exponential averages (factor ``ema_beta``) of the two row scalars
      ``‖ḡ_row‖²`` and ``(1/k) Σ_d ‖g_{d,row}‖²``, updated whenever the row is touched
      (initialized to the first observation); ``σ² = EMA(second) − EMA(signal)``. Two floats per
      table row of state, so rare rows are judged on more than one step.

    Args:
        lookups: embedding collections whose lookups are captured (:class:`RowwiseLookup`).
        lr: learning rate handed to the fused kernel (``param_groups[0]["lr"]``, so schedules
            set it like a ``torch.optim`` optimizer's).
        gsnr: scale each row's step by its ratio; ``gamma``: lower clip (1 = no damping).
        placement: ``"update"`` or ``"gradient"`` (see above).
        estimator, ema_beta: see above.
        chunk_rows: rows per replay call of the fused kernel.
        cowclip: clip each touched row's gradient by CowClip (:class:`CowClip`) instead of
            GSNR (not with ``gsnr``); the clip factor's telemetry is ``cowclip_clipped`` (the
            fraction of touched rows clipped) and ``cowclip_factor`` (their mean factor).
        groups_per_collect: groups contributed by one :meth:`collect` (1 on one process; the
            number of source ranks when a sharded table's owner receives every rank's bags).
    """

    def __init__(
        self,
        lookups: list[RowwiseLookup],
        lr: float,
        *,
        gsnr: bool = False,
        gamma: float = 0.1,
        placement: Placement = "update",
        estimator: Estimator = "step",
        ema_beta: float = 0.9,
        chunk_rows: int = 65_536,
        cowclip: CowClip | None = None,
        groups_per_collect: int = 1,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"Invalid gamma: {gamma} (must be in (0, 1])")
        if placement not in ("update", "gradient"):
            raise ValueError(f"Invalid placement: {placement!r} (update or gradient)")
        if estimator not in ("step", "ema"):
            raise ValueError(f"Invalid estimator: {estimator!r} (step or ema)")
        if not 0.0 <= ema_beta < 1.0:
            raise ValueError(f"Invalid ema_beta: {ema_beta}")
        if chunk_rows <= 0:
            raise ValueError(f"Invalid chunk_rows: {chunk_rows}")
        if cowclip is not None and gsnr:
            raise ValueError("CowClip and GSNR scaling are alternatives: pass one of them")
        self.lookups = list(lookups)
        self.param_groups: list[dict[str, Any]] = [{"lr": lr, "initial_lr": lr}]
        self.gsnr = gsnr
        self.gamma = gamma
        self.placement: Placement = placement
        self.estimator: Estimator = estimator
        self.ema_beta = ema_beta
        self.chunk_rows = chunk_rows
        self.cowclip = cowclip
        self.groups_per_collect = groups_per_collect
        self.record_rows = False
        #: Measure the realised step ratio ‖actual step‖ / ‖plain step‖ per row in the next
        #: step (off by default: the trainer sets it on the steps whose GSNR it records).
        self.measure_steps = False
        self.last_rows: list[list[RowStep]] = []
        self.k = 0
        # per lookup, per row space (tables sharing a dim): the step's sums
        self._acc = [
            [
                RowAccumulator(sp.size, sp.dim, lk.device, count_ids=cowclip is not None)
                for sp in lk.capture.layout.spaces
            ]
            for lk in self.lookups
        ]
        # per lookup, per row space: (EMA of ‖ḡ_row‖², EMA of mean ‖g_d,row‖²); O(rows) floats
        self._ema: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        if gsnr and estimator == "ema":
            self._ema = [
                [
                    (torch.zeros(sp.size, device=lk.device), torch.zeros(sp.size, device=lk.device))
                    for sp in lk.capture.layout.spaces
                ]
                for lk in self.lookups
            ]
        self._last_summary: list[dict[str, Any]] = []
        self._noise: NoisePieces | None = None
        #: Sum the gradient noise scale's per-table pieces (off: :meth:`noise_pieces` is None).
        self.track_noise = True

    def collect(self) -> None:
        """Fold the row gradients captured since the last call in as one more group."""
        for lookup, accs in zip(self.lookups, self._acc, strict=True):
            for call in lookup.capture.take():
                for acc, rg in zip(accs, call, strict=True):
                    acc.add(rg)
        self.k += self.groups_per_collect

    def _smoothed(
        self, li: int, s: int, rows: torch.Tensor, signal: torch.Tensor, second: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The EMA estimator: fold this step's row scalars into the per-row averages (the first
        observation initializes them) and take the raw ratio of the averages."""
        ema_signal, ema_second = self._ema[li][s]
        old_s, old_q = ema_signal[rows], ema_second[rows]
        fresh = old_q <= 0
        b = self.ema_beta
        signal = torch.where(fresh, signal, b * old_s + (1 - b) * signal)
        second = torch.where(fresh, second, b * old_q + (1 - b) * second)
        ema_signal[rows] = signal
        ema_second[rows] = second
        return raw_gsnr(signal, second)

    @torch.no_grad()
    def step(self) -> None:
        """Apply the (GSNR-scaled) mean row gradient of the collected groups, then reset."""
        if self.k == 0:
            logger.warning("SparseRowwiseOptimizer.step() without collect(): nothing to apply")
            return
        lr = float(self.param_groups[0]["lr"])
        summary: list[dict[str, Any]] = []
        recorded: list[list[RowStep]] = []
        noise_names: list[str] = []
        noise_sums: list[torch.Tensor] = []
        for li, (lookup, accs) in enumerate(zip(self.lookups, self._acc, strict=True)):
            layout = lookup.capture.layout
            per_table: list[RowStep | None] = [None] * len(layout.table_dims)
            entries: list[dict[str, Any]] = [{} for _ in layout.table_dims]
            # per table: |Σ_d g_d|² and Σ_d |g_d|² over its touched rows (the noise scale's)
            sums = torch.zeros(2, len(layout.table_dims), dtype=torch.float64, device=lookup.device)
            rows, updates, ratios = [], [], []
            for s, (space, acc) in enumerate(zip(layout.spaces, accs, strict=True)):
                r, u, ratio = self._step_space(li, lookup, s, space, acc, per_table, entries, sums)
                rows.append(r)
                updates.append(u)
                ratios.append(ratio)
            self._apply(lookup, rows, updates, ratios, lr, entries)
            for name, entry in zip(lookup.table_names, entries, strict=True):
                summary.append({"table": name, **entry})
            recorded.append(per_table)  # type: ignore[arg-type]
            noise_names += lookup.table_names
            noise_sums.append(sums.cpu())
        self._last_summary = summary
        self.last_rows = recorded if self.record_rows else []
        both = torch.cat(noise_sums, dim=1) if noise_sums else torch.zeros(2, 0)
        self._noise = (
            NoisePieces.of(noise_names, both[0], both[1], self.k) if self.track_noise else None
        )
        self.k = 0

    def noise_pieces(self) -> NoisePieces | None:
        """Per table, ``|ḡ|²`` and ``mean_d |g_d|²`` over the last step's touched rows
        (DESIGN.md 4.6; None before the first step)."""
        return self._noise

    def _apply(
        self,
        lookup: RowwiseLookup,
        rows: list[torch.Tensor],
        updates: list[torch.Tensor],
        ratios: list[torch.Tensor],
        lr: float,
        entries: list[dict[str, Any]],
    ) -> None:
        """Run the fused kernel on every row space's rows and, under the ``update`` placement,
        scale each damped row's step by its ratio: the kernel moves the row by its plain step
        ``Δ`` (:func:`plain_step`, from the row's state after the kernel), and ``(r_row − 1)·Δ``
        is then added, so the row ends at ``w_before + r_row·Δ`` (rows at ratio 1 keep the
        kernel's result bit for bit). With ``measure_steps``, adds the realised step ratio of
        every table to ``entries``: ``‖w_after − w_before‖``, read from the weights, over the
        plain step's norm.

        Rows are independent, so blending and measuring go ``chunk_rows`` rows at a time: the
        ``U x D`` temporaries (weights before, ``Δ``, weights after) are ``chunk_rows x D``
        each, whatever the number of touched rows ``U``; only ``O(U)`` scalars (the per-row
        step norms) span the step."""
        blend = self.gsnr and self.placement == "update" and self.gamma < 1.0
        measure = self.gsnr and self.measure_steps
        if not (blend or measure):
            with torch.enable_grad():
                lookup.apply_rows(rows, updates, lr, self.chunk_rows)
            return
        layout = lookup.capture.layout
        for s, (space, r, ratio) in enumerate(zip(layout.spaces, rows, ratios, strict=True)):
            actual, plain = [], []
            for part in released(_chunks(r.numel(), self.chunk_rows)):
                a, p = self._apply_chunk(
                    lookup, s, r[part], updates[s][part], ratio[part], lr, blend, measure
                )
                actual.append(a)
                plain.append(p)
            if not measure:
                continue
            empty = torch.zeros(0, device=r.device)
            actual_all = torch.cat(actual) if actual else empty
            plain_all = torch.cat(plain) if plain else empty
            table_ix = space.table_index(r)
            for i, t in enumerate(space.tables):
                sel = table_ix == i
                entries[t].update(step_ratio_summary(actual_all[sel], plain_all[sel]))

    def _apply_chunk(
        self,
        lookup: RowwiseLookup,
        s: int,
        r: torch.Tensor,
        update: torch.Tensor,
        ratio: torch.Tensor,
        lr: float,
        blend: bool,
        measure: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """:meth:`_apply` on rows ``r`` (C, unique) of row space ``s`` alone: the kernel, the
        blend, and with ``measure`` the rows' ``(‖actual step‖, ‖plain step‖)`` (C each)."""
        before = lookup.gather_rows(s, r) if measure else None
        state_before = lookup.gather_states(s, r) if measure and not blend else None
        spaces = lookup.capture.layout.spaces
        only_rows = [r if i == s else r.new_zeros(0) for i in range(len(spaces))]
        only_grads = [
            update if i == s else update.new_zeros(0, sp.dim) for i, sp in enumerate(spaces)
        ]
        with torch.enable_grad():
            lookup.apply_rows(only_rows, only_grads, lr, self.chunk_rows)
        plain = None
        if blend:  # the kernel moved the rows by Δ; add (r_row − 1)·Δ
            # to the damped rows (to every touched row when measuring: + 0 at ratio 1)
            grad, idx, r_rows = update, r, ratio
            if not measure:
                k = (ratio < 1.0).nonzero().squeeze(1)
                grad, idx, r_rows = grad[k], r[k], ratio[k]
            state = lookup.gather_states(s, idx)  # after the kernel
            delta = plain_step(lookup.kernel, lr, lookup.eps, grad, state)
            if measure:
                plain = torch.linalg.vector_norm(delta, dim=1)
            lookup.add_rows(s, idx, delta.mul_((r_rows - 1.0)[:, None]))
            del delta
        if not measure:
            return None, None
        assert before is not None
        actual = torch.linalg.vector_norm(lookup.gather_rows(s, r).sub_(before), dim=1)
        if not blend:
            mean = update / ratio[:, None]  # the unscaled ḡ_row (ratio >= γ > 0)
            plain = plain_step_norm(lookup.kernel, lr, lookup.eps, mean, state_before)
        return actual, plain

    def _step_space(
        self,
        li: int,
        lookup: RowwiseLookup,
        s: int,
        space: RowSpace,
        acc: RowAccumulator,
        per_table: list[RowStep | None],
        entries: list[dict[str, Any]],
        noise_sums: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ratio and kernel input of every touched row of one row space — ``ḡ_row`` (``update``
        placement, or no GSNR) or ``r_row · ḡ_row`` (``gradient``) — computed in place in the
        accumulator's buffer (no copy of the ``U x D`` sums): returns ``(global rows, kernel
        input, ratio)`` and fills the per-table telemetry (and, with ``record_rows``, the
        per-table :class:`RowStep`). With CowClip the kernel input is the clipped
        ``ḡ_row + 2λ·w_row``. Adds each table's ``|Σ_d g_d|²`` and ``Σ_d |g_d|²`` over its
        touched rows to ``noise_sums`` (2 x tables of the lookup)."""
        k = self.k
        rows, grad_sum, sq_sum, n_groups, id_counts = acc.drain()
        table_ix = space.table_index(rows)
        n_tables = len(space.tables)
        if self.track_noise:
            add_table_sums(noise_sums, space.tables, table_ix, grad_sum, sq_sum)
        raw = ratio = torch.ones(rows.numel(), device=grad_sum.device)
        stats: list[dict[str, float]] = [{} for _ in space.tables]
        if self.gsnr:
            if self.estimator == "step":
                ratio, seg = rowwise_ratio(grad_sum, sq_sum, k, self.gamma, table_ix, n_tables)
                if self.record_rows and k >= 2:
                    raw, _ = raw_gsnr(*row_moments(grad_sum, sq_sum, k))
            else:
                degenerate = torch.ones(rows.numel(), dtype=torch.bool, device=raw.device)
                if k >= 2:
                    raw, degenerate = self._smoothed(li, s, rows, *row_moments(grad_sum, sq_sum, k))
                ratio, seg = normalize_clip(raw, degenerate, self.gamma, table_ix, n_tables)
            stats = seg.as_dicts()
        if self.gsnr and self.placement == "gradient":
            update = grad_sum.mul_((ratio / k)[:, None])  # r_row · ḡ_row, in place
        else:
            update = grad_sum.div_(k)  # ḡ_row, in place
        clipped = torch.zeros(n_tables, dtype=torch.float64)
        factor_sum = torch.zeros(n_tables, dtype=torch.float64)
        if self.cowclip is not None and rows.numel():
            assert id_counts is not None
            # a chunk at a time: the touched rows' weights are gathered chunk_rows x D at once
            factor = torch.cat(
                [
                    cowclip_rows(
                        update[c],
                        lookup.gather_rows(s, rows[c]),
                        id_counts[c],
                        self.cowclip,
                    )
                    for c in released(_chunks(rows.numel(), self.chunk_rows))
                ]
            )
            clipped.index_add_(0, table_ix.cpu(), (factor < 1.0).double().cpu())
            factor_sum.index_add_(0, table_ix.cpu(), factor.double().cpu())
        counts = torch.bincount(table_ix, minlength=n_tables).tolist()
        multi = torch.zeros(n_tables, dtype=torch.int64, device=rows.device)
        multi.index_add_(0, table_ix, (n_groups >= 2).to(torch.int64))
        for i, t in enumerate(space.tables):
            entries[t] = {"touched_rows": counts[i], "multi_group_rows": int(multi[i]), **stats[i]}
            if self.gsnr:
                entries[t]["placement"] = self.placement
            if self.cowclip is not None:
                n = counts[i]
                entries[t]["cowclip_clipped"] = float(clipped[i]) / n if n else 0.0
                entries[t]["cowclip_factor"] = float(factor_sum[i]) / n if n else 1.0
        if self.record_rows:
            order = torch.argsort(rows)
            starts = torch.tensor(space.offsets[:-1], dtype=torch.int64, device=rows.device)
            local = (rows - starts[table_ix])[order]
            parts = zip(
                space.tables,
                local.split(counts),
                update[order].split(counts),
                raw[order].split(counts),
                ratio[order].split(counts),
                strict=True,
            )
            for t, r, u, rw, rt in parts:
                per_table[t] = RowStep(r, u, rw, rt)
        return rows, update, ratio

    def summary(self) -> list[dict[str, Any]]:
        """Per-table figures of the last step: touched rows, rows seen in >= 2 groups and, with
        GSNR, mean raw GSNR, mean clipped ratio, fraction clipped at γ, fraction degenerate, the
        placement and (on measured steps) the realised step ratio ``‖actual step‖ / ‖plain
        step from the same state‖`` over touched rows (``step_ratio_mean``,
        ``step_ratio_p10``)."""
        return self._last_summary

    def state_dict(self) -> dict[str, Any]:
        return {
            "param_groups": [dict(g) for g in self.param_groups],
            "estimator": self.estimator if self.gsnr else None,
            "placement": self.placement if self.gsnr else None,
            "cowclip": asdict(self.cowclip) if self.cowclip is not None else None,
            "ema": [[(s.clone(), q.clone()) for s, q in tables] for tables in self._ema],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the LR and the EMA state; CowClip keeps no state of its own (its counts are
        the step's own ids, and its row norms are the table's weights)."""
        self.param_groups = [dict(g) for g in state["param_groups"]]
        ema = state.get("ema", [])
        if self._ema and not ema:
            raise ValueError("the saved sparse optimizer has no EMA state to resume from")
        for tables, saved in zip(self._ema, ema, strict=True):
            for (s, q), (s0, q0) in zip(tables, saved, strict=True):
                s.copy_(s0)
                q.copy_(q0)
