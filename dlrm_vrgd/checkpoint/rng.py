"""The random generators a checkpoint keeps, so that a resumed run draws what it would have.

``rng`` in a rank's state holds:

- ``torch``: the CPU generator (dense weights are drawn on the CPU, DESIGN.md 7);
- ``cuda``, on a CUDA run only: the default generator of this rank's GPU. FBGEMM's CUDA
  backward draws the stochastic rounding of fp16 tables from it
  (``embedding_backward_split_template.cu``), so without it an fp16 run resumes on other
  roundings than it would have made.

A checkpoint written on the CPU resumed on a GPU keeps the GPU generator as the run's seed set
it; one written on a GPU resumed on the CPU ignores ``cuda``. Both are ``uint8`` vectors:
anything else is refused when the checkpoint is verified (:func:`problem`), before a generator
sees it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def capture(device: torch.device) -> dict[str, torch.Tensor]:
    """The generators a rank on ``device`` draws from (module docstring)."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore(state: dict[str, Any], device: torch.device) -> None:
    """Set the generators from :func:`capture`'s ``state`` (for a rank on ``device``)."""
    torch.set_rng_state(state["torch"])
    if device.type != "cuda":
        return
    saved = state.get("cuda")
    if saved is None:
        logger.info(
            "the checkpoint keeps no CUDA generator (written on the CPU or before it was kept): "
            "%s draws from the run's seed again",
            device,
        )
        return
    torch.cuda.set_rng_state(saved, device)


def problem(rng: Any) -> str | None:
    """Why ``rng`` (a rank state's ``rng``) cannot be restored, or None."""
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor):
        return "rng holds no torch generator state"
    if set(rng) - {"torch", "cuda"}:
        return f"rng holds unknown generators {sorted(set(rng) - {'torch', 'cuda'})}"
    for name, value in rng.items():
        if value is None and name == "cuda":
            continue
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
            return f"rng.{name} is not a uint8 vector"
    return None
