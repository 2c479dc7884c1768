"""Does a GPU train what the CPU trains? Both from the same weights, step by step, every table
row's mean gradient, ratio, row-wise state and weights held to what float32 rounding allows
(``bench/gpu_check.py`` runs it).

Before each step the device trainer takes the CPU trainer's whole state (dense layers, tables,
row-wise sums, optimizer moments), so each step starts from identical weights and row-wise
state ``s``; both then train the same micro-batches. Losses and dense layers must agree to
float32 precision. Every tolerance on the tables comes from the CPU's side alone (the
reference), never from the device's own figures, so an error upstream of the row kernel cannot
widen its own bound:

* **mean gradient** ``ḡ_row = (1/k) Σ_d g_{d,row}``: the CPU also sums, per row, the absolute
  values of every term that enters it (``M_row = Σ_samples |w·∂L/∂pooled|``, the same reduction
  applied to the absolute pooled gradient). The two devices' ``ḡ_row`` may differ by
  ``GRAD_ULPS·ε₃₂·‖M_row‖/k`` (the forward error of float32 sums, whatever their order, with
  room for the terms' own differences), and each ``g_{d,row}`` by ``GRAD_ULPS·ε₃₂·‖M_{d,row}‖``;
* **ratio** ``r_row`` (GSNR, step estimator): from those bounds, an interval of the raw ratio
  ``‖ḡ‖²/(Q − ‖ḡ‖²)`` (``Q = (1/k) Σ_d ‖g_d‖²``) around the CPU's float64 figures, its table's
  mean over live rows, the normalization and the clip to ``[γ, 1]``; a row that may be
  degenerate on one side may have any ratio up to 1. Both devices' ratios must lie in it;
* **row state** (row-wise Adagrad): ``s + mean_D(g²)`` from the shared ``s``: within
  ``(2‖g‖τ + τ²)/D`` plus a few ulps;
* **weights**: ``Δ = −lr·r·g/(√(s + ‖g‖²/D) + ε)`` from the shared ``s``. Its Jacobian in ``g``
  has norm at most ``1/(√(s + ‖g‖²/D) + ε)``, so the two steps differ by at most
  ``lr·(r_max·τ/(√(s + max(‖g‖ − τ, 0)²/D) + ε) + Δr·‖Δ/(lr·r)‖_max)`` (never above ``2·lr·√D``):
  a row whose gradient is mostly cancellation on its first update (``s = 0``, ``‖g‖ ≲ τ``)
  may turn (tests/optim/test_sparse_amplification.py); a row with history may not. SGD:
  ``lr·(r_max·τ + Δr·(‖g‖ + τ))``.

Rows the step did not touch must be bit for bit the same on both.

    python bench/device_agreement.py --device cuda       # also part of bench/gpu_check.py
    python bench/device_agreement.py --device cpu        # the same code on the CPU (exact)
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dlrm_vrgd.config import load_config  # noqa: E402
from dlrm_vrgd.embedding.capture import LookupCapture, pooled_grad_to_rows  # noqa: E402
from dlrm_vrgd.optim.gsnr import DEGENERATE_REL  # noqa: E402
from dlrm_vrgd.train.loop import Trainer  # noqa: E402

#: VR-Adam and GSNR row-wise Adagrad on the demo's model and data, 8 groups of 1024 rows.
CHECK = [
    "optim.dense.name=vradam",
    "optim.dense.lr=0.002",
    "optim.sparse.name=gsnr_rowwise_adagrad",
    "optim.sparse.gamma=0.2",
    "run.global_batch=8192",
    "run.micro_batch=1024",
    "run.epochs=null",
    "run.steps=100",
    "run.tensorboard=false",
]
#: Two float32 computations of a row's gradient may differ by this many ulps of the absolute
#: sum of its terms (summation order, and each term's own rounding upstream).
GRAD_ULPS = 1024
#: Float32 ulps allowed on top of a bound for the final roundings (states, weights, ratios).
ULPS = 8
EPS32 = torch.finfo(torch.float32).eps
_TINY = 1e-30


def backend() -> str:
    try:
        import fbgemm_gpu  # noqa: F401
    except ImportError:
        return "torch"
    return "fbgemm"


def trainer(device: str, overrides: list[str]) -> Trainer:
    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        [*CHECK, f"model.embedding_backend={backend()}", *overrides, f"run.device={device}"],
    )
    t = Trainer(cfg)
    t.sparse_opt.record_rows = True
    return t


# ------------------------------------------------------------------ the CPU's reference sums
@dataclass
class SpaceSums:
    """Per global row of one row space, over one step (float64): ``grad`` Σ_d g_d (rows x D),
    ``absolute`` the sum of the absolute values of its terms (rows x D), ``sq`` Σ_d ‖g_d‖²,
    ``cross`` Σ_d ‖g_d‖·‖M_d‖ and ``abs_sq`` Σ_d ‖M_d‖² (rows each; ``M_d`` group ``d``'s
    absolute sum)."""

    grad: Tensor
    absolute: Tensor
    sq: Tensor
    cross: Tensor
    abs_sq: Tensor

    @staticmethod
    def zeros(rows: int, dim: int) -> SpaceSums:
        def z(*shape: int) -> Tensor:
            return torch.zeros(*shape, dtype=torch.float64)

        return SpaceSums(z(rows, dim), z(rows, dim), z(rows), z(rows), z(rows))

    def add(self, rows: Tensor, grads: Tensor, absolute: Tensor) -> None:
        """Fold in one call's per-(row, group) gradients and their absolute sums."""
        g, m = grads.detach().cpu().double(), absolute.detach().cpu().double()
        rows = rows.cpu()
        g_norm = torch.linalg.vector_norm(g, dim=1)
        m_norm = torch.linalg.vector_norm(m, dim=1)
        self.grad.index_add_(0, rows, g)
        self.absolute.index_add_(0, rows, m)
        self.sq.index_add_(0, rows, g_norm.square())
        self.cross.index_add_(0, rows, g_norm * m_norm)
        self.abs_sq.index_add_(0, rows, m_norm.square())


