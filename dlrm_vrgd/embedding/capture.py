"""Capture of pooled-embedding gradients, reduced to per-(row, group) row gradients.

A table-batched lookup (an FBGEMM TBE, or the pure-PyTorch backend) computes, for ``F``
features and ``B`` bags each, a pooled output ``B x ΣD_f``. :class:`LookupCapture` hooks the
lookup module: in training it hands the model a *detached leaf* copy of the output instead, so
the lookup's own backward (FBGEMM's fused optimizer update) never runs. After the model's
backward the leaf's ``.grad`` holds ``∂L/∂pooled``; :func:`pooled_grad_to_rows` turns it into the
gradient of every touched row, separately for each *group* of bags::

    g[row, group] = Σ_{bags b of group, j in b with indices[j] == row} w_j · ∂L/∂pooled[b, cols(f)]

with ``w_j`` the per-sample weight (1 when unweighted), divided by the bag length for mean pooling.
Rows of all features mapped to the same table are summed before anything else. The cost is one
sort of the ``nnz`` looked-up ids per table and an ``index_add`` of ``nnz x D`` values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

Pooling = Literal["sum", "mean"]


@dataclass(frozen=True)
class RowGrads:
    """Per-(row, group) gradients of one table, sorted by ``(row, group)``.

    ``rows`` U int64, ``groups`` U int64 (0..G-1 within the call), ``grads`` U x D float32.
    """

    rows: torch.Tensor
    groups: torch.Tensor
    grads: torch.Tensor

    @staticmethod
    def empty(dim: int, device: torch.device | None = None) -> RowGrads:
        z = torch.zeros(0, dtype=torch.int64, device=device)
        return RowGrads(z, z.clone(), torch.zeros(0, dim, device=device))


def pooled_grad_to_rows(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    grad: torch.Tensor,
    feature_table: list[int],
    table_dims: list[int],
    pooling: Pooling = "sum",
    num_groups: int = 1,
) -> list[RowGrads]:
    """Reduce the pooled-output gradient ``grad`` (B x ΣD_f) to row gradients per table.

    ``indices``/``offsets``/``per_sample_weights`` are the lookup's inputs in TBE layout
    (``offsets`` has ``F·B + 1`` entries, feature-major). Bags ``[g·B/G, (g+1)·B/G)`` form group
    ``g`` of ``G = num_groups`` (the owner of a sharded table receives the source ranks' bags in
    rank order). Returns one :class:`RowGrads` per table (empty where no row was touched).
    """
    num_features = len(feature_table)
    num_bags = (offsets.numel() - 1) // num_features
    if num_bags * num_features != offsets.numel() - 1:
        raise ValueError(f"offsets has {offsets.numel()} entries, not F*B+1 for F={num_features}")
    if num_bags % num_groups:
        raise ValueError(f"{num_bags} bags cannot be split into {num_groups} equal groups")
    per_group = num_bags // num_groups
    device = grad.device
    offsets = offsets.to(torch.int64)
    indices = indices.to(torch.int64)
    lengths = (offsets[1:] - offsets[:-1]).view(num_features, num_bags)

    col = 0
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in table_dims]
    for f, t in enumerate(feature_table):
        dim = table_dims[t]
        lo, hi = int(offsets[f * num_bags]), int(offsets[(f + 1) * num_bags])
        if hi > lo:
            bag = torch.repeat_interleave(torch.arange(num_bags, device=device), lengths[f])
            contrib = grad[bag, col : col + dim]
            scale = None
            if per_sample_weights is not None:
                scale = per_sample_weights[lo:hi].to(grad.dtype)
            if pooling == "mean":
                inv_len = 1.0 / lengths[f][bag].to(grad.dtype)
                scale = inv_len if scale is None else scale * inv_len
            if scale is not None:
                contrib = contrib * scale[:, None]
            key = indices[lo:hi] * num_groups + torch.div(bag, per_group, rounding_mode="floor")
            parts[t].append((key, contrib))
        col += dim
    if col != grad.shape[1]:
        raise ValueError(f"gradient has {grad.shape[1]} columns, features need {col}")

    out = []
    for t, dim in enumerate(table_dims):
        if not parts[t]:
            out.append(RowGrads.empty(dim, device))
            continue
        keys = torch.cat([k for k, _ in parts[t]])
        contrib = torch.cat([c for _, c in parts[t]])
        uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
        grads = torch.zeros(uniq.numel(), dim, dtype=grad.dtype, device=device)
        grads.index_add_(0, inverse, contrib)
        out.append(RowGrads(uniq // num_groups, uniq % num_groups, grads))
    return out


@dataclass
class _Call:
    indices: torch.Tensor
    offsets: torch.Tensor
    per_sample_weights: torch.Tensor | None
    leaf: torch.Tensor


class LookupCapture:
    """Forward hook that defers a lookup's backward: see the module docstring.

    ``feature_table[f]`` is the table of feature ``f``; ``table_dims[t]`` its embedding dim;
    ``weighted`` whether the lookup takes per-sample weights (replays must pass ones).
    The hook is active only while the module is training, grad mode is on and the capture is
    not :meth:`paused`. Call :meth:`take` after the backward of every captured forward.
    """

    def __init__(
        self,
        module: nn.Module,
        feature_table: list[int],
        table_dims: list[int],
        pooling: Pooling = "sum",
        groups_per_call: int = 1,
        weighted: bool = False,
    ) -> None:
        self.feature_table = list(feature_table)
        self.table_dims = list(table_dims)
        self.pooling: Pooling = pooling
        self.weighted = weighted
        self.groups_per_call = groups_per_call
        self._calls: list[_Call] = []
        self._paused = False
        self._handle = module.register_forward_hook(self._hook, with_kwargs=True)

    def remove(self) -> None:
        self._handle.remove()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Let the lookup run with its own autograd (used to replay the fused update)."""
        prev, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = prev

    @property
    def pending(self) -> int:
        return len(self._calls)

    def _hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        if self._paused or not module.training or not torch.is_grad_enabled():
            return None
        names = ("indices", "offsets", "per_sample_weights")
        bound = dict(zip(names, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        leaf = output.detach().requires_grad_(True)
        self._calls.append(
            _Call(bound["indices"], bound["offsets"], bound.get("per_sample_weights"), leaf)
        )
        return leaf

    def take(self) -> list[list[RowGrads]]:
        """Row gradients of every captured call since the last take (one list per call)."""
        calls, self._calls = self._calls, []
        out = []
        for call in calls:
            grad = call.leaf.grad
            if grad is None:  # the output did not reach the loss: all-zero gradient
                grad = torch.zeros_like(call.leaf)
            out.append(
                pooled_grad_to_rows(
                    call.indices,
                    call.offsets,
                    call.per_sample_weights,
                    grad,
                    self.feature_table,
                    self.table_dims,
                    self.pooling,
                    self.groups_per_call,
                )
            )
        return out
