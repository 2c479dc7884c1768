"""CowClip (Zheng et al., arXiv 2204.06240) as its authors' code runs it: see
:mod:`dlrm_vrgd.optim.sparse.optimizer` and docs/cowclip.md."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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
    mean_grad.mul_(factor[:, None])  # x 1.0 where the clip is inactive: unchanged, bit for bit
    return factor
