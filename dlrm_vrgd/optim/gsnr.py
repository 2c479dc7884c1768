"""Gradient signal-to-noise ratio (GSNR) kernels — pure functions, no state (DESIGN.md 4.1, 4.3).

With ``k`` gradient groups ``g_1..g_k`` (each the gradient of the mean loss of its own rows),
the statistics a caller accumulates are ``S = Σ_d g_d`` and ``Q = Σ_d g_d ⊙ g_d``. Then

1. ``ḡ = S / k``, ``s = Q / k``;
2. ``σ² = max(s − ḡ², 0)`` and the raw ratio ``r = ḡ² / σ²``, element-wise;
3. *degenerate* elements — ``σ² ≤ ε·s`` (no measurable spread: ``k = 1``, identical groups,
   all-zero gradients, up to fp32 cancellation) or non-finite statistics — get ``r = 1`` and
   are left out of step 4;
4. normalization per tensor: ``r ← r / mean(r over non-degenerate elements)``;
5. clip to ``[γ, 1]``: VRGD only damps noisy elements; ``γ = 1`` gives ``r ≡ 1``.

``ε`` is relative (``DEGENERATE_REL``), so the ratio does not change when the loss is scaled.
The row-wise variant (:func:`rowwise_ratio`) is the same with one scalar per embedding row:
``σ²_row = Q_row/k − ‖ḡ_row‖²`` with ``Q_row = Σ_d ‖g_{d,row}‖²`` and ``r_row = ‖ḡ_row‖²/σ²_row``.
Nothing returned is ever NaN or Inf.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: σ² at or below this fraction of the mean square counts as zero (fp32 cancellation in s − ḡ²
#: is a few ulps per accumulated group; 1e-5 leaves a wide margin up to thousands of groups).
DEGENERATE_REL = 1e-5
_TINY = 1e-30


@dataclass(frozen=True)
class GSNRStats:
    """Summary of a ratio, per segment (one segment = one tensor or one embedding table).

    Float32 tensors of one value per segment (0-d for a single tensor; no host sync until
    read): ``raw_mean`` is the mean raw GSNR over non-degenerate elements (0 when there are
    none); ``ratio_mean`` the mean clipped ratio; ``frac_clipped`` the fraction at ``γ``
    (γ < 1); ``frac_degenerate`` the fraction of degenerate elements.
    """

    raw_mean: torch.Tensor
    ratio_mean: torch.Tensor
    frac_clipped: torch.Tensor
    frac_degenerate: torch.Tensor

    _KEYS = ("raw_gsnr", "ratio", "frac_clipped", "frac_degenerate")

    def as_dicts(self) -> list[dict[str, float]]:
        columns = torch.stack(
            [self.raw_mean, self.ratio_mean, self.frac_clipped, self.frac_degenerate]
        ).reshape(4, -1)
        return [dict(zip(self._KEYS, col, strict=True)) for col in columns.t().tolist()]

    def as_dict(self) -> dict[str, float]:
        (only,) = self.as_dicts()
        return only


def raw_gsnr(
    signal: torch.Tensor, second_moment: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r, degenerate)`` from ``signal = ḡ²`` and ``second_moment = s`` (steps 2–3).

    ``r`` is 1 where ``degenerate``.
    """
    var = (second_moment - signal).clamp_min(0.0)
    degenerate = (var <= DEGENERATE_REL * second_moment + _TINY) | ~torch.isfinite(var)
    degenerate |= ~torch.isfinite(signal)
    safe_var = torch.where(degenerate, torch.ones_like(var), var)
    r = torch.where(degenerate, torch.ones_like(var), signal / safe_var)
    return r, degenerate


