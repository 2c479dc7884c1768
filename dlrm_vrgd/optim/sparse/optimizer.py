"""Row-wise optimizer for embedding tables, one update per global batch (DESIGN.md 4.3).

Group protocol, as for the dense optimizers: after the backward of each group (micro-batch)
call :meth:`SparseRowwiseOptimizer.collect`; it takes the captured per-(row, group) gradients
(:mod:`dlrm_vrgd.optim.sparse.accumulate`). :meth:`SparseRowwiseOptimizer.step` then forms, for
every row touched in the step, the mean row gradient over the ``k`` groups

    ḡ_row = (1/k) Σ_d g_{d,row}        (g_{d,row} = 0 for groups that did not touch the row)

Since every group's loss is the mean over its own ``B`` rows, ``ḡ`` is the gradient of the mean
loss over the whole global batch. Every table of one embedding dim is one *row space*, read and
written through a flat view of the lookup's own buffers
(:class:`~dlrm_vrgd.embedding.views.RowSpaceView`): a step costs a few ops per row space, not per
table, and reads nothing back to the host (the per-table figures are reduced on the device and
copied once, :mod:`dlrm_vrgd.optim.sparse.telemetry`).

Two routes update the rows:

* **GSNR** (``gsnr`` with ``γ < 1``): the row's ratio ``r_row ∈ [γ, 1]`` scales its step, in
  one pass of index ops per row space (:func:`~dlrm_vrgd.optim.sparse.rowwise.scaled_rowwise_step`,
  the normative update of DESIGN.md 4.3): under ``placement="update"`` (the default) the state
  sees ``ḡ_row`` and the row moves by exactly ``r_row`` times its plain step, under
  ``"gradient"`` the kernel's rule is applied to ``r_row · ḡ_row``. With ``measure_steps`` the same
  pass also reads the realised step ratio (no second update).
* **Plain** (no GSNR, ``γ = 1``, or CowClip): the mean gradients go to the lookup's own fused
  kernel (FBGEMM's EXACT_ROWWISE_ADAGRAD / EXACT_SGD, replayed on the touched rows:
  :meth:`~dlrm_vrgd.embedding.fbgemm.TBELookup.apply_rows`), so that ``γ = 1`` is FBGEMM's own
  update of the global batch, bit for bit.

CowClip (``cowclip``, Zheng et al., arXiv 2204.06240) replaces GSNR by the adaptive column-wise
clip, as its authors' code (bytedance/LargeBatchCTR ``train.py``/``clip.py``) runs it: for every
touched row ``j`` with ``cnt_j`` samples of the step's ``G`` holding its id (all groups, all
ranks), weights ``w_j`` (D-vector) and ``ḡ_j`` the gradient of the *mean* loss over the step's
rows (what the groups' sums give, see above),

    g_j = ḡ_j + 2λ·w_j                        L2 as Keras ``l2(λ)``: ``λ‖w_j‖²`` in the loss
    t_j = r · cnt_j · max(‖w_j‖₂, r·√D·ζ)     their ``clip_id_norm`` with ``min_w = r·√D·ζ``
    g_j ← g_j · min(1, t_j / ‖g_j‖₂)

and the fused kernel then updates the row as usual (:func:`~dlrm_vrgd.optim.sparse.cowclip.
cowclip_rows`). The bound acts on the mean-loss gradient, with no division by ``G``: their loss is
Keras's ``SUM_OVER_BATCH_SIZE`` mean, and so is Algorithm 1's. Where the paper
(``max(r·‖w‖, ζ)``) and the code differ, this follows the code; one departure, for a sparse
kernel: the decay reaches the touched rows only (their dense Keras regularizer decays every row
at every step). See docs/cowclip.md.

Memory: an ``int32`` slot per table row on the CPU (the size of the row-wise Adagrad state), two
floats per row for the EMA estimator, plus the step's sums: ``4·D + 16`` bytes per touched row
(:class:`~dlrm_vrgd.optim.sparse.accumulate.RowAccumulator`; with CowClip 8 more, its id count).
The step's ``rows x D`` temporaries are taken ``chunk_rows`` rows at a time on the CPU, so they are
bounded by the chunk, not by the touched rows; on a GPU a chunk is at least
:data:`DEVICE_CHUNK_BYTES` of them (one chunk at every size this project trains).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from dlrm_vrgd.embedding.capture import LookupCapture
from dlrm_vrgd.embedding.views import RowSpaceView
from dlrm_vrgd.malloc import released
from dlrm_vrgd.optim.gsnr import normalize_clip, raw_gsnr, row_moments, row_sq_norm, rowwise_ratio
from dlrm_vrgd.optim.noise_scale import NoisePieces
from dlrm_vrgd.optim.sparse.accumulate import GroupRows, RowAccumulator, StepRows
from dlrm_vrgd.optim.sparse.cowclip import CowClip, cowclip_rows
from dlrm_vrgd.optim.sparse.rowwise import plain_step_norm, scaled_rowwise_step
from dlrm_vrgd.optim.sparse.telemetry import TableFigures, step_ratio_stats

Estimator = Literal["step", "ema"]
Placement = Literal["update", "gradient"]
Accumulate = Literal["auto", "slot", "merge"]

#: On a GPU a chunk of the step holds at least this many bytes of each ``rows x D`` temporary.
DEVICE_CHUNK_BYTES = 1 << 30

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

    def space_views(self) -> list[RowSpaceView]:
        """One :class:`RowSpaceView` per row space of the lookup's layout."""
        ...

    def apply_rows(
        self, rows: list[Tensor], grads: list[Tensor], lr: float, chunk_rows: int
    ) -> None:
        """Update global rows ``rows[s]`` (unique) of row space ``s`` of the lookup's layout by
        ``grads[s]`` through the lookup's fused row-wise kernel at learning rate ``lr``."""