class Reference:
    """Watches the CPU trainer's steps: every captured call's row gradients and the absolute
    sums of their terms (:func:`pooled_grad_to_rows` of ``|∂L/∂pooled|`` with ``|weights|``),
    per row in float64 (:class:`SpaceSums`), and the number of groups ``k`` of the step."""

    def __init__(self, cpu: Trainer) -> None:
        self._layouts = [lk.capture.layout for lk in cpu.lookups]
        self.sums: list[list[SpaceSums]] = []
        self.k = 0
        self.reset()
        for li, lk in enumerate(cpu.lookups):
            self._watch(li, lk.capture)
        opt = cpu.sparse_opt
        step = opt.step

        def counted_step() -> None:
            self.k = opt.k
            step()

        opt.step = counted_step  # type: ignore[method-assign]

    def reset(self) -> None:
        self.sums = [
            [SpaceSums.zeros(sp.size, sp.dim) for sp in layout.spaces] for layout in self._layouts
        ]

    def _watch(self, li: int, capture: LookupCapture) -> None:
        take = capture.take

        def watched_take() -> list[Any]:
            calls = list(capture._calls)  # read only: each call's inputs and output gradient
            out = take()
            for call, spaces in zip(calls, out, strict=True):
                grad = call.leaf.grad
                grad = torch.zeros_like(call.leaf) if grad is None else grad
                psw = call.per_sample_weights
                absolute = pooled_grad_to_rows(
                    call.indices,
                    call.offsets,
                    None if psw is None else psw.abs(),
                    grad.abs(),
                    capture.layout,
                    capture.pooling,
                    capture.groups_per_call,
                    count_ids=False,
                    one_hot=capture.one_hot,
                )
                for acc, rg, ra in zip(self.sums[li], spaces, absolute, strict=True):
                    if not (torch.equal(rg.rows, ra.rows) and torch.equal(rg.groups, ra.groups)):
                        raise RuntimeError("the absolute sums' (row, group) entries differ")
                    acc.add(rg.rows, rg.grads, ra.grads)
            return out

        capture.take = watched_take  # type: ignore[method-assign]


