"""Gradient noise scale ``B_simple`` (McCandlish et al. 2018, arXiv 1812.06162, App. A;
DESIGN.md 4.6) from the sums the group-protocol optimizers already hold.

A step has ``k`` gradient groups ``g_1..g_k`` (micro-batches of ``b`` rows; under several ranks,
every rank's), each the gradient of the mean loss of its own rows, so ``E g_d = G`` and
``Cov g_d = Σ/b`` with ``Σ`` the per-row gradient covariance. With ``ḡ = (1/k) Σ_d g_d``:
``E|g_d|² = |G|² + tr Σ/b`` and ``E|ḡ|² = |G|² + tr Σ/(k·b)``, hence the unbiased estimates

    |G|²_est = (k·|ḡ|² − mean_d |g_d|²) / (k − 1)
    S_est    = b·k/(k − 1) · (mean_d |g_d|² − |ḡ|²)          (of tr Σ)

and ``B_simple = EMA(S_est) / EMA(|G|²_est)``: numerator and denominator are smoothed separately
(each is unbiased but noisy, and ``|G|²_est`` can be negative) before the ratio is taken. Both
estimates are linear in the two sums, so those of a concatenation (all dense tensors as one
vector, all tables) are the sums of its parts', smoothed or not.

The inputs per *segment* (a dense tensor, an embedding table) are two scalars of the step:
``|ḡ|²`` (``sq_of_mean``) and ``mean_d |g_d|²`` (``mean_of_sq``). For a table they are sums over
the rows the step touched: a row no group touched is zero in every ``g_d`` and adds nothing.
``k = 1`` gives no estimate (``mean_d |g_d|² = |ḡ|²``: nothing measures the spread).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

#: Default EMA factor of the two estimates (an effective window of (1+β)/(1−β) = 39 steps).
DEFAULT_BETA = 0.95

SINGLE_GROUP_REASON = (
    "one gradient group per step (k = 1): the noise scale needs k >= 2 micro-batches per step "
    "(run.global_batch >= 2 x run.micro_batch x world size)"
)
NONPOSITIVE_REASON = "the |G|² estimate is <= 0: the gradient's signal is below its noise here"

#: One segment's figures: ``(name, g2, s, g2_raw, s_raw)`` (smoothed, then the last step's).
Row = tuple[str, float, float, float, float]


@dataclass(frozen=True)
class NoisePieces:
    """One step's two sums per segment (float64, one entry per name): ``sq_of_mean`` =
    ``|ḡ|²`` and ``mean_of_sq`` = ``mean_d |g_d|²`` over ``k`` groups."""

    names: list[str]
    sq_of_mean: Tensor
    mean_of_sq: Tensor
    k: int

    @staticmethod
    def of(
        names: Sequence[str], grad_sq_norm: Tensor, group_sq_norms: Tensor, k: int
    ) -> NoisePieces:
        """From ``|Σ_d g_d|²`` and ``Σ_d |g_d|²`` per segment (any float dtype)."""
        return NoisePieces(
            list(names), grad_sq_norm.double() / (k * k), group_sq_norms.double() / k, k
        )


def estimates(sq_of_mean: Tensor, mean_of_sq: Tensor, k: int, b: int) -> tuple[Tensor, Tensor]:
    """``(|G|²_est, S_est)`` per segment from one step's ``|ḡ|²`` and ``mean_d |g_d|²`` over
    ``k >= 2`` groups of ``b`` rows (see the module doc)."""
    if k < 2:
        raise ValueError(f"the noise scale needs k >= 2 gradient groups, got k = {k}")
    if b < 1:
        raise ValueError(f"Invalid rows per group: {b}")
    g2 = (k * sq_of_mean - mean_of_sq) / (k - 1)
    s = (b * k / (k - 1)) * (mean_of_sq - sq_of_mean)
    return g2, s


def b_simple(s: float, g2: float) -> float | None:
    """``S / |G|²``, or None when ``|G|² <= 0`` or either is not finite."""
    if not (math.isfinite(s) and math.isfinite(g2)) or g2 <= 0:
        return None
    return s / g2


def sq_norms(tensors: Sequence[Tensor]) -> Tensor:
    """``|x|²`` of each tensor (float32, one entry each; one ``_foreach_norm``)."""
    if not tensors:
        return torch.zeros(0)
    return torch.stack(torch._foreach_norm(list(tensors))).float().square()


class GroupSqNorms:
    """``Σ_d |g_{d,i}|²`` of each tensor ``i`` of ``params`` over the groups of one step."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        self.params = list(params)
        self._index = {p: i for i, p in enumerate(self.params)}
        device = self.params[0].device if self.params else torch.device("cpu")
        self.total = torch.zeros(len(self.params), device=device)
        self._cached: dict[tuple[int, ...], Tensor] = {}

    def add(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
        """Fold one group's gradients ``grads[j]`` of ``params[j]`` in. No read-back: the
        positions of a set of ``params`` go to the device once (a tensor made from a list on a
        GPU is a copy the host waits for), and every tensor's is no index at all."""
        if not grads:
            return
        norms = sq_norms(grads).to(self.total.device)
        if len(params) == len(self.params) and all(
            p is q for p, q in zip(params, self.params, strict=True)
        ):
            self.total.add_(norms)
            return
        self.total.index_add_(0, self._positions(params), norms)

    def spread(self, params: Sequence[Tensor], values: Tensor) -> Tensor:
        """``values[j]`` of ``params[j]`` at each param's position, 0 elsewhere (one entry per
        tensor of :attr:`params`; no read-back, as :meth:`add`)."""
        values = values.to(self.total.device)
        if len(params) == len(self.params) and all(
            p is q for p, q in zip(params, self.params, strict=True)
        ):
            return values
        out = torch.zeros_like(self.total)
        if params:
            out.index_copy_(0, self._positions(params), values)
        return out

    def _positions(self, params: Sequence[Tensor]) -> Tensor:
        key = tuple(self._index[p] for p in params)
        if key not in self._cached:
            self._cached[key] = torch.tensor(key, dtype=torch.int64, device=self.total.device)
        return self._cached[key]

    def reset(self) -> None:
        self.total.zero_()


class SmoothedEstimates:
    """Bias-corrected EMAs (factor ``beta``) of ``|G|²_est`` and ``S_est`` per segment, updated
    once per step: after ``t`` updates ``EMA_t = Σ_i w_i x_i`` with ``w_i = (1−β)β^{t−i} /
    (1−β^t)``. The *effective window* is Kish's effective number of steps averaged,
    ``(Σw)²/Σw² = (1−β^t)(1+β) / ((1−β)(1+β^t))`` (``t`` at first, ``(1+β)/(1−β)`` later)."""

    def __init__(self, beta: float = DEFAULT_BETA) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid noise-scale EMA beta: {beta} (must be in [0, 1))")
        self.beta = beta
        self.t = 0
        self._g2: Tensor | None = None
        self._s: Tensor | None = None
        self.last: tuple[Tensor, Tensor] | None = None

    def update(self, g2: Tensor, s: Tensor) -> None:
        b = self.beta
        if self._g2 is None or self._s is None or self._g2.shape != g2.shape:
            self._g2, self._s, self.t = torch.zeros_like(g2), torch.zeros_like(s), 0
        elif self._g2.device != g2.device:  # resumed from a checkpoint read onto the CPU
            self._g2, self._s = self._g2.to(g2.device), self._s.to(s.device)
        self._g2.mul_(b).add_(g2, alpha=1 - b)
        self._s.mul_(b).add_(s, alpha=1 - b)
        self.t += 1
        self.last = (g2, s)

    def smoothed(self) -> tuple[Tensor, Tensor]:
        """``(EMA(|G|²_est), EMA(S_est))``, bias-corrected."""
        assert self._g2 is not None and self._s is not None, "no update yet"
        c = 1.0 - self.beta**self.t
        return self._g2 / c, self._s / c

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "g2": self._g2, "s": self._s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t, self._g2, self._s = int(state["t"]), state["g2"], state["s"]
        self.last = None

    @property
    def window(self) -> float:
        b, t = self.beta, self.t
        return (1 - b**t) * (1 + b) / ((1 - b) * (1 + b**t)) if t else 0.0


def entry(g2: float, s: float, g2_raw: float, s_raw: float) -> dict[str, Any]:
    """One segment's record: the smoothed and raw estimates and their ratios."""
    out: dict[str, Any] = {
        "b_simple": b_simple(s, g2),
        "b_simple_raw": b_simple(s_raw, g2_raw),
        "g2": g2,
        "s": s,
        "g2_raw": g2_raw,
        "s_raw": s_raw,
    }
    if out["b_simple"] is None:
        out["reason"] = NONPOSITIVE_REASON
    return out


class NoiseScale:
    """The noise-scale state of one process: smoothed estimates of its dense tensors and of its
    tables (every rank holds the same dense sums; each holds its own tables), fed every step by
    :meth:`update` with the optimizers' :class:`NoisePieces`."""

    def __init__(self, rows_per_group: int, beta: float = DEFAULT_BETA) -> None:
        if rows_per_group < 1:
            raise ValueError(f"Invalid rows per group: {rows_per_group}")
        self.b = rows_per_group
        self.beta = beta
        self.k = 0
        self.dense_names: list[str] = []
        self.table_names: list[str] = []
        self._dense = SmoothedEstimates(beta)
        self._tables = SmoothedEstimates(beta)
        self._warned = False

    def update(self, dense: NoisePieces | None, tables: NoisePieces | None) -> None:
        """Fold one step's pieces in (either may be None: no such parameters)."""
        ks = {p.k for p in (dense, tables) if p is not None}
        if not ks:
            return
        self.k = min(ks)
        if self.k < 2:
            if not self._warned:
                logger.warning("gradient noise scale: no estimate, %s", SINGLE_GROUP_REASON)
                self._warned = True
            return
        if dense is not None:
            self._dense.update(*estimates(dense.sq_of_mean, dense.mean_of_sq, dense.k, self.b))
            self.dense_names = dense.names
        if tables is not None:
            self._tables.update(*estimates(tables.sq_of_mean, tables.mean_of_sq, tables.k, self.b))
            self.table_names = tables.names

    def state_dict(self) -> dict[str, Any]:
        """The EMAs and the segments' names (tensors, names and ints only)."""
        return {
            "dense": self._dense.state_dict(),
            "tables": self._tables.state_dict(),
            "dense_names": list(self.dense_names),
            "table_names": list(self.table_names),
        }

    def load_state_dict(self, state: dict[str, Any] | None, table_names: list[str]) -> None:
        """Resume the EMAs. A checkpoint without them (older, or resharded onto other ranks,
        whose tables moved) or with other tables than ``table_names`` starts them again, and
        says so."""
        if not state or list(state["table_names"]) not in ([], table_names):
            logger.info("gradient noise scale: the checkpoint holds no EMA; it starts again")
            return
        self._dense.load_state_dict(state["dense"])
        self._tables.load_state_dict(state["tables"])
        self.dense_names = list(state["dense_names"])
        self.table_names = list(state["table_names"])

    @property
    def steps(self) -> int:
        return max(self._dense.t, self._tables.t)

    @staticmethod
    def _rows(store: SmoothedEstimates, names: list[str]) -> list[Row]:
        if store.last is None:
            return []
        g2, s = store.smoothed()
        g2_raw, s_raw = store.last
        cols = torch.stack([g2, s, g2_raw, s_raw]).tolist()  # one read-back
        return list(zip(names, *cols, strict=True))

    def dense_rows(self) -> list[Row]:
        """A :data:`Row` per dense tensor."""
        return self._rows(self._dense, self.dense_names)

    def table_rows(self) -> list[Row]:
        """A :data:`Row` per table of this process."""
        return self._rows(self._tables, self.table_names)

    def record(
        self, global_batch: int, dense_rows: list[Row], table_rows: list[Row]
    ) -> dict[str, Any]:
        """The ``noise_scale`` record of a ``gsnr.jsonl`` line from the dense rows and the
        table rows of every process (a table split over several, e.g. column-wise, is the sum
        of its parts): aggregates ``model`` (every parameter as one vector), ``dense`` (the
        dense tensors) and ``tables``, then ``per_tensor`` and ``per_table``."""
        head: dict[str, Any] = {
            "k": self.k,
            "rows_per_group": self.b,
            "global_batch": global_batch,
            "ema_beta": self.beta,
            "ema_steps": self.steps,
            "window_steps": max(self._dense.window, self._tables.window),
        }
        if self.k < 2:
            return {**head, "reason": SINGLE_GROUP_REASON}
        by_table: dict[str, list[float]] = {}
        for name, *vals in table_rows:
            acc = by_table.setdefault(name, [0.0, 0.0, 0.0, 0.0])
            for i, v in enumerate(vals):
                acc[i] += v
        tensors = list(dense_rows)
        tables = [(n, *v) for n, v in by_table.items()]

        def total(rows: list[tuple[Any, ...]]) -> dict[str, Any] | None:
            if not rows:
                return None
            return entry(*(math.fsum(r[i] for r in rows) for i in range(1, 5)))

        return {
            **head,
            "model": total(tensors + tables),
            "dense": total(tensors),
            "tables": total(tables),
            "per_tensor": [{"name": n, **entry(*v)} for n, *v in tensors],
            "per_table": [{"table": n, **entry(*v)} for n, *v in tables],
        }