@dataclass
class RowStep:
    """One step of one table (kept with ``record_rows``, for inspection): the touched ``rows``
    (U, sorted, table-local), the gradient the row-wise rule was applied to ``update`` (U x D:
    ``ḡ_row`` under the ``update`` placement, ``r_row · ḡ_row`` under ``gradient``; CowClip's
    clipped one), raw GSNR ``raw`` and final ``ratio`` (both U; 1 without GSNR)."""

    rows: Tensor
    update: Tensor
    raw: Tensor
    ratio: Tensor


def add_table_sums(noise_sums: Tensor, tables: Tensor, grad_sum: Tensor, sq_sum: Tensor) -> None:
    """The noise scale's two sums per table (DESIGN.md 4.6) over touched rows: adds
    ``Σ_rows ‖Σ_d g_{d,row}‖²`` and ``Σ_rows Σ_d ‖g_{d,row}‖²`` of each row (``tables``: its
    table; ``grad_sum`` U x D, ``sq_sum`` U) to ``noise_sums[0 | 1, table]`` (float64)."""
    noise_sums[0].index_add_(0, tables, row_sq_norm(grad_sum).double())
    noise_sums[1].index_add_(0, tables, sq_sum.double())


def _chunks(n: int, size: int) -> list[slice]:
    """``[0, n)`` as consecutive slices of at most ``size``."""
    return [slice(start, start + size) for start in range(0, n, size)]