# ------------------------------------------------------------------ bounds (float64, CPU)
def ratio_interval(
    signal: Tensor, second: Tensor, d_signal: Tensor, d_second: Tensor, gamma: float
) -> tuple[Tensor, Tensor]:
    """``(lo, hi)`` (U each) holding the clipped, normalized GSNR ratio of every touched row of
    one table (:func:`~dlrm_vrgd.optim.gsnr.raw_gsnr` then
    :func:`~dlrm_vrgd.optim.gsnr.normalize_clip`) of any computation whose ``‖ḡ‖²`` and
    ``Q = (1/k) Σ_d ‖g_d‖²`` are within ``d_signal`` and ``d_second`` of ``signal`` and
    ``second``. A row that may be degenerate on one side may have any ratio up to 1; the table's
    mean over live rows is bounded over every set of live rows those may give."""
    var = (second - signal).clamp_min(0.0)
    d_var = d_second + d_signal + ULPS * EPS32 * second  # and the devices' own float32 Q − ‖ḡ‖²
    thr_lo = DEGENERATE_REL * (second - d_second).clamp_min(0.0) + _TINY
    thr_hi = DEGENERATE_REL * (second + d_second) + _TINY
    live = var - d_var > thr_hi  # live on any such computation
    dead = var + d_var <= thr_lo  # degenerate on any
    unsure = ~live & ~dead
    raw_lo = (signal - d_signal).clamp_min(0.0) / (var + d_var).clamp_min(_TINY)
    raw_hi = (signal + d_signal) / torch.maximum(var - d_var, thr_lo)  # live: var > thr_lo
    n_live, n_unsure = int(live.sum()), int(unsure.sum())
    lo, hi = torch.ones_like(signal), torch.ones_like(signal)
    if n_live == 0:  # the mean may be unusable (every ratio 1) or any of the unsure rows'
        lo[unsure] = gamma
        return lo, hi
    mean_lo = raw_lo[live].sum() / (n_live + n_unsure)
    mean_hi = (raw_hi[live].sum() + raw_hi[unsure].sum()) / n_live
    slack = ULPS * EPS32
    if mean_lo <= _TINY:  # the mean may be unusable on one side: every ratio may be 1
        lo[~dead] = gamma
    else:
        lo[~dead] = (raw_lo[~dead] / mean_hi).clamp(gamma, 1.0) * (1 - slack)
    hi[live] = (raw_hi[live] / mean_lo).clamp(gamma, 1.0) * (1 + slack) if mean_lo > _TINY else 1.0
    return lo, hi


def step_bound(
    kernel: str,
    lr: float,
    eps: float,
    g_norm: Tensor,
    tau: Tensor,
    state: Tensor | None,
    dim: int,
    r_max: Tensor,
    dr: Tensor,
) -> Tensor:
    """A bound (U) on ``‖Δ − Δ'‖`` of two row steps ``Δ = −lr·r·f(g)`` from the shared row
    state ``state`` (U, before the step) when ``‖g − g'‖ ≤ tau``, ``r, r' ≤ r_max`` and
    ``|r − r'| ≤ dr`` (``g_norm = ‖g‖``). Row-wise Adagrad: ``f(g) = g/(√(s + ‖g‖²/D) + ε)``,
    whose Jacobian has norm at most ``1/(√(s + ‖g‖²/D) + ε)`` and whose norm is below ``√D``;
    SGD: ``f(g) = g``."""
    if kernel == "sgd" or state is None:
        return lr * (r_max * tau + dr * (g_norm + tau))
    root_d = math.sqrt(dim)
    nearest = (g_norm - tau).clamp_min(0.0)  # the smallest ‖g‖ between the two
    df = (tau / ((state + nearest.square() / dim).sqrt() + eps)).clamp_max(2 * root_d)
    far = g_norm + tau
    f_max = (far / ((state + far.square() / dim).sqrt() + eps)).clamp_max(root_d)
    return lr * (r_max * df + dr * f_max)


