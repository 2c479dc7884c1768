"""The row-wise update of DESIGN.md 4.3 as a functional kernel: a few index ops on one row space.

For the touched rows ``rows`` (U, unique) of a row space with mean gradients ``ḡ`` (U x D) and
ratios ``r`` (U, in ``[γ, 1]``), the kernels of FBGEMM's fused optimizers are

* EXACT_ROWWISE_ADAGRAD: ``s_row += mean_D(g²)``, ``Δ_row = −lr · g / (√s_row + ε)``;
* EXACT_ADAGRAD (``adagrad``, element-wise): ``s += g⊙g`` (``U x D``),
  ``Δ_row = −lr · g / (√s + ε)`` element by element (ε outside the root, as FBGEMM's kernel);
* EXACT_SGD: ``Δ_row = −lr · g``,

and the ratio acts (``placement``)

* ``update``: ``g = ḡ``, the row moves by ``r_row · Δ_row``: exactly ``r_row`` times its plain
  step from the same state, whose sums see the unscaled gradient;
* ``gradient``: ``g = r_row · ḡ`` enters the kernel (its Adagrad normalisation largely cancels
  ``r``; the same as ``update`` for SGD).

:func:`scaled_rowwise_step` applies that in one pass: gather the rows' states, write the new
ones, add the steps to the weights — one gather and one write per buffer, whatever the number of
tables. With ``measure`` it also returns, per row, the realised step ``‖w_after − w_before‖`` (read
from what was written) and the plain step ``‖Δ_row‖`` of ``ḡ`` from the row's state before the step
(their ratio is the realised step ratio of the telemetry): the same pass, a write instead of an
add, so measuring costs no second update.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from dlrm_vrgd.embedding.views import RowSpaceView

Kernel = Literal["rowwise_adagrad", "adagrad", "sgd"]


def next_state(kernel: str, state: Tensor, grad: Tensor) -> Tensor:
    """The Adagrad sums after adding ``grad`` (U x D): row-wise ``s + mean_D g²`` (U),
    element-wise (``adagrad``) ``s + g⊙g`` (U x D)."""
    if kernel == "adagrad":
        return state + grad.square()
    return state + grad.square().mean(dim=1)


def plain_step(kernel: str, lr: float, eps: float, grad: Tensor, state: Tensor | None) -> Tensor:
    """``Δw_row`` (U x D) of the fused kernel's plain update of each row by ``grad`` (U x D),
    given the state *after* the update (U, the Adagrad sums including ``mean_D g²``; U x D
    element-wise, including ``g⊙g``): Adagrad ``−lr·g/(√s + ε)``, SGD ``−lr·g``."""
    if kernel == "sgd" or state is None:
        return grad * -lr
    if kernel == "adagrad":
        return grad * (-lr / (state.sqrt() + eps))
    return grad * (-lr / (state.sqrt() + eps))[:, None]


def plain_step_norm(
    kernel: str, lr: float, eps: float, grad: Tensor, state: Tensor | None
) -> Tensor:
    """``‖Δw_row‖`` of the fused kernel's plain update of each row by ``grad`` (U x D) from row
    state ``state`` (U, or U x D element-wise: the Adagrad sums *before* the step): row-wise
    Adagrad ``lr·‖g‖/(√(s + mean_D g²) + ε)``, element-wise ``lr·‖g/(√(s + g⊙g) + ε)‖``, SGD
    ``lr·‖g‖``."""
    after = None if state is None else next_state(kernel, state, grad)
    return torch.linalg.vector_norm(plain_step(kernel, lr, eps, grad, after), dim=1)


def scaled_rowwise_step(
    view: RowSpaceView,
    rows: Tensor,
    mean_grad: Tensor,
    ratio: Tensor,
    *,
    lr: float,
    eps: float,
    kernel: Kernel,
    placement: Literal["update", "gradient"],
    measure: bool = False,
) -> tuple[Tensor, Tensor] | None:
    """Update global ``rows`` (U, unique) of ``view`` by their mean gradients ``mean_grad``
    (U x D) scaled by ``ratio`` (U) as the module doc says; with ``measure`` return the rows'
    ``(‖realised step‖, ‖plain step‖)`` (U each), else None."""
    ratio = ratio.to(mean_grad.dtype)
    grad = mean_grad if placement == "update" else mean_grad * ratio[:, None]
    state_before = view.gather_states(rows) if kernel != "sgd" else None
    state = None
    if state_before is not None:
        state = next_state(kernel, state_before, grad)
        view.put_states_(rows, state)
    delta = plain_step(kernel, lr, eps, grad, state)
    plain = None
    if measure:
        if placement == "update":
            plain = torch.linalg.vector_norm(delta, dim=1)
        else:
            plain = plain_step_norm(kernel, lr, eps, mean_grad, state_before)
    if placement == "update":
        delta.mul_(ratio[:, None])
    if not measure:
        view.add_(rows, delta)
        return None
    before = view.gather(rows)
    after = view.rounded(before + delta, rows)  # what the write stores
    view.put_(rows, after)
    actual = torch.linalg.vector_norm(after.sub_(before), dim=1)
    assert plain is not None
    return actual, plain


def step_difference_bound(
    kernel: str,
    lr: float,
    mean: Tensor,
    mean_other: Tensor,
    ratio: Tensor,
    ratio_other: Tensor,
) -> Tensor:
    """How far apart two computations of one row step may land (U, a bound on
    ``‖Δ_row − Δ'_row‖``) when their mean gradients (U x D) and ratios (U) differ as given — e.g. a
    CPU's and a GPU's, whose sums ran in other orders. Row-wise Adagrad's step
    ``−lr·r·g/(√(s + mean_D g²) + ε)`` has a norm of about ``lr·√D`` on a row's first update,
    whatever ``‖g‖``: a perturbation ``δg`` turns its direction by ``‖δg‖/‖g‖``, so
    ``‖δΔ‖ ≤ lr·√D·(2·r·‖δg‖/‖g‖ + |δr|)`` (later updates, with a larger ``s``, move less). A
    row whose gradient is mostly cancellation (a small ``‖g‖`` from many large terms) carries the
    relative error of its terms times that cancellation: the step amplifies it, and two
    computations may differ by up to ``2·lr·√D`` on such a row. SGD: ``lr·(r·‖δg‖ + |δr|·‖g‖)``.
    Element-wise Adagrad (``adagrad``) normalises each element alone: an element near zero may
    turn by any perturbation, so its bound is that largest one, ``2·lr·√D``, wherever the two
    inputs differ at all."""
    delta = torch.linalg.vector_norm(mean - mean_other, dim=1)
    norm = torch.minimum(
        torch.linalg.vector_norm(mean, dim=1), torch.linalg.vector_norm(mean_other, dim=1)
    )
    r = torch.maximum(ratio, ratio_other)
    dr = (ratio - ratio_other).abs()
    if kernel == "sgd":
        return lr * (r * delta + dr * norm)
    dim = mean.shape[1]
    if kernel == "adagrad":
        differs = (delta > 0) | (dr > 0)
        return torch.where(differs, 2 * lr * dim**0.5, 0.0)
    unbounded = torch.where(delta > 0, float("inf"), 0.0)  # one of them is zero
    rel = torch.where(norm > 0, delta / norm.clamp_min(torch.finfo(norm.dtype).tiny), unbounded)
    # never above the largest move two steps of norm lr·√D can differ by
    return (lr * dim**0.5 * (2 * r * rel + dr)).clamp_max(2 * lr * dim**0.5)
