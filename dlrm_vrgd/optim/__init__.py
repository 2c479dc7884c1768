"""VRGD optimizers as a library (docs/library.md).

Dense: :class:`VRSGD`, :class:`VRAdam`, :class:`VRLARS`, :class:`VRLAMB`, :class:`VRAdagrad`
(``torch.optim.Optimizer`` subclasses with the group protocol: ``collect()`` after each
micro-batch's backward, ``step()`` once per global step). Tables:
:class:`SparseRowwiseOptimizer` (loaded on first use: it imports FBGEMM). The gradient noise
scale: :class:`NoiseScale`.
"""

from __future__ import annotations

from typing import Any

from dlrm_vrgd.optim.gsnr import gsnr_ratio, gsnr_ratios, rowwise_ratio
from dlrm_vrgd.optim.noise_scale import NoisePieces, NoiseScale
from dlrm_vrgd.optim.vrgd import (
    VR_OPTIMIZERS,
    VRLAMB,
    VRLARS,
    VRSGD,
    GroupGSNROptimizer,
    VRAdagrad,
    VRAdam,
)

__all__ = [
    "VR_OPTIMIZERS",
    "VRSGD",
    "GroupGSNROptimizer",
    "NoisePieces",
    "NoiseScale",
    "SparseRowwiseOptimizer",
    "VRAdagrad",
    "VRAdam",
    "VRLAMB",
    "VRLARS",
    "gsnr_ratio",
    "gsnr_ratios",
    "rowwise_ratio",
]


def __getattr__(name: str) -> Any:
    """``SparseRowwiseOptimizer`` on first use: importing it loads FBGEMM and torchrec."""
    if name == "SparseRowwiseOptimizer":
        from dlrm_vrgd.optim.sparse import SparseRowwiseOptimizer

        return SparseRowwiseOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