# ------------------------------------------------------------------ the comparison
def _supported(t: Trainer) -> None:
    opt = t.sparse_opt
    if opt.cowclip is not None or (opt.gsnr and opt.estimator != "step"):
        raise ValueError(
            "the agreement check bounds plain and GSNR (step estimator) row-wise steps only"
        )


def _space_of(layout: Any, table: int) -> tuple[int, int]:
    for s, space in enumerate(layout.spaces):
        if table in space.tables:
            return s, space.tables.index(table)
    raise KeyError(table)


def check_table(
    name: str,
    step: int,
    x: Any,
    y: Any,
    sums: SpaceSums,
    global_rows: Tensor,
    k: int,
    before: tuple[Tensor, Tensor | None],
    after_cpu: tuple[Tensor, Tensor | None],
    after_dev: tuple[Tensor, Tensor | None],
    *,
    kernel: str,
    lr: float,
    eps: float,
    gsnr: bool,
    gamma: float,
    placement: str,
) -> tuple[dict[str, Any], list[str]]:
    """One table's step on both devices: its figures and its problems (see the module doc).
    ``x``/``y``: the CPU's and the device's :class:`~dlrm_vrgd.optim.sparse.RowStep`;
    ``before``/``after_*``: (weights, row states) of the whole table."""
    problems: list[str] = []
    at = f"step {step}: {name}"
    rows = x.rows.cpu()
    w0, s0 = before
    w_cpu, s_cpu = after_cpu
    w_dev, s_dev = after_dev
    entry: dict[str, Any] = {"step": step, "table": name, "rows": rows.numel()}
    touched = torch.zeros(w0.shape[0], dtype=torch.bool)
    touched[rows] = True
    if not torch.equal(w_cpu[~touched], w_dev[~touched]) or (
        s_cpu is not None
        and s_dev is not None
        and not torch.equal(s_cpu[~touched], s_dev[~touched])
    ):
        problems.append(f"{at}: rows the step did not touch differ")
    if rows.numel() == 0:
        entry.update(max_diff=0.0, rows_over_1e_3=0, max_diff_over_bound=0.0)
        entry.update(grad_over_tol=0.0, ratios_outside=0, state_over_bound=0.0)
        return entry, problems
    dim = w0.shape[1]
    grad = sums.grad[global_rows] / k  # ḡ, float64
    g_norm = torch.linalg.vector_norm(grad, dim=1)
    tau = GRAD_ULPS * EPS32 * torch.linalg.vector_norm(sums.absolute[global_rows], dim=1) / k
    r_cpu, r_dev = x.ratio.cpu().double(), y.ratio.cpu().double()
    if gsnr:
        second = sums.sq[global_rows] / k
        signal = g_norm.square()
        c = GRAD_ULPS * EPS32
        d_signal = 2 * g_norm * tau + tau.square() + ULPS * EPS32 * signal
        d_second = (2 * c * sums.cross[global_rows] + c * c * sums.abs_sq[global_rows]) / k
        d_second = d_second + ULPS * EPS32 * second
        lo, hi = ratio_interval(signal, second, d_signal, d_second, gamma)
    else:
        lo = hi = torch.ones_like(g_norm)
    dr = hi - lo
    if placement == "gradient" and gsnr:  # the kernel is handed r·ḡ
        expected = r_cpu[:, None] * grad
        tau_in = hi * tau + dr * (g_norm + tau)
        r_max, dr_step = torch.ones_like(hi), torch.zeros_like(dr)
    else:
        expected, tau_in, r_max, dr_step = grad, tau, hi, dr
    u_cpu, u_dev = x.update.cpu().double(), y.update.cpu().double()
    over = torch.linalg.vector_norm(u_cpu - u_dev, dim=1) / tau_in.clamp_min(_TINY)
    entry["grad_over_tol"] = float(over.max())
    if (over > 1).any():
        problems.append(
            f"{at}: the mean gradients of {int((over > 1).sum())} rows differ beyond float32 "
            f"rounding (worst {entry['grad_over_tol']:.3g}x the tolerance)"
        )
    if (torch.linalg.vector_norm(u_cpu - expected, dim=1) > tau_in).any():
        problems.append(f"{at}: the CPU's own mean gradients are not the reference's (check bug)")
    outside = (r_dev < lo) | (r_dev > hi)
    entry["ratios_outside"] = int(outside.sum())
    if outside.any():
        i = int(outside.nonzero()[0])
        problems.append(
            f"{at}: the ratios of {entry['ratios_outside']} rows are outside their intervals "
            f"(e.g. {float(r_dev[i]):.6f} not in [{float(lo[i]):.6f}, {float(hi[i]):.6f}])"
        )
    if ((r_cpu < lo) | (r_cpu > hi)).any():
        problems.append(f"{at}: the CPU's own ratios are outside their intervals (check bug)")
    u_norm = torch.linalg.vector_norm(expected, dim=1)
    state0 = None
    entry["state_over_bound"] = 0.0
    if s0 is not None and s_cpu is not None and s_dev is not None:
        state0 = s0[rows].double()
        a, b = s_cpu[rows].double(), s_dev[rows].double()
        bound = (2 * u_norm * tau_in + tau_in.square()) / dim + ULPS * EPS32 * a.abs()
        ratio = (a - b).abs() / bound.clamp_min(_TINY)
        entry["state_over_bound"] = float(ratio.max())
        if (ratio > 1).any():
            problems.append(
                f"{at}: the row-wise states of {int((ratio > 1).sum())} rows differ beyond "
                f"their bound (worst {entry['state_over_bound']:.3g}x)"
            )
    moved = torch.linalg.vector_norm(w_cpu[rows].double() - w_dev[rows].double(), dim=1)
    bound = step_bound(kernel, lr, eps, u_norm, tau_in, state0, dim, r_max, dr_step)
    w_eps = torch.finfo(w0.dtype).eps
    slack = (
        ULPS
        * w_eps
        * (
            torch.linalg.vector_norm(w0[rows].double(), dim=1)
            + torch.linalg.vector_norm(w_cpu[rows].double(), dim=1)
        )
    )
    excess = moved / (bound + slack).clamp_min(_TINY)
    entry["max_diff"] = float(moved.max())
    entry["rows_over_1e_3"] = int((moved > 1e-3).sum())
    entry["max_diff_over_bound"] = float(excess.max())
    if entry["max_diff_over_bound"] > 1.0:
        problems.append(
            f"{at}: a row moved {entry['max_diff']:.2e} apart, "
            f"{entry['max_diff_over_bound']:.2f}x its bound"
        )
    return entry, problems