def segment_sums(values: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """``out[i]`` = the sum of the ``i``-th of the consecutive runs of ``sizes`` elements of the
    1-D, **non-negative** ``values`` (float32, or float64 for float64 input): one fused kernel
    (``_foreach_norm`` with ``ord=1``, as ``clip_grad_norm_`` uses it) whatever the number of
    runs, with sizes known on the host — nothing read back, no atomics."""
    dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
    parts = values.to(dtype).split(list(sizes))
    return torch.stack(torch._foreach_norm(list(parts), 1)).to(dtype)


@functools.lru_cache(maxsize=64)
def segment_ids(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The run of each element of consecutive runs of ``sizes`` elements (int64 on ``device``),
    made once per layout (a tensor made from host data on a GPU is a copy the host waits for)."""
    lengths = torch.tensor(sizes, dtype=torch.int64)
    ids = torch.repeat_interleave(torch.arange(len(sizes)), lengths, output_size=sum(sizes))
    return ids.to(device)


def normalize_clip(
    r: torch.Tensor,
    degenerate: torch.Tensor,
    gamma: float,
    segments: torch.Tensor | None = None,
    num_segments: int = 1,
    lengths: Sequence[int] | torch.Tensor | None = None,
) -> tuple[torch.Tensor, GSNRStats]:
    """Steps 4–5: divide by the mean over non-degenerate elements, clip to ``[γ, 1]``.

    Without ``segments`` the whole of ``r`` is one tensor (stats are 0-d). With ``segments``
    (int64, one segment id in ``[0, num_segments)`` per element of a 1-D ``r``) each segment is
    normalized by its own mean, as every embedding table is (stats have one entry per segment).
    ``lengths`` (optional, with ``segments``) says the segments are contiguous runs of these
    lengths, in order: their sums then take one fused reduction (:func:`segment_sums`) instead
    of a scatter. Give them as ints: a tensor of lengths is read back first.
    Nothing here reads a value back to the host.
    """
    if isinstance(lengths, torch.Tensor):
        lengths = [int(n) for n in lengths.tolist()]
    live = ~degenerate
    live_r = torch.where(live, r, torch.zeros_like(r))

    def per_segment(values: torch.Tensor) -> torch.Tensor:  # every sum here is of values >= 0
        values = values.to(torch.float32)
        if segments is None:
            return values.sum()
        if lengths is not None:
            return segment_sums(values, lengths)
        out = torch.zeros(num_segments, dtype=torch.float32, device=values.device)
        return out.index_add_(0, segments, values)

    n_live = per_segment(live)
    count = per_segment(torch.ones_like(r))
    mean = per_segment(live_r) / n_live.clamp_min(1)
    usable = (n_live > 0) & (mean > _TINY) & torch.isfinite(mean)
    scale = torch.where(usable, 1.0 / torch.where(usable, mean, torch.ones_like(mean)), 1.0)
    if segments is not None:
        scale, usable = scale[segments], usable[segments]
    ratio = torch.where(live & usable, r * scale.to(r.dtype), torch.ones_like(r))
    ratio = ratio.clamp_(gamma, 1.0)
    n = count.clamp_min(1)
    stats = GSNRStats(
        raw_mean=torch.where(n_live > 0, mean, torch.zeros_like(mean)),
        ratio_mean=torch.where(count > 0, per_segment(ratio) / n, torch.ones_like(n)),
        frac_clipped=per_segment(ratio <= gamma) / n if gamma < 1.0 else torch.zeros_like(n),
        frac_degenerate=per_segment(degenerate) / n,
    )
    return ratio, stats


def _check(k: int, gamma: float) -> None:
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"Invalid gamma: {gamma} (must be in (0, 1])")
    if k < 1:
        raise ValueError(f"Invalid number of groups: {k}")


def gsnr_ratios(
    grad_sums: list[torch.Tensor], sq_sums: list[torch.Tensor], k: int, gamma: float
) -> tuple[list[torch.Tensor], GSNRStats]:
    """Element-wise clipped, normalized GSNR ratios of several tensors (DESIGN.md 4.1).

    ``grad_sums[i]`` = ``Σ_d g_d``, ``sq_sums[i]`` = ``Σ_d g_d²`` of tensor ``i`` over ``k``
    groups (accumulated in fp32 or wider; lower precisions are promoted). Each tensor is
    normalized by its own mean, computed in one pass over their concatenation (a segment per
    tensor): a handful of kernels whatever the number of tensors, and no read-back. Returns the
    ratios (shaped like the inputs, fp32, in ``[γ, 1]``) and the stats with one entry per tensor
    (on the device).
    """
    _check(k, gamma)
    sizes = [g.numel() for g in grad_sums]
    device = grad_sums[0].device
    mean = torch.cat([g.reshape(-1).float() for g in grad_sums]) / k
    segments = segment_ids(tuple(sizes), device)
    if k < 2:
        r, degenerate = torch.ones_like(mean), torch.ones_like(mean, dtype=torch.bool)
    else:
        second = torch.cat([q.reshape(-1).float() for q in sq_sums]) / k
        r, degenerate = raw_gsnr(mean * mean, second)
    ratio, stats = normalize_clip(r, degenerate, gamma, segments, len(sizes), sizes)
    parts = [part.view_as(g) for part, g in zip(ratio.split(sizes), grad_sums, strict=True)]
    return parts, stats


def gsnr_ratio(
    grad_sum: torch.Tensor, sq_sum: torch.Tensor, k: int, gamma: float
) -> tuple[torch.Tensor, GSNRStats]:
    """:func:`gsnr_ratios` of one tensor (its stats are 0-d)."""
    (ratio,), stats = gsnr_ratios([grad_sum], [sq_sum], k, gamma)
    return ratio, GSNRStats(
        *(
            t.reshape(())
            for t in (stats.raw_mean, stats.ratio_mean, stats.frac_clipped, stats.frac_degenerate)
        )
    )


def row_sq_norm(x: torch.Tensor) -> torch.Tensor:
    """``‖x_i‖²`` of each row of ``x`` (U x D -> U)."""
    return torch.linalg.vector_norm(x, dim=1).square()


def row_moments(
    grad_sum: torch.Tensor, sq_sum: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two row scalars of DESIGN.md 4.3: ``‖ḡ_row‖²`` and ``(1/k) Σ_d ‖g_{d,row}‖²``, from
    ``grad_sum`` (U x D, ``Σ_d g_{d,row}``; zero for groups that did not touch the row) and
    ``sq_sum`` (U, ``Σ_d ‖g_{d,row}‖²``)."""
    signal = row_sq_norm(grad_sum.float()) / (k * k)
    return signal, sq_sum.float() / k


def rowwise_ratio(
    grad_sum: torch.Tensor,
    sq_sum: torch.Tensor,
    k: int,
    gamma: float,
    segments: torch.Tensor | None = None,
    num_segments: int = 1,
) -> tuple[torch.Tensor, GSNRStats]:
    """One ratio per embedding row (DESIGN.md 4.3): ``r_row = ‖ḡ_row‖² / σ²_row`` with
    ``σ²_row`` from :func:`row_moments`, normalized over the rows of each table (``segments``:
    the table of each row; None = one table), clipped to ``[γ, 1]``. A row touched by one group
    only has raw ratio ``1/(k − 1)``."""
    _check(k, gamma)
    if k < 2:
        ones = torch.ones(grad_sum.shape[0], device=grad_sum.device)
        return normalize_clip(ones, ones.bool(), gamma, segments, num_segments)
    r, degenerate = raw_gsnr(*row_moments(grad_sum, sq_sum, k))
    return normalize_clip(r, degenerate, gamma, segments, num_segments)


def step_ratio_stats(
    actual: Sequence[torch.Tensor], plain: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The realised step ratio ``actual[i] / plain[i]`` (step sizes of tensor ``i``: per
    element, >= 0) over the elements that the plain step moves, per tensor: its mean and its
    10th percentile, the ``⌈0.1·m⌉``-th smallest of the tensor's ``m`` ratios (float64, one entry
    per tensor, NaN where nothing moves). On the device, nothing read back: one sort for all
    tensors (by ratio, then stably by tensor; elements that do not move last in theirs)."""
    sizes = [a.numel() for a in actual]
    if not sum(sizes):
        nan = torch.full((len(sizes),), math.nan, dtype=torch.float64, device=actual[0].device)
        return nan, nan.clone()
    a = torch.cat([x.reshape(-1) for x in actual])
    p = torch.cat([x.reshape(-1) for x in plain])
    live = p > 0
    ratio = torch.where(live, a / torch.where(live, p, torch.ones_like(p)), 0.0).double()
    count = segment_sums(live.double(), sizes)
    mean = segment_sums(ratio, sizes) / count.clamp_min(1)
    seg = segment_ids(tuple(sizes), a.device)
    by_ratio = torch.argsort(torch.where(live, ratio, math.inf), stable=True)
    ordered = ratio[by_ratio][torch.argsort(seg[by_ratio], stable=True)]
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    start = segment_starts(tuple(starts), a.device)
    nth = torch.ceil(count * 0.1).clamp_min(1).long()  # ⌈0.1·m⌉ in float64, as Python's
    p10 = ordered[(start + nth - 1).clamp(0, ratio.numel() - 1)]
    moved = count > 0
    nan = torch.full_like(mean, math.nan)
    return torch.where(moved, mean, nan), torch.where(moved, p10, nan)


@functools.lru_cache(maxsize=64)
def segment_starts(starts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``starts`` as int64 on ``device``, made once (see :func:`segment_ids`)."""
    return torch.tensor(starts, dtype=torch.int64).to(device)


def step_ratio_summary(actual: torch.Tensor, plain: torch.Tensor) -> dict[str, float | None]:
    """:func:`step_ratio_stats` of one tensor, read back: ``step_ratio_mean`` and
    ``step_ratio_p10`` (None when nothing moves)."""
    mean, p10 = torch.cat(step_ratio_stats([actual], [plain])).tolist()
    return {
        "step_ratio_mean": None if math.isnan(mean) else mean,
        "step_ratio_p10": None if math.isnan(p10) else p10,
    }
