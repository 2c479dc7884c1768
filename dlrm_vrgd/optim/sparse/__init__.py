"""Row-wise optimizer for embedding tables, one update per global batch (DESIGN.md 4.3).

:class:`SparseRowwiseOptimizer` (:mod:`.optimizer`) sums the step's row gradients
(:mod:`.accumulate`), forms each row's GSNR ratio, and updates the rows by the functional kernel of
:mod:`.rowwise` or the lookup's own fused kernel; CowClip lives in :mod:`.cowclip`, the per-table
figures in :mod:`.telemetry`.
"""

from dlrm_vrgd.optim.sparse.accumulate import GroupRows, RowAccumulator, StepRows
from dlrm_vrgd.optim.sparse.cowclip import CowClip, cowclip_rows
from dlrm_vrgd.optim.sparse.optimizer import (
    DEVICE_CHUNK_BYTES,
    RowStep,
    RowwiseLookup,
    SparseRowwiseOptimizer,
    add_table_sums,
)
from dlrm_vrgd.optim.sparse.rowwise import (
    plain_step,
    plain_step_norm,
    scaled_rowwise_step,
    step_difference_bound,
)

__all__ = [
    "DEVICE_CHUNK_BYTES",
    "CowClip",
    "GroupRows",
    "RowAccumulator",
    "RowStep",
    "RowwiseLookup",
    "SparseRowwiseOptimizer",
    "StepRows",
    "add_table_sums",
    "cowclip_rows",
    "plain_step",
    "plain_step_norm",
    "scaled_rowwise_step",
    "step_difference_bound",
]
