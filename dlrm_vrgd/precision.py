"""Numeric precision of the dense compute: ``run.precision``.

* ``fp32``: float32 everywhere (matmuls in full float32: ``torch.set_float32_matmul_precision
  ("highest")``).
* ``tf32``: float32 tensors, matmuls and convolutions on a GPU's TF32 units (10-bit mantissa
  products, float32 sums: ``"high"``); on a CPU the same as ``fp32``.
* ``bf16``: the MLPs and the interaction run under ``torch.autocast(dtype=bfloat16)`` on the
  run's device (a CPU included); the weights stay float32 (the master copy the optimizers
  update), gradients reach them in float32, and the loss is taken in float32 (autocast's list).

The embedding tables and everything the optimizers sum — GSNR's ``Σ g`` and ``Σ g²``, the noise
scale's, row-wise Adagrad's — stay float32 or wider whatever the precision: the pooled lookups
enter autocast as float32, and the gradients the optimizers collect are the float32 ``.grad`` of
float32 leaves.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Literal

import torch

Precision = Literal["fp32", "tf32", "bf16"]

logger = logging.getLogger(__name__)


def configure(
    precision: Precision, device: torch.device
) -> Callable[[], contextlib.AbstractContextManager]:
    """Set the process's matmul precision for ``precision`` and return the context the model's
    forward (and loss) runs under: autocast to bfloat16 for ``bf16``, nothing otherwise."""
    if precision not in ("fp32", "tf32", "bf16"):
        raise ValueError(f"Invalid precision: {precision!r} (fp32, tf32 or bf16)")
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
    elif precision == "tf32":
        logger.info("run.precision tf32 on %s: its matmuls are float32 (TF32 is a GPU's)", device)
    if precision != "bf16":
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