def _tables(t: Trainer, li: int) -> list[tuple[Tensor, Tensor | None]]:
    """(weights, row states or None) of every table of lookup ``li``, on the CPU."""
    lk = t.lookups[li]
    states = lk.row_states() if lk.kernel != "sgd" else [None] * len(lk.table_names)
    return [
        (
            w.detach().float().cpu().clone(),
            None if s is None else s.detach().cpu().reshape(-1).clone(),
        )
        for w, s in zip(lk.table_weights(), states, strict=True)
    ]


def compare(
    device: str,
    steps: int,
    overrides: list[str] | None = None,
    tamper: Callable[[Trainer], None] | None = None,
) -> tuple[list[dict], list[str]]:
    """Per step and table, the rows' figures against their bounds; and the problems.
    ``tamper`` (tests) alters the device trainer after it took the CPU's state, every step."""
    cpu, dev = trainer("cpu", overrides or []), trainer(device, overrides or [])
    _supported(cpu)
    ref = Reference(cpu)
    opt = cpu.sparse_opt
    tables: list[dict[str, Any]] = []
    problems: list[str] = []
    for step in range(1, steps + 1):
        dev.load_state_dict(copy.deepcopy(cpu.state_dict()))  # identical weights, every step
        if tamper is not None:
            tamper(dev)
        before = [_tables(cpu, li) for li in range(len(cpu.lookups))]
        ref.reset()
        a, b = cpu.train_step()["loss"], dev.train_step()["loss"]
        if abs(a - b) > 1e-5 * abs(a):
            problems.append(f"step {step}: loss cpu {a:.7f} vs {device} {b:.7f}")
        for (name, p), (_, q) in zip(
            cpu.model.named_dense_parameters(), dev.model.named_dense_parameters(), strict=True
        ):
            err = float((p.detach() - q.detach().cpu()).abs().max())
            if err > 1e-4 * max(1.0, float(p.detach().abs().max())):
                problems.append(f"step {step}: dense {name}: max |cpu - {device}| = {err:.2e}")
        lr_step = float(opt.param_groups[0]["lr"])  # the step's, after schedules
        for li, (lk, rec_cpu, rec_dev) in enumerate(
            zip(cpu.lookups, opt.last_rows, dev.sparse_opt.last_rows, strict=True)
        ):
            layout = lk.capture.layout
            after_cpu, after_dev = _tables(cpu, li), _tables(dev, li)
            for t, (name, x, y) in enumerate(zip(lk.table_names, rec_cpu, rec_dev, strict=True)):
                if x is None or y is None or not torch.equal(x.rows.cpu(), y.rows.cpu()):
                    problems.append(f"step {step}: {name}: the devices touched other rows")
                    continue
                s, pos = _space_of(layout, t)
                global_rows = x.rows.cpu() + layout.spaces[s].offsets[pos]
                entry, found = check_table(
                    name, step, x, y, ref.sums[li][s], global_rows, ref.k,
                    before[li][t], after_cpu[t], after_dev[t],
                    kernel=lk.kernel, lr=lr_step, eps=lk.eps, gsnr=opt.gsnr,
                    gamma=opt.gamma, placement=opt.placement,
                )  # fmt: skip
                tables.append(entry)
                problems += found
    return tables, problems