class SparseRowwiseOptimizer:
    """One row-wise update of every touched embedding row per global step, optionally scaled by
    the row's gradient signal-to-noise ratio (DESIGN.md 4.3; see the module doc).

    With ``gsnr=True`` every touched row's ratio ``r_row`` (:func:`~dlrm_vrgd.optim.gsnr.
    rowwise_ratio`: normalized over the table's touched rows and clipped to ``[γ, 1]``) scales
    the row's step (``placement="update"``) or the gradient the row-wise rule is applied to
    (``placement="gradient"``). Two estimators of the raw ratio ``‖ḡ‖² / σ²``:

    * ``"step"``: this step's groups only. A row touched by one group has raw ratio ``1/(k−1)``.
    * ``"ema"``: per-row exponential averages (factor ``ema_beta``) of the two row scalars
      ``‖ḡ_row‖²`` and ``(1/k) Σ_d ‖g_{d,row}‖²``, updated whenever the row is touched
      (initialized to the first observation); ``σ² = EMA(second) − EMA(signal)``. Two floats per
      table row of state, so rare rows are judged on more than one step.

    Args:
        lookups: embedding collections whose lookups are captured (:class:`RowwiseLookup`).
        lr: learning rate (``param_groups[0]["lr"]``, so schedules set it like a ``torch.optim``
            optimizer's).
        gsnr: scale each row's step by its ratio; ``gamma``: lower clip (1 = no damping).
        placement: ``"update"`` or ``"gradient"`` (see above).
        estimator, ema_beta: see above.
        chunk_rows: touched rows per chunk of the step's ``rows x D`` temporaries on a CPU (and
            per replay call of the fused kernel); on a GPU a chunk is at least
            :data:`DEVICE_CHUNK_BYTES` of them.
        cowclip: clip each touched row's gradient by CowClip (:class:`CowClip`) instead of
            GSNR (not with ``gsnr``); the clip factor's telemetry is ``cowclip_clipped`` (the
            fraction of touched rows clipped) and ``cowclip_factor`` (their mean factor).
        groups_per_collect: groups contributed by one :meth:`collect` (1 on one process; the
            number of source ranks when a sharded table's owner receives every rank's bags).
        accumulate: how the groups' row gradients are summed
            (:mod:`~dlrm_vrgd.optim.sparse.accumulate`): ``"slot"`` folds each group in as it
            comes (memory: the touched rows), ``"merge"`` keeps the groups and merges them at
            the step (no read-back to the host); ``"auto"``: slot on a CPU, merge elsewhere.
        seed: salts the stochastic rounding of float16 tables' writes, with the step's number
            (:func:`~dlrm_vrgd.embedding.views.stochastic_round`).
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
        accumulate: Accumulate = "auto",
        seed: int = 0,
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
        if accumulate not in ("auto", "slot", "merge"):
            raise ValueError(f"Invalid accumulate: {accumulate!r} (auto, slot or merge)")
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
        self.seed = seed
        #: Steps applied so far (with ``seed``, the salt of this step's rounding draws).
        self.updates = 0
        self.record_rows = False
        #: Measure the realised step ratio ‖actual step‖ / ‖plain step‖ per row in the next
        #: step (off by default: the trainer sets it on the steps whose GSNR it records).
        self.measure_steps = False
        self.last_rows: list[list[RowStep]] = []
        self.k = 0
        count_ids = cowclip is not None
        for lk in self.lookups:  # CowClip's sample counts cost a bincount per call: only for it
            lk.capture.count_ids = count_ids
        # per lookup, per row space (tables sharing a dim): the step's sums
        self._acc: list[list[RowAccumulator | GroupRows]] = []
        for lk in self.lookups:
            merge = accumulate == "merge" or (accumulate == "auto" and lk.device.type != "cpu")
            lk.capture.static_size = merge  # a collect then reads nothing back
            self._acc.append(
                [
                    GroupRows(sp.dim, lk.device, count_ids)
                    if merge
                    else RowAccumulator(sp.size, sp.dim, lk.device, count_ids)
                    for sp in lk.capture.layout.spaces
                ]
            )
        # per lookup, per row space: the lookup-level table id of each of the space's tables
        self._space_tables = [
            [torch.tensor(sp.tables, device=lk.device) for sp in lk.capture.layout.spaces]
            for lk in self.lookups
        ]
        # per lookup, per row space: (EMA of ‖ḡ_row‖², EMA of mean ‖g_d,row‖²); O(rows) floats
        self._ema: list[list[tuple[Tensor, Tensor]]] = []
        if gsnr and estimator == "ema":
            self._ema = [
                [
                    (torch.zeros(sp.size, device=lk.device), torch.zeros(sp.size, device=lk.device))
                    for sp in lk.capture.layout.spaces
                ]
                for lk in self.lookups
            ]
        self._figures: list[TableFigures] = []
        self._noise: NoisePieces | None = None
        #: Sum the gradient noise scale's per-table pieces (off: :meth:`noise_pieces` is None).
        self.track_noise = True

    @property
    def direct(self) -> bool:
        """Whether the step scales rows (the GSNR route) rather than replaying the kernel."""
        return self.gsnr and self.gamma < 1.0

    def collect(self) -> None:
        """Fold the row gradients captured since the last call in as one more group."""
        for lookup, accs in zip(self.lookups, self._acc, strict=True):
            for acc in accs:  # the last collect's padded groups, cut to their pairs
                acc.settle()
            for call in lookup.capture.take():
                for acc, rg in zip(accs, call, strict=True):
                    acc.add(rg)
        self.k += self.groups_per_collect

    def _chunk_rows(self, device: torch.device, dim: int) -> int:
        if device.type == "cpu":
            return self.chunk_rows
        return max(self.chunk_rows, DEVICE_CHUNK_BYTES // (4 * dim))

    def _pieces(self, device: torch.device, n: int, size: int) -> Iterator[slice]:
        """The chunks of ``n`` rows; on a CPU, glibc's free pages go back between them."""
        chunks = _chunks(n, size)
        return iter(released(chunks)) if device.type == "cpu" else iter(chunks)

    @torch.no_grad()
    def step(self) -> None:
        """Apply the (GSNR-scaled) mean row gradient of the collected groups, then reset."""
        if self.k == 0:
            logger.warning("SparseRowwiseOptimizer.step() without collect(): nothing to apply")
            return
        lr = float(self.param_groups[0]["lr"])
        figures: list[TableFigures] = []
        recorded: list[list[RowStep]] = []
        noise_names: list[str] = []
        noise_sums: list[Tensor] = []
        for li, (lookup, accs) in enumerate(zip(self.lookups, self._acc, strict=True)):
            layout = lookup.capture.layout
            n_tables = len(layout.table_dims)
            views = lookup.space_views()
            for s, view in enumerate(views):  # this step's rounding draws (float16 tables)
                view.salt = hash((self.seed, self.updates, li, s)) & ((1 << 62) - 1)
            fig = TableFigures(lookup.table_names, lookup.device)
            if self.gsnr:
                fig.constants["placement"] = self.placement
            per_table: list[RowStep | None] = [None] * n_tables
            # per table: |Σ_d g_d|² and Σ_d |g_d|² over its touched rows (the noise scale's)
            sums = torch.zeros(2, n_tables, dtype=torch.float64, device=lookup.device)
            plain_rows: list[Tensor] = []
            plain_grads: list[Tensor] = []
            for s, (acc, view) in enumerate(zip(accs, views, strict=True)):
                rows, update = self._step_space(
                    li, lookup, s, view, acc.drain(), lr, fig, sums, per_table
                )
                plain_rows.append(rows)
                plain_grads.append(update)
            if not self.direct and not (self.gsnr and self.measure_steps):
                with torch.enable_grad():  # the replay's backward runs the fused kernel
                    lookup.apply_rows(plain_rows, plain_grads, lr, self.chunk_rows)
            if self.cowclip is not None:  # sums over each table's rows -> means
                n = fig.column("touched_rows")
                fig.columns["cowclip_clipped"] = fig.column("cowclip_clipped") / n.clamp_min(1)
                fig.columns["cowclip_factor"] = torch.where(
                    n > 0, fig.column("cowclip_factor") / n.clamp_min(1), 1.0
                )
            fig.finish()
            figures.append(fig)
            recorded.append(per_table)  # type: ignore[arg-type]
            noise_names += lookup.table_names
            noise_sums.append(sums)
        self._figures = figures
        self.last_rows = recorded if self.record_rows else []
        if self.track_noise and noise_sums:
            both = torch.cat([s.to(noise_sums[0].device) for s in noise_sums], dim=1)
            self._noise = NoisePieces.of(noise_names, both[0], both[1], self.k)
        else:
            self._noise = None
        self.k = 0
        self.updates += 1

    def noise_pieces(self) -> NoisePieces | None:
        """Per table, ``|ḡ|²`` and ``mean_d |g_d|²`` over the last step's touched rows
        (DESIGN.md 4.6; None before the first step). On the lookups' device."""
        return self._noise

    def _ratio(
        self, li: int, s: int, view: RowSpaceView, sr: StepRows, fig: TableFigures
    ) -> tuple[Tensor, Tensor | None]:
        """Every touched row's ratio and, with ``record_rows``, its raw GSNR (step estimator:
        computed from the sums; EMA: from the per-row averages, which it updates). Writes the
        space's tables' GSNR figures into ``fig``."""
        k, n = self.k, len(view.space.tables)
        local = view.table_index(sr.rows)
        raw = None
        if self.estimator == "step":
            ratio, stats = rowwise_ratio(sr.grad_sum, sr.sq_sum, k, self.gamma, local, n)
            if self.record_rows and k >= 2:
                raw, _ = raw_gsnr(*row_moments(sr.grad_sum, sr.sq_sum, k))
        else:
            degenerate = torch.ones(sr.rows.numel(), dtype=torch.bool, device=sr.rows.device)
            raw = torch.ones(sr.rows.numel(), device=sr.rows.device)
            if k >= 2:
                raw, degenerate = self._smoothed(
                    li, s, sr.rows, *row_moments(sr.grad_sum, sr.sq_sum, k)
                )
            ratio, stats = normalize_clip(raw, degenerate, self.gamma, local, n)
        tables = self._space_tables[li][s]
        fig.put("raw_gsnr", tables, stats.raw_mean)
        fig.put("ratio", tables, stats.ratio_mean)
        fig.put("frac_clipped", tables, stats.frac_clipped)
        fig.put("frac_degenerate", tables, stats.frac_degenerate)
        return ratio, raw

    def _smoothed(
        self, li: int, s: int, rows: Tensor, signal: Tensor, second: Tensor
    ) -> tuple[Tensor, Tensor]:
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

    def _step_space(
        self,
        li: int,
        lookup: RowwiseLookup,
        s: int,
        view: RowSpaceView,
        sr: StepRows,
        lr: float,
        fig: TableFigures,
        noise_sums: Tensor,
        per_table: list[RowStep | None],
    ) -> tuple[Tensor, Tensor]:
        """One row space's step: figures, ratios and (GSNR route) the update; returns the
        touched rows and the mean gradient the plain route hands to the fused kernel (CowClip's
        clipped one), computed in place in the sums' buffer."""
        k = self.k
        rows = sr.rows
        seg = self._space_tables[li][s][view.table_index(rows)]  # the lookup's table of each row
        if self.track_noise:
            add_table_sums(noise_sums, seg, sr.grad_sum, sr.sq_sum)
        fig.add("touched_rows", seg, torch.ones_like(rows))
        fig.add("multi_group_rows", seg, sr.n_groups >= 2)
        ratio = torch.ones(rows.numel(), device=rows.device)
        raw: Tensor | None = None
        if self.gsnr:
            ratio, raw = self._ratio(li, s, view, sr, fig)
        mean = sr.grad_sum.div_(k)  # ḡ_row, in place
        size = self._chunk_rows(rows.device, view.dim)
        if self.cowclip is not None and rows.numel():
            assert sr.counts is not None
            for c in self._pieces(rows.device, rows.numel(), size):
                factor = cowclip_rows(mean[c], view.gather(rows[c]), sr.counts[c], self.cowclip)
                fig.add("cowclip_clipped", seg[c], factor < 1.0)
                fig.add("cowclip_factor", seg[c], factor)
        measure = self.gsnr and self.measure_steps
        if self.direct or measure:
            actual, plain = [], []
            for c in self._pieces(rows.device, rows.numel(), size):
                if self.direct:
                    out = scaled_rowwise_step(
                        view,
                        rows[c],
                        mean[c],
                        ratio[c],
                        lr=lr,
                        eps=lookup.eps,
                        kernel=lookup.kernel,  # type: ignore[arg-type]
                        placement=self.placement,
                        measure=measure,
                    )
                else:  # measured at γ = 1: the fused kernel, weights read before and after
                    out = self._kernel_measured(lookup, s, view, rows[c], mean[c], lr)
                if out is not None:
                    actual.append(out[0])
                    plain.append(out[1])
            if measure:
                empty = torch.zeros(0, device=rows.device)
                mean_r, p10 = step_ratio_stats(
                    torch.cat(actual) if actual else empty,
                    torch.cat(plain) if plain else empty,
                    view.table_index(rows),
                    len(view.space.tables),
                )
                fig.put("step_ratio_mean", self._space_tables[li][s], mean_r)
                fig.put("step_ratio_p10", self._space_tables[li][s], p10)
        if self.record_rows:
            kernel_input = mean * ratio[:, None] if self.placement == "gradient" else mean
            self._record(view, rows, kernel_input, raw, ratio, per_table)
        return rows, mean

    def _kernel_measured(
        self,
        lookup: RowwiseLookup,
        s: int,
        view: RowSpaceView,
        rows: Tensor,
        mean: Tensor,
        lr: float,
    ) -> tuple[Tensor, Tensor]:
        """The fused kernel on ``rows`` of space ``s`` alone, with their realised and plain
        step norms (the weights read before and after)."""
        before = view.gather(rows)
        state_before = view.gather_states(rows)
        spaces = lookup.capture.layout.spaces
        only_rows = [rows if i == s else rows.new_zeros(0) for i in range(len(spaces))]
        only_grads = [mean if i == s else mean.new_zeros(0, sp.dim) for i, sp in enumerate(spaces)]
        with torch.enable_grad():
            lookup.apply_rows(only_rows, only_grads, lr, self.chunk_rows)
        actual = torch.linalg.vector_norm(view.gather(rows).sub_(before), dim=1)
        return actual, plain_step_norm(lookup.kernel, lr, lookup.eps, mean, state_before)

    def _record(
        self,
        view: RowSpaceView,
        rows: Tensor,
        update: Tensor,
        raw: Tensor | None,
        ratio: Tensor,
        per_table: list[RowStep | None],
    ) -> None:
        """Keep the step's rows per table (``record_rows``: tests and inspection; reads back)."""
        space = view.space
        local_ix = view.table_index(rows)
        counts = torch.bincount(local_ix, minlength=len(space.tables)).tolist()
        order = torch.argsort(rows)
        starts = torch.tensor(space.offsets[:-1], dtype=torch.int64, device=rows.device)
        local = (rows - starts[local_ix])[order]
        raw = torch.ones_like(ratio) if raw is None else raw
        parts = zip(
            space.tables,
            local.split(counts),
            update[order].split(counts),
            raw[order].split(counts),
            ratio[order].split(counts),
            strict=True,
        )
        for t, r, u, rw, rt in parts:
            per_table[t] = RowStep(r, u.clone(), rw, rt)

    def summary(self) -> list[dict[str, Any]]:
        """Per-table figures of the last step: touched rows, rows seen in >= 2 groups and, with
        GSNR, mean raw GSNR, mean clipped ratio, fraction clipped at γ, fraction degenerate, the
        placement and (on measured steps) the realised step ratio ``‖actual step‖ / ‖plain
        step from the same state‖`` over touched rows (``step_ratio_mean``,
        ``step_ratio_p10``). Reading them waits for the step's one copy to the host."""
        return [row for fig in self._figures for row in fig.rows()]

    def state_dict(self) -> dict[str, Any]:
        return {
            "param_groups": [dict(g) for g in self.param_groups],
            "estimator": self.estimator if self.gsnr else None,
            "placement": self.placement if self.gsnr else None,
            "cowclip": asdict(self.cowclip) if self.cowclip is not None else None,
            "ema": [[(s.clone(), q.clone()) for s, q in tables] for tables in self._ema],
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the LR and the EMA state; CowClip keeps no state of its own (its counts are
        the step's own ids, and its row norms are the table's weights)."""
        self.param_groups = [dict(g) for g in state["param_groups"]]
        self.updates = int(state.get("updates", 0))  # older checkpoints: fp32 tables only
        ema = state.get("ema", [])
        if self._ema and not ema:
            raise ValueError("the saved sparse optimizer has no EMA state to resume from")
        for tables, saved in zip(self._ema, ema, strict=True):
            for (s, q), (s0, q0) in zip(tables, saved, strict=True):
                s.copy_(s0)
                q.copy_(q0)
