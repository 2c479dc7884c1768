"""Learning-rate schedules as pure functions of the step (DESIGN.md 4.4).

``lr(step) = base_lr · scale(G) · warmup(step) · decay(step)`` where

* ``scale(G)`` is 1, ``G / G_ref`` (linear rule) or ``√(G / G_ref)`` (square-root rule);
* ``warmup(step) = (step + 1) / W`` for ``step < W``, else 1;
* ``decay`` goes from 1 at the end of warm-up to ``min_lr_factor`` at the last step:
  polynomial ``m + (1 − m)(1 − p)²`` or cosine ``m + (1 − m)(1 + cos πp)/2``, with
  ``p = (step − W) / (T − W)`` the progress after warm-up.
"""

from __future__ import annotations

import math

from dlrm_vrgd.config import ScheduleConfig


def batch_scale(global_batch: int, cfg: ScheduleConfig) -> float:
    ratio = global_batch / cfg.reference_batch
    if cfg.lr_scaling == "linear":
        return ratio
    if cfg.lr_scaling == "sqrt":
        return math.sqrt(ratio)
    return 1.0


def lr_factor(step: int, total_steps: int, cfg: ScheduleConfig) -> float:
    """Multiplier of the (batch-scaled) base LR at 0-based ``step`` of ``total_steps``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    warm = cfg.warmup_steps
    if step < warm:
        return (step + 1) / warm
    if cfg.decay == "none" or total_steps <= warm + 1:
        return 1.0
    progress = min(1.0, (step - warm) / (total_steps - 1 - warm))
    m = cfg.min_lr_factor
    if cfg.decay == "poly":
        return m + (1.0 - m) * (1.0 - progress) ** 2
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress))