def print_report(tables: list[dict], problems: list[str], device: str) -> None:
    from common import print_table

    last = max((t["step"] for t in tables), default=0)
    rows = [
        [
            t["table"],
            t["rows"],
            f"{t['max_diff']:.2e}",
            t["rows_over_1e_3"],
            f"{t['max_diff_over_bound']:.3f}",
            f"{t['grad_over_tol']:.3f}",
            t["ratios_outside"],
            f"{t['state_over_bound']:.3f}",
        ]
        for t in tables
        if t["step"] == last
    ]
    print(f"tables after step {last}, each step from identical weights (cpu vs {device}):")
    print_table(
        ["table", "rows", "max |dw|", "> 1e-3", "|dw| / bound", "|dg| / tol", "r outside",
         "|ds| / bound"],
        rows,
    )  # fmt: skip
    for key, what in [
        ("max_diff_over_bound", "row difference over its bound"),
        ("grad_over_tol", "mean-gradient difference over its tolerance"),
        ("state_over_bound", "row-state difference over its bound"),
    ]:
        worst = max((t[key] for t in tables), default=0.0)
        print(f"largest {what}, every step: {worst:.3f} (must be <= 1)")
    for p in problems:
        print("MISMATCH", p)
    print("agreement:", "FAILED" if problems else "ok")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if args.device == "cuda":  # float32 GEMMs on both sides: the tolerances assume them
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    tables, problems = compare(args.device, args.steps)
    print_report(tables, problems, args.device)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
